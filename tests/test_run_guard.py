"""The run directory's guards: one process at a time (a lock naming its holder, a stale one taken over), and a
stage reused only under the configuration it was trained with."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tether.config.base import ConfigError
from tether.config.sft import SFTConfig
from tether.stages.run_guard import (
    RunLock,
    check_stage_settings,
    link_upstream,
    record_stage_settings,
    stage_settings,
)


def test_a_second_run_on_the_directory_is_refused_naming_the_holder(tmp_path):
    with RunLock(tmp_path), pytest.raises(ConfigError, match=rf"in use by process {os.getpid()} .*another --out"):
        RunLock(tmp_path).__enter__()
    assert not (tmp_path / ".lock").exists()
    with RunLock(tmp_path):  # free again
        pass


def test_a_stale_lock_is_taken_over(tmp_path, caplog):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    import socket

    (tmp_path / ".lock").write_text(json.dumps({"pid": int(dead.stdout), "host": socket.gethostname(),
                                                "started": "earlier", "command": "tether run crashed"}))
    with RunLock(tmp_path) as lock:
        assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid() and lock.held
    assert "stale lock" in caplog.text


def test_a_half_done_stage_under_changed_settings_is_refused_with_the_keys(tmp_path):
    cfg = SFTConfig(name="sft", model={"name_or_path": str(tmp_path / "pretrain")}, optim={"lr": 1e-3})
    settings = stage_settings(cfg, tmp_path)
    assert settings["model.name_or_path"] == "@run/pretrain"  # a moved run is the same run
    assert "train.progress" not in settings  # what only changes how a run is watched is left out
    record_stage_settings(tmp_path / "sft", settings)
    check_stage_settings(tmp_path / "sft", settings)  # the same: fine
    other = stage_settings(cfg.model_copy(update={"optim": cfg.optim.model_copy(update={"lr": 2e-3})}), tmp_path)
    with pytest.raises(ConfigError, match=r"optim.lr: 0.001 -> 0.002.*delete .*sft"):
        check_stage_settings(tmp_path / "sft", other)
    moved = stage_settings(cfg.model_copy(update={"model": cfg.model.model_copy(
        update={"name_or_path": str(tmp_path / "x" / "pretrain")})}), tmp_path / "x")
    assert moved == settings


def test_a_field_added_since_the_stage_trained_is_no_change_while_off(tmp_path):
    """A stage recorded before a configuration field existed (``distill``) is reused while that field is off."""
    settings = stage_settings(SFTConfig(name="sft"), tmp_path)
    record_stage_settings(tmp_path / "sft", settings)
    check_stage_settings(tmp_path / "sft", {**settings, "distill": None, "extra.on": False, "extra.list": []})
    with pytest.raises(ConfigError, match=r"distill.coef: '<unset>' -> 2.0"):
        check_stage_settings(tmp_path / "sft", {**settings, "distill.coef": 2.0})
    without_seed = {k: v for k, v in settings.items() if k != "model.seed"}
    with pytest.raises(ConfigError, match=r"model\.seed"):  # a removed key that was not off still counts
        check_stage_settings(tmp_path / "sft", without_seed)


def test_a_field_added_at_its_declared_default_is_no_change(tmp_path):
    """A field added since the stage trained (here judge_data's ``responses`` and ``sft_think``, recorded
    without them) is no change at the default it declares, which keeps what configurations without it did;
    at any other value it is."""
    from tether.config.preference import JudgeDataConfig

    cfg = JudgeDataConfig(name="judge_data", kind="pointwise", template="solve-pointwise")
    settings = stage_settings(cfg, tmp_path)
    assert settings["responses"] == "traces" and settings["sft_think"] is True
    record_stage_settings(tmp_path / "judge_data", {k: v for k, v in settings.items()
                                                    if k not in ("responses", "sft_think", "task.errors")})
    with pytest.raises(ConfigError, match=r"task\.errors"):  # a nested key: its class's default is checked
        check_stage_settings(tmp_path / "judge_data", {**settings, "task.errors": ["slip"]}, JudgeDataConfig)
    check_stage_settings(tmp_path / "judge_data", settings, JudgeDataConfig)
    with pytest.raises(ConfigError, match=r"responses: '<unset>' -> 'answers'"):
        check_stage_settings(tmp_path / "judge_data", {**settings, "responses": "answers"}, JudgeDataConfig)
    with pytest.raises(ConfigError, match="responses"):  # without the class, every new key still counts
        check_stage_settings(tmp_path / "judge_data", settings)


def test_a_finished_stage_without_recorded_settings_is_reused_with_a_warning(tmp_path, caplog):
    """Stages trained before settings were recorded cannot be checked: they are reused, and the log says so
    (a rerun into an old directory once reused such a stage under a changed configuration unseen)."""
    (tmp_path / "sft").mkdir()
    check_stage_settings(tmp_path / "sft", {"optim.lr": 1e-3})  # not started: nothing to say
    assert "predates" not in caplog.text
    (tmp_path / "sft" / "stage.json").write_text("{}")
    check_stage_settings(tmp_path / "sft", {"optim.lr": 1e-3})
    assert "predates recorded configurations" in caplog.text


def test_a_relative_run_directory_only_rewrites_paths_inside_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = SFTConfig(name="sft", model={"name_or_path": "pretrain"}, optim={"lr": 0.002})
    settings = stage_settings(cfg, Path("."))
    assert settings["optim.lr"] == 0.002 and settings["model.name_or_path"] == "pretrain"  # "." is not a prefix
    inside = stage_settings(cfg.model_copy(update={"model": cfg.model.model_copy(
        update={"name_or_path": "runs/a/pretrain"})}), Path("runs/a"))
    assert inside["model.name_or_path"] == "@run/pretrain"


def test_paths_in_lists_of_blocks_are_relative_too(tmp_path):
    from tether.config.rl import GRPOConfig

    cfg = GRPOConfig(name="grpo", rewards=[{"name": "reward_model", "kwargs": {"path": str(tmp_path / "rm")}}])
    assert stage_settings(cfg, tmp_path)["rewards"][0]["kwargs"]["path"] == "@run/rm"


def test_a_stage_whose_input_stage_changed_is_not_reused(tmp_path):
    """A stage reads an earlier one (``@pretrain``); when that one is retrained under other settings (its old
    directory deleted, as the refusal suggests), the stage after it is refused too, also two stages down."""
    def recipe(lr):
        configs = [SFTConfig(name="pretrain", optim={"lr": lr}),
                   SFTConfig(name="sft", model={"name_or_path": str(tmp_path / "pretrain")}),
                   SFTConfig(name="polish", model={"name_or_path": str(tmp_path / "sft" / "checkpoints")}),
                   SFTConfig(name="side", optim={"lr": 1e-4})]  # reads no earlier stage
        settings = {c.name: stage_settings(c, tmp_path) for c in configs}
        link_upstream(settings)
        return settings

    before = recipe(1e-3)
    assert "upstream.pretrain" in before["sft"] and set(before["polish"]) - set(before["sft"]) == {"upstream.sft"}
    assert not any(k.startswith("upstream.") for k in before["side"] | before["pretrain"])
    for name in ("sft", "polish", "side"):
        record_stage_settings(tmp_path / name, before[name])
    after = recipe(2e-3)
    with pytest.raises(ConfigError, match="its input stage 'pretrain' changed"):
        check_stage_settings(tmp_path / "sft", after["sft"])
    with pytest.raises(ConfigError, match="its input stage 'sft' changed"):
        check_stage_settings(tmp_path / "polish", after["polish"])
    check_stage_settings(tmp_path / "side", after["side"])
    check_stage_settings(tmp_path / "sft", recipe(1e-3)["sft"])  # the same recipe again: reused
    # recorded before input digests existed: checked on its own keys only
    record_stage_settings(tmp_path / "sft", {k: v for k, v in before["sft"].items() if not k.startswith("upstream.")})
    check_stage_settings(tmp_path / "sft", after["sft"])


def test_a_field_added_since_an_input_stage_trained_does_not_refuse_the_stages_after_it(tmp_path):
    """A run trained before tether grew a field (here ``optim.fused``, recorded by neither stage) resumes: the
    input stage is accepted (the field is at its declared default), and so is the stage reading it, whose
    recorded input digest is that of the input's record. A real change of the input is still refused."""
    from tether.stages.pipeline import checked_settings

    def configs(lr=1e-3):
        return [SFTConfig(name="sft", optim={"lr": lr}),
                SFTConfig(name="polish", model={"name_or_path": str(tmp_path / "sft")})]

    old = {c.name: {k: v for k, v in stage_settings(c, tmp_path).items() if k != "optim.fused"} for c in configs()}
    link_upstream(old)
    for name, flat in old.items():
        record_stage_settings(tmp_path / name, flat)
    today = {c.name: stage_settings(c, tmp_path) for c in configs()}
    link_upstream(today)
    assert today["polish"]["upstream.sft"] != old["polish"]["upstream.sft"]
    with pytest.raises(ConfigError, match="its input stage 'sft' changed"):  # not knowing sft was accepted
        check_stage_settings(tmp_path / "polish", today["polish"], SFTConfig)
    check_stage_settings(tmp_path / "polish", today["polish"], SFTConfig, accepted_inputs=["sft"])
    checked_settings(configs(), tmp_path)  # the pipeline's check: sft, then polish
    with pytest.raises(ConfigError, match=r"optim\.lr"):
        checked_settings(configs(lr=2e-3), tmp_path)
