"""Smoke test of the training-attention timing script at a trivial size, so the script cannot rot; it
asserts what the script prints, nothing about speed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "training_attention.py"


def test_training_attention_times_every_kernel_in_both_precisions(capsys):
    spec = importlib.util.spec_from_file_location("training_attention", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    threads = torch.get_num_threads()
    try:
        module.main(["--sequences", "3", "--lengths", "4-9", "--row", "16", "--repeats", "1", "--threads", "1"])
    finally:
        torch.set_num_threads(threads)  # the script sets the process's thread count
    lines = capsys.readouterr().out.splitlines()
    expected = [["tiny", precision, passes, kernel] for passes in ("forward+backward", "forward")
                for precision in ("float32", "bf16-autocast") for kernel in ("sdpa", "eager", "tether_matmul")]
    assert [line.split()[:4] for line in lines] == expected
    assert all("median" in line for line in lines)
