"""metrics.jsonl across a resume: the steps a resumed run repeats are logged once, torn lines go, other
loggers writing to the same file keep writing to it, and a rewind killed half-way completes next time."""

import json

from tether.trainers.metrics import MetricsLogger, read_metrics


def steps(run, stage):
    return [r["step"] for r in read_metrics(run, stage)]


def test_rewind_drops_repeated_steps_and_torn_lines_of_its_stage_only(tmp_path):
    outer = MetricsLogger(tmp_path, "outer")  # e.g. a self-distillation stage around its SFT rounds
    outer.log(1, {"accuracy": 0.1})
    inner = MetricsLogger(tmp_path, "inner")
    for step in (1, 2, 3):
        inner.log(step, {"loss": 1.0 / step})
    inner.write_samples(3, [{"completion": "x"}])
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"stage": "inner", "step": 4, "lo')  # a kill in the middle of a line
    inner.rewind(2)  # resumed from the step-2 checkpoint
    inner.log(3, {"loss": 0.3})
    outer.log(2, {"accuracy": 0.2})  # its handle still points at the file
    outer.close()
    inner.close()
    assert steps(tmp_path, "inner") == [1, 2, 3] and steps(tmp_path, "outer") == [1, 2]
    assert (tmp_path / "inner" / "samples.jsonl").read_text() == ""


def test_a_rewind_killed_half_way_is_completed_from_its_backup(tmp_path):
    path = tmp_path / "metrics.jsonl"
    good = [json.dumps({"stage": "s", "step": k, "loss": 1.0}) for k in (1, 2)]
    (tmp_path / "metrics.jsonl.rewind").write_text("\n".join(good) + "\n")  # saved before the in-place copy
    path.write_text(good[0] + "\n" + good[1][:10])  # the copy was cut short
    logger = MetricsLogger(tmp_path, "s")
    logger.rewind(2)
    logger.log(3, {"loss": 0.5})
    logger.close()
    assert steps(tmp_path, "s") == [1, 2, 3] and not (tmp_path / "metrics.jsonl.rewind").exists()


def test_plain_progress_lines_when_output_is_not_a_terminal(capsys):
    from tether.trainers.metrics import PlainProgress

    progress = PlainProgress("sft", total=4, start=0, enabled=True, every=3600)
    for step in range(1, 5):
        progress.step(step, 0.5)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("sft: step 4/4 (100%), loss 0.5000, ")  # only the last
    progress = PlainProgress("sft", total=4, start=2, enabled=True, every=0)
    progress.step(3, None)
    assert capsys.readouterr().out.startswith("sft: step 3/4 (75%), ")
    PlainProgress("sft", total=4, start=0, enabled=False, every=0).step(4, 0.1)
    assert capsys.readouterr().out == ""


def test_rewards_file_keeps_the_first_and_latest_step_and_rewinds_with_the_stage(tmp_path):
    logger = MetricsLogger(tmp_path, "rl")
    path = tmp_path / "rl" / "rewards.json"
    logger.write_rewards(1, [0.0, 1.0])
    assert json.loads(path.read_text()) == {"first": {"step": 1, "rewards": [0.0, 1.0]},
                                            "last": {"step": 1, "rewards": [0.0, 1.0]}}
    for step in (2, 3):
        logger.write_rewards(step, [float(step)] * 3)
    data = json.loads(path.read_text())
    assert (data["first"]["step"], data["last"]) == (1, {"step": 3, "rewards": [3.0, 3.0, 3.0]})
    assert not list((tmp_path / "rl").glob("*.tmp"))  # written whole, under a temporary name first
    logger.rewind(2)  # resumed from the step-2 checkpoint: step 3 is gone until it is trained again
    assert json.loads(path.read_text())["last"]["step"] == 1
    logger.write_rewards(3, [0.5])
    assert json.loads(path.read_text())["first"]["step"] == 1
    logger.rewind(0)  # started over: nothing of the old run is kept
    assert not path.exists()
    logger.close()
