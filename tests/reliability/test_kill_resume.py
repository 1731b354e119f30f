"""Crash safety: SFT, DPO and GRPO runs SIGKILLed at random moments (half of them inside a checkpoint
write) and resumed end where an uninterrupted run does, exactly; no checkpoint is ever visible half-written.

The default run kills each family twice; ``-m slow`` runs the full mode (20 kills per family), the same as
``python -m tests.reliability.harness --kills 20``.
"""

import importlib.util
import random
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("tether_kill_harness", Path(__file__).with_name("harness.py"))
harness = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = harness
_spec.loader.exec_module(harness)


@pytest.mark.parametrize("family", list(harness.FAMILIES))
def test_killed_runs_resume_to_the_uninterrupted_weights(tmp_path, family):
    report = harness.kill_and_resume(family, tmp_path, kills=2, rng=random.Random(f"ci:{family}"))
    assert report.exact and report.kills == 2, report.line()


@pytest.mark.slow
@pytest.mark.parametrize("family", list(harness.FAMILIES))
def test_full_mode_twenty_kills(tmp_path, family):
    report = harness.kill_and_resume(family, tmp_path, kills=20, rng=random.Random(f"full:{family}"))
    print(report.line())
    assert report.exact and report.kills == 20 and report.kills_during_write >= 5, report.line()
