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
