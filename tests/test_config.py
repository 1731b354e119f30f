import pytest
from pydantic import ValidationError

from tether.config import ConfigError, DataConfig, LoopConfig, ModelConfig, apply_override, parse_overrides


def test_unknown_key_lists_valid_ones():
    with pytest.raises(ValidationError) as err:
        ModelConfig(name="x")
    message = str(err.value)
    assert "unknown key(s) 'name'" in message
    assert "name_or_path" in message and "dtype" in message


def test_range_checks():
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        LoopConfig(max_steps=0)


def test_data_needs_exactly_one_source():
    with pytest.raises(ValidationError, match="exactly one of 'path' or 'task'"):
        DataConfig()
    with pytest.raises(ValidationError, match="exactly one"):
        DataConfig(path="a.jsonl", task={"name": "arithmetic"})
    assert DataConfig(path="a.jsonl").path == "a.jsonl"


def test_overrides_parse_yaml_values():
    assert parse_overrides(["a.b=3", "c=1e-4", "d=true", "e=[1, 2]", "f=text"]) == [
        ("a.b", 3), ("c", 1e-4), ("d", True), ("e", [1, 2]), ("f", "text")]
    data = {"a": {"b": 1}}
    apply_override(data, "a.c.d", 5)
    assert data == {"a": {"b": 1, "c": {"d": 5}}}
    with pytest.raises(ConfigError, match="must look like"):
        parse_overrides(["novalue"])
    with pytest.raises(ConfigError, match="not a mapping"):
        apply_override({"a": 1}, "a.b", 2)


def test_a_stage_names_its_task_once():
    """The stage's task fills every task source and evaluation block that names none; a block that names
    its own keeps it; task-aware reward functions get it as defaults."""
    from tether.config import GRPOConfig
    from tether.scoring import local_reward_composer

    task = {"name": "arithmetic", "options": {"digits": 3, "operators": "+"}}
    cfg = GRPOConfig(task=task, data={"task": {"n": 40}}, eval={"n": 5})
    assert (cfg.data.task.name, cfg.data.task.options, cfg.data.task.n) == ("arithmetic", task["options"], 40)
    assert (cfg.eval.task, cfg.eval.options) == ("arithmetic", task["options"])
    own = GRPOConfig(task=task, data={"task": {"name": "multiplication"}}, eval={"options": {"digits": 2}})
    assert (own.data.task.name, own.data.task.options) == ("multiplication", {})  # its own task, its own options
    assert (own.eval.task, own.eval.options) == ("arithmetic", {"digits": 2})
    composer = local_reward_composer([*cfg.rewards, {"name": "format"}], defaults=cfg.reward_defaults())
    assert composer.kwargs == [{"task": "arithmetic", "task_options": task["options"]}, {}]
    explicit = local_reward_composer([{"name": "accuracy", "kwargs": {"task": "code"}}], defaults=cfg.reward_defaults())
    assert explicit.kwargs == [{"task": "code"}]  # a reward naming its own task takes none of the stage's
    assert GRPOConfig().reward_defaults() == {} and GRPOConfig().data.task.name == "arithmetic"


def test_temperature_zero_means_greedy_everywhere():
    """One semantics: 0 is greedy wherever sampling is configured; stages that need distinct samples refuse it
    with the reason."""
    from tether.config import (
        AgentEvalConfig,
        AILabelsConfig,
        EvalConfig,
        OnlineDPOConfig,
        RolloutConfig,
        SamplingConfig,
    )
    from tether.config.distill import CorpusSamplingConfig
    from tether.config.preference import SPINRolloutConfig
    from tether.config.rewards import JudgeSamplingConfig

    for cls in (SamplingConfig, CorpusSamplingConfig, JudgeSamplingConfig, SPINRolloutConfig):
        assert cls(temperature=0).params().is_greedy
    assert EvalConfig(temperature=0).temperature == 0 and AgentEvalConfig(temperature=0).temperature == 0
    assert JudgeSamplingConfig().params().is_greedy and not SamplingConfig().params().is_greedy
    with pytest.raises(ValueError, match="log-probs are taken at the sampling temperature"):
        RolloutConfig(temperature=0)
    with pytest.raises(ValueError, match="one response K times"):
        OnlineDPOConfig(rollout={"temperature": 0})
    with pytest.raises(ValueError, match="two greedy responses are the same"):
        AILabelsConfig(sampling={"temperature": 0})


def test_stop_traces_are_for_stepwise_records_only():
    from tether.config.data import PreferenceTaskSource

    assert PreferenceTaskSource(kind="stepwise", errors=["answer", "stop"]).errors == ["answer", "stop"]
    with pytest.raises(ValidationError, match=r"'stop' .* is for stepwise records"):
        PreferenceTaskSource(kind="correctness", errors=["stop"])
