"""A run is a pure function of its configuration: fresh processes with different PYTHONHASHSEED give
byte-identical weights and the same metrics.jsonl (apart from the wall-clock fields), and the command
line and the Python API give the same results.json. One short stage of each kind: SFT, GRPO, DPO, PPO."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tether.stages.pipeline import run_recipe
from tether.trainers.metrics import is_wall_clock

RECIPE = Path(__file__).with_name("determinism.yaml")
STAGES = ("sft", "grpo", "dpo", "ppo")


def run_cli(out: Path, hash_seed: str, *overrides: str) -> None:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    done = subprocess.run([sys.executable, "-m", "tether", "run", str(RECIPE), "--out", str(out), *overrides],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def metrics(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not is_wall_clock(k)} for row in rows]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("determinism") / "hash-1"
    run_cli(out, "1")
    return out


def test_fresh_processes_with_different_hash_seeds_give_identical_weights_and_metrics(first_run, tmp_path):
    run_cli(tmp_path / "hash-2", "2")
    for stage in STAGES:
        weights = [(out / stage / "model.safetensors").read_bytes() for out in (first_run, tmp_path / "hash-2")]
        assert weights[0] == weights[1], stage
    assert metrics(first_run) == metrics(tmp_path / "hash-2")
    # every stage trained: its weights moved from the ones it started from
    sft = (first_run / "sft" / "model.safetensors").read_bytes()
    assert all((first_run / s / "model.safetensors").read_bytes() != sft for s in ("grpo", "dpo", "ppo"))
    logged = {k for row in metrics(first_run) for k in row}
    assert {"policy/loss", "value/loss", "rewards/margin"} <= logged  # GRPO / PPO and DPO metrics were compared


def test_the_python_api_and_the_command_line_give_the_same_results(first_run, tmp_path):
    recipe = yaml.safe_load(RECIPE.read_text())
    run_recipe(recipe, tmp_path / "api", report=False)
    assert (tmp_path / "api" / "results.json").read_text() == (first_run / "results.json").read_text()
    for stage in STAGES:
        assert (tmp_path / "api" / stage / "model.safetensors").read_bytes() == \
            (first_run / stage / "model.safetensors").read_bytes(), stage


def test_the_recipe_seed_moves_every_stage(first_run, tmp_path):
    run_cli(tmp_path / "seed-1", "1", "seed=1")
    for stage in STAGES:
        assert (tmp_path / "seed-1" / stage / "model.safetensors").read_bytes() != \
            (first_run / stage / "model.safetensors").read_bytes(), stage
    samples = [json.loads(line) for line in (tmp_path / "seed-1" / "grpo" / "samples.jsonl").read_text().splitlines()]
    first = [json.loads(line) for line in (first_run / "grpo" / "samples.jsonl").read_text().splitlines()]
    assert [s["prompt"] for s in samples] != [s["prompt"] for s in first]  # other training problems


def test_deterministic_mode_sets_the_environment_and_refuses_several_cpu_threads(tmp_path):
    check = ("import os; from tether.core.determinism import enable_determinism; warnings = enable_determinism(); "
             "import torch; assert torch.are_deterministic_algorithms_enabled() and not warnings; "
             "assert os.environ['MKL_CBWR'] == 'COMPATIBLE' and os.environ['CUBLAS_WORKSPACE_CONFIG'] == ':4096:8'")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MKL_", "CUBLAS_"))}
    done = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    done = subprocess.run([sys.executable, "-m", "tether", "run", str(RECIPE), "--deterministic", "--out",
                           str(tmp_path / "run"), "*.train.threads=2"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "threads=2" in done.stdout and "not bitwise reproducible" in done.stdout
    assert not (tmp_path / "run" / "sft" / "stage.json").exists()
