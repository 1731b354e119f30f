"""Smoke test of the TRL side-by-side benchmark at a trivial size, so the script cannot rot.

It checks the shape of the output and that both libraries did the same work; it asserts nothing about
speed (timings on a shared machine are noise; the real figures come from ``python benchmarks/run.py``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("trl") is None:  # found, not imported: see run_script
    pytest.skip("the benchmark compares against TRL (pip install -e '.[bench]')", allow_module_level=True)

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def run_script(name: str, *args: str) -> None:
    """Run a benchmark script in its own process: TRL pulls in pyarrow, whose allocator starts a background
    thread, and the profiler starts its own; neither may stay in the test process, which later forks."""
    result = subprocess.run([sys.executable, str(BENCH / name), *args], capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def test_quick_benchmark_writes_every_row(tmp_path):
    out = tmp_path / "bench.json"
    run_script("run.py", "--quick", "--runs", "1", "--models", "tiny", "--threads", "1", "--out", str(out),
               "--precisions", "fp32,bf16-mixed")
    data = json.loads(out.read_text())
    rows = data["rows"]
    expected = {("sft", "tokens/s"), ("sft", "loss_tokens/s"), ("dpo", "pairs/s"), ("grpo", "completions/s"),
                ("grpo_beta0", "completions/s"), ("generation", "tokens/s"), ("generation_fixed", "tokens/s")}
    assert {(p, r["workload"], r["metric"]) for r in rows for p in [r["precision"]]} == {
        (p, *e) for p in ("fp32", "bf16-mixed") for e in expected}
    for row in rows:
        assert row["load_before"] >= 0 and row["load_after"] >= 0 and isinstance(row["under_load"], bool)
        assert row["load_during"] >= 0
        if row["precision"] == "bf16-mixed":
            fp32 = next(r for r in rows if r["precision"] == "fp32" and r["workload"] == row["workload"]
                        and r["metric"] == row["metric"])
            assert row["over_own_fp32"] == pytest.approx(row["tether"] / fp32["tether"])
        assert row["model"] == "tiny" and row["runs"] == 1
        assert row["tether"] > 0 and row["trl"] > 0
        assert row["ratio"] == pytest.approx(row["tether"] / row["trl"])
        assert row["paired_ratios"] == [pytest.approx(row["ratio"])]  # one run: its pair is the ratio
        generation = row["workload"].startswith("generation")
        assert row["baseline"] == ("model.generate" if generation else "trl")
        if not generation:
            trajectory = row["trajectory"]
            assert trajectory["ok"], trajectory  # both libraries computed the same losses / rewards
    sft = next(r for r in rows if r["workload"] == "sft")
    # same weights, same loss definition: the first SFT losses agree closely even with different batches
    assert sft["trajectory"]["tether_first"] == pytest.approx(sft["trajectory"]["trl_first"], rel=0.05)
    assert out.with_suffix(".md").read_text().count("| tiny |") == len(rows)


def test_quick_profile_counts_the_same_matmul_flops_on_both_sides(tmp_path):
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("tether_bench_profile", BENCH / "profile_ops.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.matmul_flops_of("aten::mm", [[2, 3], [3, 4]]) == 2 * 2 * 3 * 4
    assert module.matmul_flops_of("aten::addmm", [[4], [2, 3], [3, 4]]) == 2 * 2 * 3 * 4
    assert module.matmul_flops_of("aten::bmm", [[5, 2, 3], [5, 3, 4]]) == 5 * 2 * 2 * 3 * 4
    assert module.matmul_flops_of("mkldnn::_linear_pointwise", [[2, 3], [4, 3], [], [], [], []]) == 2 * 2 * 3 * 4
    assert module.matmul_flops_of("mkldnn::_linear_pointwise", [[2, 3], [], [], [], [], []]) == 0  # prepacked
    out = tmp_path / "profile.json"
    # one precision: bf16-mixed runs the same profiling code (the benchmark's quick test runs both precisions)
    run_script("profile_ops.py", "--quick", "--models", "tiny", "--workloads", "sft,generation_fixed", "--threads",
               "1", "--precisions", "fp32", "--top", "3", "--out", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [(r["precision"], r["workload"], r["baseline"]) for r in rows] == [
        ("fp32", "sft", "trl"), ("fp32", "generation_fixed", "model.generate")]
    for row in rows:
        ours, theirs = row["tether"], row[row["baseline"]]
        assert 0 < ours["matmul_s"] <= ours["seconds"] and ours["matmul_gflop"] > 0
        # the profile is the evidence that both sides did the same matrix work
        assert ours["matmul_gflop"] == pytest.approx(theirs["matmul_gflop"], rel=0.25)
        assert row["ceiling"] > 0
        for side in (ours, theirs):  # --top 3: the three operators with the most self time, most first
            times = [op["self_s"] for op in side["top_ops"]]
            assert len(times) == 3 and times == sorted(times, reverse=True) and all(op["calls"] > 0 for op in side["top_ops"])
    text = out.with_suffix(".md").read_text()
    assert text.count("| tiny |") == 2 * len(rows)
    assert text.count("Top operators by self CPU time") == len(rows)
    assert f"`{rows[0]['tether']['top_ops'][0]['op']}`" in text


@pytest.mark.skipif(not hasattr(os, "waitid"), reason="waits for the burner without reaping it (POSIX waitid)")
def test_load_during_a_row_counts_a_process_that_starts_and_ends_inside_it():
    """The before / after samples miss a process that lives only inside the row; the busy-time measure does
    not. The burner is waited for without being reaped, so its CPU time is not this process's children's."""
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("tether_bench_run", BENCH / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.8:\n    pass"
    with module.LoadDuring() as during:
        burner = subprocess.Popen([sys.executable, "-c", burn])
        os.waitid(os.P_PID, burner.pid, os.WEXITED | os.WNOWAIT)
    burner.wait()
    assert during.cores > 0.3


def test_quick_benchmark_with_cascade_prefix_sharing(tmp_path):
    out = tmp_path / "bench.json"
    run_script("run.py", "--quick", "--runs", "1", "--models", "tiny", "--threads", "1", "--out", str(out),
               "--workloads", "dpo,grpo", "--prefix-sharing", "cascade")
    data = json.loads(out.read_text())
    assert data["meta"]["prefix_sharing"] == "cascade" and "commit" in data["meta"]
    assert {r["workload"] for r in data["rows"]} == {"dpo", "grpo"}
    assert all(r["trajectory"]["ok"] for r in data["rows"]), data["rows"]
    assert "prefix sharing cascade" in out.with_suffix(".md").read_text()


def test_markdown_names_the_cpu_and_the_ceiling_of_the_mfu_row():
    sys.path.insert(0, str(BENCH))
    try:
        import run
    finally:
        sys.path.remove(str(BENCH))
    assert run.cpu_model().strip()  # a processor name, or the architecture where none can be read
    meta = {"tether": "x", "trl": "y", "torch": "z", "machine": "Some CPU, 2 cores", "threads": 2,
            "date": "2026-12-06", "runs": 5}
    mfu = {"precision": "fp32", "tether_mfu": 0.5, "tether_gflops": 95.0, "trl_mfu": 0.4, "trl_gflops": 76.0,
           "matmul_peak_gflops": 190.0}
    text = run.markdown([], [mfu], meta)
    assert "Some CPU, 2 cores" in text
    assert "tether 50.0% (95.0 GFLOP/s), TRL 40.0%" in text
    assert "tether would be 2.50x TRL" in text  # 1 / TRL's MFU: all of the step in matmuls at the peak
    assert "emulated" not in text
    assert "bf16 rows measure the emulation" in run.markdown([], [mfu], {**meta, "bfloat16_emulated": True})
    assert run.cpu_model().endswith(")")  # the family / model and PyTorch's vector level, e.g. "(..., AVX2)"


def _run_module():
    sys.path.insert(0, str(BENCH))
    try:
        import run
    finally:
        sys.path.remove(str(BENCH))
    return run


def test_paired_ratios_divide_each_runs_rates_and_show_their_spread():
    run = _run_module()
    assert run.paired_ratios([30.0, 20.0, 45.0], [20.0, 20.0, 30.0]) == [1.5, 1.0, 1.5]
    with pytest.raises(ValueError, match="one rate per run on each side, got 2 and 1"):
        run.paired_ratios([1.0, 2.0], [1.0])
    meta = {"tether": "x", "trl": "y", "torch": "z", "machine": "Some CPU, 2 cores", "threads": 2,
            "date": "2026-12-07", "runs": 3}
    row = {"precision": "fp32", "workload": "sft", "model": "tiny", "metric": "tokens/s", "tether": 30.0,
           "tether_min": 20.0, "tether_max": 45.0, "trl": 20.0, "trl_min": 20.0, "trl_max": 30.0, "baseline": "trl",
           "ratio": 1.5, "paired_ratios": [1.5, 1.0, 1.5],
           "load_before": 0.0, "load_after": 0.0, "under_load": False}
    assert "| **1.50x** (1.00-1.50) |" in run.markdown([row], [], meta)
    single = {**row, "paired_ratios": [1.5]}
    assert "| **1.50x** |" in run.markdown([single], [], meta)  # one run: no spread to show


def test_the_large_vocabulary_model_has_a_32k_head_and_tokenises_like_the_built_in(tmp_path):
    """``--models small-32k``: the small model with 32,768 output rows; its tokenizer (the character tokenizer
    padded with added tokens) gives every text the built-in ids, so both libraries train on the same tokens."""
    check = f"""
