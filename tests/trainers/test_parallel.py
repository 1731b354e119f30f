"""torchrun with DDP and FSDP2 (gloo, 2 CPU ranks): the same losses as one process with the same global
batch, sharded FSDP2 parameters, sharded checkpoints that resume on a different number of ranks.

The runs are tests/trainers/dist_worker.py, 3 steps of the tiny model; one process runs 2 micro-batches
of accumulation where 2 ranks run 1 each. The default run checks SFT under DDP and FSDP2 (one torchrun
start) and a 2-rank checkpoint resumed on 1 rank; DPO and GRPO under both strategies and the 1 -> 2
resume are marked slow (each torchrun start costs ~15-30 s on a 2-core machine).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tether.trainers.distributed import DistInfo, all_gather_rows, reduce_metrics
from tether.trainers.parallel import full_parameters, global_advantages, unwrap, wrap_model

WORKER = Path(__file__).with_name("dist_worker.py")
RTOL = 1e-5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_worker(out: Path, jobs: str, *, nproc: int, resume: bool = False) -> None:
    """The worker's ``jobs`` (``trainer:strategy,...``): in this process for 1 rank, else under
    ``torchrun --nproc_per_node=nproc`` (failing with its output)."""
    args = [str(out), jobs] + (["--resume"] if resume else [])
    if nproc == 1:
        spec = importlib.util.spec_from_file_location("dist_worker", WORKER)
        worker = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(worker)
        worker.main(args)
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master_port={free_port()}", str(WORKER), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


def losses(run: Path, stage: str) -> dict[int, float]:
    """The logged loss per step (the last record of a step, as a resumed run logs it again)."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["stage"] == stage and "loss" in r}


def max_relative_difference(a: dict[int, float], b: dict[int, float]) -> float:
    assert a.keys() == b.keys(), (a, b)
    return max(abs(a[k] - b[k]) / max(abs(b[k]), 1e-12) for k in a)


def check_matches(reference: Path, run: Path, stage: str, label: str) -> None:
    diff = max_relative_difference(losses(run, stage), losses(reference, stage))
    print(f"{label} {stage}: max relative loss difference vs one process {diff:.2e}")
    assert diff <= RTOL


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    """SFT in one process, global batch = 2 micro-batches accumulated; strategy fsdp2, so its step-2
    checkpoint is a (one-rank) sharded checkpoint. The run is ``single/fsdp2``."""
    out = tmp_path_factory.mktemp("single")
    run_worker(out, "sft:fsdp2", nproc=1)
    return out / "fsdp2"


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> Path:
    """SFT on 2 ranks, 1 micro-batch each: under DDP (``two_ranks/ddp``) and FSDP2 (``two_ranks/fsdp2``)."""
    out = tmp_path_factory.mktemp("two")
    run_worker(out, "sft:ddp,sft:fsdp2", nproc=2)
    return out


def test_ddp_sft_matches_single_process(single, two_ranks):
    check_matches(single, two_ranks / "ddp", "sft", "ddp")


