"""Every built-in recipe at a trivial size on an accelerator, and the rollout engine's speed there.

    python benchmarks/device_check.py [--device cuda] [--dtype bfloat16] [--recipes a,b] [--jobs 4]
                                      [--out device_check.json]

CI has no GPU, so this is how the device paths are checked by hand on a machine that has one:

1. every built-in recipe runs end to end (``tether run``, one subprocess each, ``--jobs`` at a time)
   with ``defaults.model.device`` / ``defaults.model.dtype`` set and every stage cut to 2 optimiser
   steps, 4 examples and 4 evaluation prompts: a recipe passes when it exits 0 with its
   ``results.json`` written, or when it stops at one of its data guards (a model trained for two
   steps writes nothing a verifier keeps, so the distillation corpus is empty) after the stages
   before it ran; and variants that take other device paths (GiGPO, LoRA policy with PPO and
   GRPO, KTO, cascade attention in GRPO and DPO, continuous batching, the sampler's log-probs as
   the old policy's, ``bf16-mixed`` SFT, GRPO and PPO);
2. the rollout engine on the device: greedy decoding agrees token for token with ``model.generate``
   (float32), and its tokens/s against ``model.generate`` (batch 64, 32 new tokens, sampled, EOS
   ignored, ``--dtype``) on the ``tiny`` and ``small`` models;
3. frozen passes under ``bf16-mixed``: a pass without gradients of packed rows gives the training
   forward's logits bit for bit (the attention kernel must not depend on whether gradients are taken,
   or a policy equal to its reference does not score 0).

Prints one line per check and writes them all as JSON (``--out``). ``--device cpu`` runs the same
checks here (slowly), which is how the script itself is tested.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import synchronize

# per stage: the overrides that shrink it, tried one by one and kept where the stage's config takes them
SHRINK = {"train.max_steps": 2, "train.batch_size": 4, "eval.n": 4, "eval.max_new_tokens": 8,
          "data.task.n": 16, "rounds": 1, "iterations": 1, "n": 4, "max_new_tokens": 8,
          "rollout.max_new_tokens": 8, "rollout.group_size": 2, "prompts.task.n": 16, "sampling.n": 2,
          "sampling.max_new_tokens": 8, "prompts_per_round": 8}
# A model trained for 2 steps writes nothing a checker keeps: these clean stops of a recipe are not device faults.
DATA_GUARDS = ("no records", "kept none", "corpus is empty", "no pairs:")


# variants of a recipe that take other device paths: (label, recipe, overrides)
VARIANTS = [
    ("agent-arithmetic+gigpo", "agent-arithmetic", ["grpo.gigpo={weight: 1.0}"]),
    ("r1-arithmetic+lora", "r1-arithmetic", ["grpo.model.lora={r: 4}"]),
    ("instructgpt+lora", "instructgpt", ["ppo.model.lora={r: 4}"]),
    ("dpo-arithmetic+kto", "dpo-arithmetic", ["dpo.loss=kto"]),
    ("r1-zero-arithmetic+cascade", "r1-zero-arithmetic", ["grpo.prefix_sharing=cascade"]),
    ("dpo-arithmetic+cascade", "dpo-arithmetic", ["dpo.data.prefix_sharing=cascade"]),
    ("r1-zero-arithmetic+continuous", "r1-zero-arithmetic", ["grpo.rollout.engine_options={continuous: true}"]),
    ("r1-zero-arithmetic+sampler-logprobs", "r1-zero-arithmetic", ["grpo.old_logprobs=sampler"]),
    # bf16-mixed keeps float32 master weights: the model loads in float32 and the trainer autocasts
    ("sft-arithmetic+bf16-mixed", "sft-arithmetic", ["defaults.model.dtype=float32", "sft.train.precision=bf16-mixed"]),
    ("r1-zero-arithmetic+bf16-mixed", "r1-zero-arithmetic",
     ["defaults.model.dtype=float32", "grpo.train.precision=bf16-mixed"]),
    ("instructgpt+bf16-mixed", "instructgpt", ["defaults.model.dtype=float32", "ppo.train.precision=bf16-mixed"]),
]


def shrink_overrides(recipe: str) -> list[str]:
    """``STAGE.key=value`` overrides that cut every stage of ``recipe`` to a trivial size."""
    import tether.stages  # noqa: F401  (registers the stage types)
    from tether.config import ConfigError
    from tether.stages.pipeline import apply_recipe_overrides, load_recipe, validate_recipe

    data = load_recipe(recipe)
    kept: list[str] = []
    for stage in data["stages"]:
        for key, value in SHRINK.items():
            trial = [*kept, f"{stage['name']}.{key}={value}"]
            try:
                validate_recipe(apply_recipe_overrides(data, trial))
            except (ConfigError, ValueError, TypeError):
                continue
            kept = trial
    return kept


def run_recipe(recipe: str, device: str, dtype: str, scratch: Path, timeout: float,
               extra: tuple[str, list[str]] | None = None) -> dict[str, Any]:
    """``tether run`` of ``recipe`` shrunk, on ``device``; ``extra``: (label, more overrides) for a variant."""
    label, more = extra or (recipe, [])
    out = scratch / label
    cmd = [sys.executable, "-m", "tether.cli", "run", recipe, "--out", str(out),
           f"defaults.model.device={device}", f"defaults.model.dtype={dtype}", *shrink_overrides(recipe), *more]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
        rc, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as err:
        rc, text = -1, f"timed out after {timeout:.0f}s\n{err.stdout or ''}{err.stderr or ''}"
    ok = rc == 0 and (out / "results.json").exists()
    last = str(text).strip().splitlines()[-1:] or [""]
    if not ok and any(guard in last[0] for guard in DATA_GUARDS):
        ran = sorted(p.parent.name for p in out.glob("*/stage.json"))
        return {"check": f"recipe {label}", "ok": True, "seconds": round(time.perf_counter() - start, 1),
                "detail": f"stopped at a data guard after stages {', '.join(ran)}: {last[0][:200]}"}
    return {"check": f"recipe {label}", "ok": ok, "seconds": round(time.perf_counter() - start, 1),
            "detail": "" if ok else "\n".join(str(text).splitlines()[-40:])}


def engine_checks(device: str, dtype: str) -> list[dict[str, Any]]:
    from tether.models import build_tiny
    from tether.rollout import HFEngine, SamplingParams
    from tether.tasks import get_task, rl_records

    rows = []
    prompts_text = [r["prompt"] for r in rl_records(get_task("arithmetic"), 64, seed=0)]
    for size in ("tiny", "small"):
        model, tokenizer = build_tiny(size, seed=0)
        model.to(device).eval()
        prompts = [tokenizer.encode(p, add_special_tokens=False) for p in prompts_text]
        enc = tokenizer.pad([{"input_ids": p} for p in prompts], padding_side="left", return_tensors="pt").to(device)
        engine = HFEngine(model, tokenizer)
        # greedy agreement in float32
        greedy = engine.generate(prompts[:16], SamplingParams(max_new_tokens=16, temperature=0.0))
        with torch.inference_mode():
            ref = model.generate(input_ids=enc["input_ids"][:16], attention_mask=enc["attention_mask"][:16],
                                 do_sample=False, max_new_tokens=16, pad_token_id=tokenizer.pad_token_id)
        ref = ref[:, enc["input_ids"].shape[1]:].tolist()
        same = sum(list(a) == b[:len(a)] for a, b in zip(greedy.completion_ids, ref, strict=True))
        rows.append({"check": f"engine greedy == model.generate ({size}, float32)", "ok": same == 16,
                     "detail": f"{same}/16 rows identical"})
        # speed: sampled, EOS ignored, 64 x 32 tokens
        model.to(getattr(torch, dtype))
        engine = HFEngine(model, tokenizer)
        engine.eos_ids = []
        params = SamplingParams(max_new_tokens=32, seed=0)
        kwargs = dict(do_sample=True, max_new_tokens=32, min_new_tokens=32, top_k=0, top_p=1.0, temperature=1.0,
                      pad_token_id=tokenizer.pad_token_id)

        def tether_run(engine=engine, prompts=prompts, params=params) -> int:
            return sum(len(c) for c in engine.generate(prompts, params).completion_ids)

        def hf_run(model=model, enc=enc, kwargs=kwargs) -> int:
            with torch.inference_mode():
                return int(model.generate(**enc, **kwargs)[:, enc["input_ids"].shape[1]:].numel())

        speeds = {}
        for name, fn in (("tether", tether_run), ("model.generate", hf_run)):
            fn()
            synchronize(device)
            start = time.perf_counter()
            tokens = sum(fn() for _ in range(3))
            synchronize(device)
            speeds[name] = tokens / (time.perf_counter() - start)
        rows.append({"check": f"engine tokens/s ({size}, {dtype})", "ok": True,
                     "detail": f"tether {speeds['tether']:,.0f} vs model.generate {speeds['model.generate']:,.0f}: "
                               f"{speeds['tether'] / speeds['model.generate']:.2f}x",
                     "tether": speeds["tether"], "baseline": speeds["model.generate"]})
    return rows


def frozen_pass_checks(device: str) -> list[dict[str, Any]]:
    """Under the training autocast, logits of packed rows with and without gradients are identical."""
    from tether.data.packing import pack_sequences
    from tether.models import build_tiny
    from tether.models.attention import training_autocast

    rows = []
    g = torch.Generator().manual_seed(0)
    sequences = [torch.randint(3, 60, (n,), generator=g).tolist() for n in (9, 17, 5, 30, 12, 40, 7)]
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v
              for k, v in pack_sequences(sequences, row_tokens=48, pad_token_id=0).model_inputs().items()}
    for size in ("tiny", "small"):
        model, _ = build_tiny(size, seed=0)
        model.to(device)

        def logits(grad: bool, model=model) -> torch.Tensor:
            with torch.set_grad_enabled(grad), training_autocast(model, torch.device(device)):
                return model(**inputs).logits.detach().float()

        diff = (logits(True) - logits(False)).abs().max().item()
        rows.append({"check": f"frozen pass == training forward ({size}, bf16-mixed)", "ok": diff == 0.0,
                     "detail": f"largest logit difference {diff:.3g}"})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--recipes", default="", help="comma-separated (default: every built-in recipe)")
    parser.add_argument("--jobs", type=int, default=4, help="recipes run at once")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per recipe")
    parser.add_argument("--no-engine", action="store_true", help="skip the engine and frozen-pass checks")
    parser.add_argument("--out", type=Path, default=Path("device_check.json"))
    args = parser.parse_args(argv)
    if args.out is not None and args.out.is_dir():  # written at the end: refused before the work, not after
        parser.error(f"--out names the JSON file to write, not the folder {str(args.out)!r}")

    from tether.stages.pipeline import builtin_recipes

    recipes = [r for r in args.recipes.split(",") if r] or sorted(builtin_recipes())
    env = {"torch": torch.__version__, "device": args.device, "dtype": args.dtype}
    if args.device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name()
    print(json.dumps(env), flush=True)
    rows: list[dict[str, Any]] = []

    def report(row: dict[str, Any]) -> None:
        rows.append(row)
        print(f"{'PASS' if row['ok'] else 'FAIL'} {row['check']} {row.get('seconds', '')} "
              f"{row['detail'] if row['ok'] else ''}", flush=True)
        if not row["ok"]:
            print("    " + row["detail"].replace("\n", "\n    "), flush=True)

    if not args.no_engine:
        try:
            for row in [*engine_checks(args.device, args.dtype), *frozen_pass_checks(args.device)]:
                report(row)
        except Exception:
            report({"check": "engine", "ok": False, "detail": traceback.format_exc()})
    with tempfile.TemporaryDirectory() as scratch, \
            concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(run_recipe, r, args.device, args.dtype, Path(scratch), args.timeout)
                   for r in recipes]
        futures += [pool.submit(run_recipe, recipe, args.device, args.dtype, Path(scratch), args.timeout,
                                (label, more)) for label, recipe, more in VARIANTS if recipe in recipes]
        for future in concurrent.futures.as_completed(futures):
            report(future.result())
    args.out.write_text(json.dumps({"environment": env, "checks": rows}, indent=1))
    failed = [r["check"] for r in rows if not r["ok"]]
    print(f"{len(rows) - len(failed)}/{len(rows)} passed" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