import sys
sys.path.insert(0, {str(BENCH)!r})
from pathlib import Path
from transformers import AutoConfig, AutoTokenizer
from run import SPECS, save_model
from tether.models.tiny import build_tokenizer
path = save_model(Path({str(tmp_path)!r}) / "m", "small-32k")
config, tokenizer = AutoConfig.from_pretrained(path), AutoTokenizer.from_pretrained(path)
assert config.vocab_size == len(tokenizer) == 32768 and config.hidden_size == 512, (config.vocab_size, len(tokenizer))
text = "<|user|>What is 123 * 456?</s><|assistant|><think>1+2</think> 56088</s>"
assert tokenizer(text)["input_ids"] == build_tokenizer()(text)["input_ids"]
assert SPECS["small-32k"] == SPECS["small"]
"""
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def test_a_bad_out_path_is_refused_before_any_work(tmp_path, capsys):
    """``--out`` is checked when the arguments are parsed (a profile or a full run takes 10-16 min, and the
    file is written at the end): a folder or a name without ``.json`` is refused in one line; a missing folder
    is made."""
    import argparse

    run = _run_module()
    for bad in (tmp_path, tmp_path / "results.md"):
        parser = argparse.ArgumentParser()
        parser.add_argument("--out", type=Path)
        with pytest.raises(SystemExit) as exit_info:
            run.parse_selection(parser, ["--out", str(bad)])
        assert exit_info.value.code == 2
        assert "--out names the JSON file to write" in capsys.readouterr().err
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path)
    args = run.parse_selection(parser, ["--out", str(tmp_path / "new" / "rows.json")])
    assert args.out.parent.is_dir() and args.models == ["tiny", "small"]