def test_fsdp2_sft_matches_single_process_and_shards_parameters(single, two_ranks):
    run = two_ranks / "fsdp2"
    check_matches(single, run, "sft", "fsdp2")
    layout = json.loads((run / "sft" / "placements.json").read_text())
    assert all(p["placements"] == ["Shard"] for p in layout.values()), layout
    embed = layout["model.embed_tokens.weight"]
    assert embed["local"][0] in (embed["global"][0] // 2, embed["global"][0] // 2 + 1)
    # the exported final model is whole, in the Hugging Face layout
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(run / "sft")
    reference = AutoModelForCausalLM.from_pretrained(single / "sft")
    for (name, a), b in zip(exported.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)


def resumable_copy(src: Path, dst: Path, stage: str) -> Path:
    """``src``'s run, cut back to its step-2 checkpoint (the later one removed, the stage unfinished)."""
    shutil.copytree(src, dst)
    for path in (dst / stage / "checkpoints").iterdir():
        if path.name != "step-000002":
            shutil.rmtree(path)
    (dst / stage / "stage.json").unlink()
    return dst


def test_two_rank_fsdp2_checkpoint_resumes_on_one_rank(single, two_ranks, tmp_path):
    shards = two_ranks / "fsdp2" / "sft" / "checkpoints" / "step-000002" / "dcp"
    assert {p.name for p in shards.glob("*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}
    resumable_copy(two_ranks / "fsdp2", tmp_path / "fsdp2", "sft")
    run_worker(tmp_path, "sft:fsdp2", nproc=1, resume=True)
    check_matches(single, tmp_path / "fsdp2", "sft", "fsdp2 2 ranks -> 1")


@pytest.mark.slow
def test_one_rank_fsdp2_checkpoint_resumes_on_two_ranks(single, tmp_path):
    resumable_copy(single, tmp_path / "fsdp2", "sft")
    run_worker(tmp_path, "sft:fsdp2", nproc=2, resume=True)
    check_matches(single, tmp_path / "fsdp2", "sft", "fsdp2 1 rank -> 2")


@pytest.mark.slow
def test_dpo_and_grpo_match_single_process(tmp_path):
    run_worker(tmp_path / "one", "dpo:ddp,grpo:ddp", nproc=1)
    run_worker(tmp_path / "two", "dpo:ddp,grpo:ddp,dpo:fsdp2,grpo:fsdp2", nproc=2)
    for strategy in ("ddp", "fsdp2"):
        for stage in ("dpo", "grpo"):
            check_matches(tmp_path / "one" / "ddp", tmp_path / "two" / strategy, stage, strategy)


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["grpo_async", "ppo_async"])
def test_async_rl_on_two_ranks_resumes_each_ranks_requests(tmp_path, stage):
    """Async GRPO and PPO (one version behind) under torchrun: a producer per rank samples that rank's prompts.
    A run resumed from its step-2 checkpoint ends on the uninterrupted run's weights (PPO: and critic): the
    checkpoint (rank 0's) holds rank 0's requested prompts, and each rank recomputes its own from the cursor."""
    run_worker(tmp_path / "full", f"{stage}:ddp", nproc=2)
    resumable_copy(tmp_path / "full" / "ddp", tmp_path / "cut" / "ddp", stage)
    run_worker(tmp_path / "cut", f"{stage}:ddp", nproc=2, resume=True)
    full, cut = tmp_path / "full" / "ddp", tmp_path / "cut" / "ddp"
    assert losses(cut, stage) == losses(full, stage)
    assert all(v != 0 for v in metric(full, stage, "advantage/advantage_std").values())  # it trains
    staleness = metric(full, stage, "async/staleness_max")
    assert [staleness[s] for s in sorted(staleness)] == [0.0, 1.0, 1.0]
    a, b = final_weights(full, stage), final_weights(cut, stage)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def final_weights(run: Path, stage: str) -> dict[str, torch.Tensor]:
    """The stage's exported policy and (PPO) critic weights."""
    from safetensors.torch import load_file

    files = sorted((run / stage).glob("model*.safetensors")) + sorted((run / stage / "value").glob("model*.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for file in files:
        out.update({f"{file.parent.name}/{k}": v for k, v in load_file(file).items()})
    return out


def metric(run: Path, stage: str, key: str) -> dict[int, float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in records if r["stage"] == stage and key in r}


def test_ppo_matches_single_process(tmp_path):
    """PPO on 2 ranks (DDP) is the single-process run: the same losses and critic losses per step (reward
    normalisation, GAE whitening and the adaptive KL coefficient use the whole job's batch), and the same
    final policy and critic weights (the worker's AdamW has eps 1, so an update is linear in the gradient).
    The first step is a critic warm-up, whose loss reaches the critic without DDP's forward: without the
    trainer's own averaging of its gradients each rank's critic went its own way (weights 1.7e-2 apart)."""
    run_worker(tmp_path / "one", "ppo:ddp", nproc=1)
    run_worker(tmp_path / "two", "ppo:ddp", nproc=2)
    one, two = tmp_path / "one" / "ddp", tmp_path / "two" / "ddp"
    check_matches(one, two, "ppo", "ddp")
    for key in ("value/loss", "grad_norm", "advantage/advantage_std", "kl_coef", "kl/sequence", "entropy"):
        expected, got = metric(one, "ppo", key), metric(two, "ppo", key)
        assert expected.keys() == got.keys() and len(expected) == (2 if key == "entropy" else 3), key  # warm-up
        for step in expected:  # absolute slack for values at float noise (the KL of step 1 is ~1e-7 or 0)
            assert got[step] == pytest.approx(expected[step], rel=RTOL, abs=1e-6), (key, step)
    a, b = final_weights(one, "ppo"), final_weights(two, "ppo")
    assert a.keys() == b.keys() and any(k.startswith("value/") for k in a)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-6, atol=1e-7)


def test_sharded_checkpoint_exports_to_the_hugging_face_layout(single, tmp_path):
    from transformers import AutoModelForCausalLM

    from tether.trainers.parallel import export_checkpoint

    exported = export_checkpoint(single / "sft" / "checkpoints" / "step-000002", tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(exported)
    assert (exported / "tokenizer.json").exists() and not (exported / "trainer_state.pt").exists()
    assert sum(p.numel() for p in model.parameters()) > 0


# ---- single-process behaviour of the distributed helpers --------------------------------------------


def test_helpers_are_identities_in_one_process():
    from tether.core.advantages import AdvantageInputs, compute_advantages

    model = torch.nn.Linear(2, 2)
    assert wrap_model(model, "fsdp2") is model and wrap_model(model, "ddp") is model and unwrap(model) is model
    with full_parameters(model):
        pass
    assert reduce_metrics({"loss": torch.tensor(2.0), "n": 3}) == {"loss": 2.0, "n": 3.0}
    x = torch.arange(6.0).view(2, 3)
    assert all_gather_rows(x)[0] is x
    inputs = AdvantageInputs(rewards=torch.tensor([1.0, 0.0, 0.5, 0.5]), mask=torch.ones(4, 3), group_size=2)
    torch.testing.assert_close(global_advantages("grpo", inputs).advantages,
                               compute_advantages("grpo", inputs).advantages)
    with pytest.raises(ValueError, match="valid: ddp, fsdp2"):
        wrap_model(model, "zero3")


def test_rl_ranks_draw_the_single_process_prompts_in_whole_groups(tmp_path):
    from tether.config.rl import GRPOConfig
    from tether.models import build_tiny
    from tether.trainers.rl import RLTrainer

    def draws(rank: int, world: int, batch: int) -> list[int]:
        model, tokenizer = build_tiny("tiny", seed=0)
        cfg = GRPOConfig(data={"task": {"name": "arithmetic", "n": 10}}, train={"batch_size": batch, "progress": False},
                         rewards=[{"name": "length", "kwargs": {"target": 5}}], report_to=[])
        trainer = RLTrainer(cfg, model, tokenizer, tmp_path / f"{rank}-{world}")
        trainer.dist = DistInfo(rank=rank, world_size=world)
        return [i for _ in range(4) for i in trainer.next_prompts(batch)]  # 4 steps: crosses an epoch

    single = draws(0, 1, 4)
    ranks = [draws(r, 2, 2) for r in range(2)]
    for step in range(4):
        together = ranks[0][2 * step:2 * step + 2] + ranks[1][2 * step:2 * step + 2]
        assert sorted(together) == sorted(single[4 * step:4 * step + 4])


def test_sft_and_dpo_batches_are_the_same_global_batch_on_one_or_two_ranks():
    from tether.data import make_batches
    from tether.data.tokenize import TokenizedExample
    from tether.trainers.reward import BatchSchedule

    examples = [TokenizedExample(list(range(3 + i % 5)), list(range(3 + i % 5))) for i in range(40)]

    def sft(rank, world, accum, step):
        batches = make_batches(examples, batch_size=4, seed=1, rank=rank, world_size=world, drop_last=True)
        return [b["input_ids"].tolist() for b in batches[step * accum:(step + 1) * accum]]

    def dpo(rank, world, accum, step):
        return BatchSchedule(40, batch_size=4, grad_accum=accum, seed=1, rank=rank, world_size=world).for_step(step)

    for fn in (sft, dpo):
        for step in range(3):
            one = fn(0, 1, 2, step)
            two = fn(0, 2, 1, step) + fn(1, 2, 1, step)
            assert sorted(map(str, one)) == sorted(map(str, two))
