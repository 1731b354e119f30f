"""The r1-full recipe: its four stages are wired as DeepSeek-R1's (fast), and a shrunk run goes end to end (slow)."""

import json

import pytest

from tether import stages  # noqa: F401
from tether.stages.pipeline import load_recipe, run_recipe, validate_recipe


def by_name(recipe):
    return {s["name"]: s for s in recipe["stages"]}


def test_the_recipe_is_wired_as_the_four_r1_stages():
    recipe = load_recipe("r1-full")
    configs = {c.name: c for c in validate_recipe(recipe)}
    assert [c.type for c in configs.values()] == ["pretrain", "sft", "grpo", "generate", "filter", "sft", "eval",
                                                  "grpo", "eval"]
    assert configs["cold_start"].data.task.n <= 300  # a few demonstrations (r1-arithmetic's cold start)
    assert configs["cold_start"].data.task.options.get("letter_digits", 0) == 0  # all in the task's own digits
    assert {r.name for r in configs["reasoning_rl"].rewards} == {"accuracy", "format", "language_consistency"}
    assert configs["reasoning_rl"].task.options["letter_digits"] > 0  # prompts mix the vocabularies
    kept = configs["kept"].filter
    assert kept.format == "r1" and kept.verifier.min_score == 2.0  # correct (1) and wholly consistent (1)
    assert {r.name for r in kept.verifier.rewards} == {"accuracy", "language_consistency"}
    sft = configs["sft_mix"]
    assert sft.model.name_or_path.endswith("pretrain")  # a fresh SFT from the base
    assert [s.label for s in sft.data.mix] == ["reasoning", "general"] and sft.data.mix[1].task.name == "secret"
    rl = configs["rl_all"]
    assert rl.model.name_or_path.endswith("sft_mix")
    kinds = {s.columns["kind"] for s in rl.data.mix}
    assert kinds == set(rl.reward_routes.routes) == {"reasoning", "general"}
    assert rl.reward_routes.routes["general"].answer_only and not rl.reward_routes.routes["reasoning"].answer_only
    for name in ("cold_start", "reasoning_rl", "sft_mix", "rl_all"):
        assert "language_consistency" in configs[name].eval.metrics
        assert configs[name].eval.options["letter_digits"] > 0
    assert configs["sft_mix_general"].eval.task == configs["rl_all_general"].eval.task == "secret"


def shrunk():
    recipe = load_recipe("r1-full")
    stage = by_name(recipe)
    recipe["defaults"]["train"].update(progress=False, log_every=1)
    stage["pretrain"]["data"]["task"]["n"] = 256
    stage["pretrain"]["train"] = {"max_steps": 30, "batch_size": 32}
    for name in ("cold_start", "sft_mix"):
        stage[name]["train"] = {"max_steps": 4, "batch_size": 8}
    for name in ("reasoning_rl", "rl_all"):
        stage[name]["train"] = {"max_steps": 2, "batch_size": 4}
        stage[name]["rollout"].update(group_size=2, max_new_tokens=24)
    stage["reasoning_rl"]["data"]["task"]["n"] = 16
    for source in stage["rl_all"]["data"]["mix"]:
        source["task"]["n"] = 8
    for name in ("cold_start", "reasoning_rl", "sft_mix", "rl_all", "sft_mix_general", "rl_all_general"):
        stage[name]["eval"].update(n=8, max_new_tokens=24)
    stage["traces"]["prompts"]["task"]["n"] = 8
    stage["traces"]["sampling"].update(n=2, max_new_tokens=24)
    # a barely trained model is seldom right: keep every sample so the SFT mix has a reasoning source
    stage["kept"]["filter"] = {"drop_truncated": False}
    stage["sft_mix"]["data"]["mix"][1]["task"]["n"] = 16
    stage["sft_mix"]["data"]["mix_size"] = 32
    return recipe


@pytest.mark.slow
def test_a_shrunk_run_reports_each_stage(tmp_path):
    results = run_recipe(shrunk(), tmp_path, report=False)
    for name in ("cold_start", "reasoning_rl", "sft_mix", "rl_all"):
        assert {"accuracy", "mean_length", "consistency/n"} <= set(results[name]), (name, results[name])
    for name in ("sft_mix_general", "rl_all_general"):
        assert {"helpfulness", "violation_rate"} <= set(results[name]), (name, results[name])
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    routed = [r for r in rows if r.get("stage") == "rl_all" and "reward/route/general/samples" in r]
    assert routed and all(r["reward/route/general/samples"] + r.get("reward/route/reasoning/samples", 0) == 8
                          for r in routed)
    # the consistency reward was asked (a barely trained model seldom writes a <think> block it can score)
    assert any("reward/language_consistency/none" in r for r in rows if r.get("stage") == "reasoning_rl")
    assert any("reward/reasoning/language_consistency/none" in r for r in routed)
