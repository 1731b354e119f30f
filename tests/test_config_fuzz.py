"""Bad configs, generated: unknown keys, wrong types, out-of-range values, broken YAML and odd overrides end in
a ConfigError naming the key (or a valid config), never in an exception from pydantic or PyYAML internals."""

import os
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tether import stages  # noqa: F401  (registers every stage type)
from tether.config import ConfigError, load_yaml
from tether.stages.pipeline import apply_recipe_overrides, stage_config, validate_recipe
from tether.stages.registry import STAGE_TYPES

EXAMPLES = int(os.environ.get("TETHER_FUZZ_EXAMPLES", "60"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))

BLOCKS = {
    "model": ["name_or_path", "dtype", "device", "seed", "lora", "trust_remote_code", "config_overrides"],
    "optim": ["lr", "weight_decay", "betas", "eps", "schedule", "warmup_steps", "warmup_ratio", "max_grad_norm"],
    "train": ["max_steps", "batch_size", "grad_accum", "log_every", "save_every", "keep_checkpoints",
              "max_bad_steps", "threads", "seed", "progress"],
    "data": ["path", "task", "format", "max_length", "overflow", "packing", "pack_length"],
    "eval": ["task", "n", "max_new_tokens", "samples", "temperature", "batch_size"],
}
TOP = ["name", "type", "report_to", "loss", "beta", "algorithm", "rewards", "rollout", "kl", "clip", "advantage"]

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12), st.floats(), st.text(max_size=12),
                    st.sampled_from([0, -1, 1e30, "nan", "inf", "1e-4", "", "cosine", "tether/tiny", "@sft"]))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=6)


@st.composite
def stage_dicts(draw):
    raw = {"name": "s", "type": draw(st.sampled_from(STAGE_TYPES.names()))}
    for block, keys in BLOCKS.items():
        if draw(st.booleans()):
            raw[block] = draw(st.one_of(
                st.dictionaries(st.one_of(st.sampled_from(keys), st.text(max_size=8)), values, max_size=4), values))
    for key in draw(st.lists(st.sampled_from(TOP), max_size=3)):
        raw[key] = draw(values)
    return raw


@FUZZ
@given(raw=stage_dicts())
def test_any_stage_config_validates_or_fails_with_a_config_error(raw):
    try:
        stage_config(raw)
    except ConfigError as err:
        message = str(err)
        assert message.startswith(f"stage {raw.get('name')!r}") or "type" in message, message


@FUZZ
@given(overrides=st.lists(st.one_of(
    st.text(max_size=30),
    st.builds(lambda path, value: f"{path}={value}",
              st.sampled_from(["sft.train.max_steps", "*.optim.lr", "defaults.train", "sft", "nostage.x",
                               "sft.train.max_steps.deeper", "*.", "", "sft..x", "defaults.optim.lr"]),
              st.sampled_from(["3", "-1", "abc", "[1, 2", "{a: 1}", "null", "1e-4", ": :", "!!python/object:os.system"]))),
    max_size=4))
def test_any_overrides_apply_or_fail_with_a_config_error(tmp_path_factory, overrides):
    recipe = {"name": "r", "stages": [{"name": "sft", "type": "sft", "train": {"max_steps": 2}}]}
    try:
        validate_recipe(apply_recipe_overrides(recipe, overrides), tmp_path_factory.mktemp("run"))
    except ConfigError as err:
        assert str(err)


@FUZZ
@given(content=st.one_of(st.binary(max_size=200), st.text(max_size=200).map(str.encode),
                         st.sampled_from([b"a: [1, 2", b"- 1\n- 2\n", b"!!python/object/apply:os.system ['x']",
                                          b"a: \xff\xfe", b"[" * 5000, b"", b"a: &x [*x]"])))
def test_any_yaml_file_loads_or_fails_with_a_config_error(tmp_path_factory, content):
    path = tmp_path_factory.mktemp("cfg") / "stage.yaml"
    path.write_bytes(content)
    try:
        data = load_yaml(path)
    except ConfigError as err:
        assert str(path) in str(err)
        return
    assert isinstance(data, dict)


def test_errors_name_the_key_and_the_valid_ones(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key\(s\) 'max_stepz'.*valid keys: .*max_steps"):
        stage_config({"name": "s", "type": "sft", "train": {"max_stepz": 3}})
    with pytest.raises(ConfigError, match=r"train\.max_steps: Input should be greater than or equal to 1 \(got 0\)"):
        stage_config({"name": "s", "type": "sft", "train": {"max_steps": 0}})
    with pytest.raises(ConfigError, match=r"optim\.lr: Input should be a valid number.*\(got .fast.\)"):
        stage_config({"name": "s", "type": "sft", "optim": {"lr": "fast"}})
    path = tmp_path / "bad.yaml"
    path.write_bytes(b"a: \xff")
    with pytest.raises(ConfigError, match=re.escape("not UTF-8 text (byte 0xff at offset 3)")):
        load_yaml(path)


def test_a_stage_name_cannot_leave_the_run_directory(tmp_path):
    for name in ("../escape", "a/b", "..", "", "a\\b"):
        recipe = {"name": "r", "stages": [{"name": name, "type": "sft"}]}
        with pytest.raises(ConfigError, match="must be a plain folder name"):
            validate_recipe(recipe, tmp_path)
    with pytest.raises(ConfigError, match="stage 1 must be a mapping"):
        validate_recipe({"name": "r", "stages": ["sft"]}, tmp_path)
