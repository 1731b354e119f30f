"""RL prompts from several sources (data.mix on a prompt block): counts by weight, columns per source, errors."""

import json

import pytest
from pydantic import ValidationError

from tether.config.data import PromptDataConfig
from tether.config.rl import GRPOConfig
from tether.data.schemas import DataError
from tether.data.sources import prompt_records


def test_prompt_mix_apportions_by_weight_and_tags_each_source(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n" for i in range(4)))
    data = PromptDataConfig(mix=[
        {"task": {"name": "arithmetic", "n": 30}, "weight": 3, "columns": {"kind": "reasoning"}},
        {"path": str(path), "weight": 1, "columns": {"kind": "general"}, "name": "file"}], mix_size=20)
    records = prompt_records(data)
    # 20 by weights 3:1 -> 15 and 5; the 4-row file goes round once and one row again
    assert [r["kind"] for r in records] == ["reasoning"] * 15 + ["general"] * 5
    assert {r["prompt"] for r in records[15:]} == {"q0", "q1", "q2", "q3"}
    assert len({r["prompt"] for r in records[:15]}) == 15 and all(set(r) == {"prompt", "answer", "kind"}
                                                                  for r in records)
    assert prompt_records(data) == records  # deterministic
    whole = prompt_records(PromptDataConfig(mix=[{"task": {"name": "arithmetic", "n": 6}}, {"path": str(path)}]))
    assert len(whole) == 10  # default size: the sources' total


def test_prompt_mix_sources_inherit_the_stage_task():
    cfg = GRPOConfig(task={"name": "arithmetic", "options": {"digits": 3, "letter_digits": 1.0}},
                     data={"mix": [{"task": {"n": 4}, "weight": 2, "columns": {"kind": "reasoning"}},
                                   {"task": {"name": "secret", "n": 2}, "columns": {"kind": "general"}}]})
    records = prompt_records(cfg.data)
    assert all(r["prompt"][0] in "ABCDEFGHIJ" for r in records[:4])  # the stage's options reached the source
    assert all(r["prompt"].startswith("secret: ") for r in records[4:])


def test_prompt_mix_errors(tmp_path):
    with pytest.raises(ValidationError, match="mix replaces path / task"):
        PromptDataConfig(task={"n": 2}, mix=[{"task": {"n": 2}}])
    with pytest.raises(ValidationError, match="several sources named 'arithmetic'"):
        PromptDataConfig(mix=[{"task": {"n": 2}}, {"task": {"n": 3}}])
    with pytest.raises(ValidationError, match="no format / on_error"):
        PromptDataConfig(mix=[{"task": {"n": 2}, "format": "text"}])
    with pytest.raises(ValidationError, match="mix_size applies to a prompt mix only"):
        PromptDataConfig(task={"n": 2}, mix_size=3)
    with pytest.raises(DataError, match="columns \\['answer'\\] are already fields"):
        prompt_records(PromptDataConfig(mix=[{"task": {"n": 2}, "columns": {"answer": 1}}]))
