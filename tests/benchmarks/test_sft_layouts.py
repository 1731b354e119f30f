"""Smoke test of the SFT layout timing script at a trivial size, so the script cannot rot; it checks that the
three layouts score the same loss and that each is timed, nothing about speed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "sft_layouts.py"


def test_the_three_layouts_give_the_same_loss_and_are_each_timed():
    result = subprocess.run([sys.executable, str(SCRIPT), "--steps", "2", "--repeats", "1", "--threads", "1"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    losses = {name: [float(x) for x in values.split(",")]
              for name, values in re.findall(r"^(\w+): rows .*first losses \[([^\]]+)\]$", out, re.M)}
    assert sorted(losses) == ["packed", "padded_causal", "padded_mask"], out
    assert all(len(v) == 2 for v in losses.values()), out
    for name in ("padded_mask", "padded_causal"):
        assert all(abs(a - b) <= 1e-5 for a, b in zip(losses[name], losses["packed"], strict=True)), out
    timed = re.findall(r"^(\w+): median ([\d.]+) s, min ([\d.]+) s$", out, re.M)
    assert [name for name, *_ in timed] == ["packed", "padded_mask", "padded_causal"], out
    assert all(float(median) > 0 for _, median, _ in timed), out
