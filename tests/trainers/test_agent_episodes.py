"""The agent_episodes and agent_eval stages: sampled episodes become DMPO pairs; a trained model's episodes."""

import json
import re

import pytest

from tether.config.agent import AgentEpisodesConfig
from tether.data.tokenize import tokenize_sft
from tether.models import build_tiny
from tether.stages.agent_episodes import sample_episodes

TOKENIZER = build_tiny()[1]
ENV = {"task": {"name": "multiplication", "options": {"digits": 3, "tools": ["calculator"]}, "n": 50},
       "tools": ["calculator"], "system_prompt": False}


def solve_or_guess(prompt_text: str, j: int) -> str:
    """Even samples call the calculator and answer with its result; odd ones guess 0 at once."""
    if j % 2:
        return "Action: finish[0]"
    if "Action" not in prompt_text:
        return f"Action: calculator[{prompt_text.split('=')[0]}]"
    return f"Action: finish[{re.findall(r'[0-9]+', prompt_text)[-1]}]"


def config(**episodes):
    return AgentEpisodesConfig(name="episodes", environment=ENV, agent={"max_turns": 3, "max_tokens": 120},
                               episodes={"n": 3, "samples": 4, **episodes}, train={"progress": False})


def test_episodes_are_paired_success_against_failure_per_task(tmp_path, scripted_engine):
    results = sample_episodes(config(), out=tmp_path, tokenizer=TOKENIZER,
                              engine=scripted_engine(TOKENIZER, solve_or_guess))
    episodes = [json.loads(line) for line in (tmp_path / "episodes.jsonl").read_text().splitlines()]
    pairs = [json.loads(line) for line in (tmp_path / "pairs.jsonl").read_text().splitlines()]
    assert [e["outcome"] for e in episodes] == [1.0, 0.0] * 6
    assert results["sampled/success"] == 0.5 and results["sampled/tool_calls"] == 0.5
    assert results["pairs/pairs"] == 6 == len(pairs) and results["pairs/prompts"] == 3
    for pair in pairs:
        assert [m["role"] for m in pair["chosen"]] == ["assistant", "tool", "assistant"]
        assert pair["rejected"] == [{"role": "assistant", "content": "Action: finish[0]"}]
        assert (pair["chosen_outcome"], pair["rejected_outcome"]) == (1.0, 0.0)
        # the pair tokenises as a chat pair a dpo stage reads, the tool message masked
        example = tokenize_sft({"prompt": pair["prompt"], "completion": pair["chosen"]}, TOKENIZER, max_length=512)
        assert 0 < sum(x != -100 for x in example.labels) < len(example.labels)
    assert {p["prompt"][0]["content"] for p in pairs} == {e["prompt"][0]["content"] for e in episodes}


def test_no_pairs_is_a_clear_error(tmp_path, scripted_engine):
    with pytest.raises(ValueError, match="no pairs: of 3 tasks, 3 had no successful episode"):
        sample_episodes(config(), out=tmp_path, tokenizer=TOKENIZER,
                        engine=scripted_engine(TOKENIZER, lambda text, j: "Action: finish[0]"))
    assert not (tmp_path / "pairs.jsonl").exists()


def test_dmpo_agent_recipe_validates_and_chains_the_pairs_into_both_preference_stages():
    from tether.stages.pipeline import validate_recipe
    from tether.stages.recipes import load_recipe

    configs = {c.name: c for c in validate_recipe(load_recipe("dmpo-agent"))}
    assert [c.type for c in configs.values()] == ["agent_sft", "agent_episodes", "dpo", "agent_eval", "dpo",
                                                  "agent_eval"]
    assert configs["dpo"].loss == "sigmoid" and configs["dmpo"].loss == "dmpo"
    assert configs["dpo"].data.path == configs["dmpo"].data.path and configs["dpo"].data.path.endswith(
        "episodes/pairs.jsonl")
    assert configs["episodes"].environment == configs["sft"].environment == configs["dmpo-eval"].environment


@pytest.mark.slow
def test_dmpo_agent_recipe_runs_end_to_end(tmp_path):
    from tether.stages.pipeline import run_recipe
    from tether.stages.recipes import apply_recipe_overrides, load_recipe

    recipe = apply_recipe_overrides(load_recipe("dmpo-agent"), [
        "sft.eval.n=10", "episodes.episodes.n=16", "episodes.episodes.samples=4", "dpo.train.max_steps=2",
        "dmpo.train.max_steps=2", "dpo.train.batch_size=2", "dmpo.train.batch_size=2", "dpo-eval.eval.n=10",
        "dmpo-eval.eval.n=10"])
    results = run_recipe(recipe, tmp_path, report=False)
    assert results["episodes"]["pairs/pairs"] > 0
    assert (tmp_path / "dmpo" / "model.safetensors").exists()
    assert 0.0 <= results["dmpo-eval"]["success"] <= 1.0 and "sampled/success" in results["dpo-eval"]
