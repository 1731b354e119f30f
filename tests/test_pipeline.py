from pathlib import Path

import pytest

from tether import stages  # noqa: F401
from tether.config import ConfigError
from tether.stages.pipeline import (
    apply_recipe_overrides,
    builtin_recipes,
    load_recipe,
    plan_recipe,
    resolve_references,
    validate_recipe,
)


def test_every_builtin_recipe_loads_and_validates():
    names = builtin_recipes()
    assert "sft-arithmetic" in names
    for name in names:
        recipe = load_recipe(name)
        assert recipe.get("description"), f"{name} has no description"
        configs = validate_recipe(recipe)
        assert configs, name


def test_overrides_target_stages():
    recipe = load_recipe("sft-arithmetic")
    out = apply_recipe_overrides(recipe, ["sft.train.max_steps=7", "*.optim.lr=0.5", "defaults.train.threads=1"])
    sft = next(s for s in out["stages"] if s["name"] == "sft")
    assert sft["train"]["max_steps"] == 7
    assert all(s["optim"]["lr"] == 0.5 for s in out["stages"])
    assert out["defaults"]["train"]["threads"] == 1
    assert recipe != out  # the loaded recipe is not mutated
    with pytest.raises(ConfigError, match="neither a stage"):
        apply_recipe_overrides(recipe, ["nosuchstage.train.max_steps=1"])


def test_an_override_of_one_stage_does_not_reach_a_stage_merged_from_it(tmp_path):
    """YAML merge keys (``<<: *opd``) share nested dicts between stages; an override must reach one stage only."""
    path = tmp_path / "shared.yaml"
    path.write_text("stages:\n  - &a {name: a, type: sft, train: {max_steps: 5}}\n  - {<<: *a, name: b}\n")
    out = apply_recipe_overrides(load_recipe(str(path)), ["b.train.max_steps=2"])
    assert [s["train"]["max_steps"] for s in out["stages"]] == [5, 2]
    recipe = load_recipe(str(path))
    recipe["stages"][0]["train"]["max_steps"] = 9
    assert recipe["stages"][1]["train"]["max_steps"] == 5


def test_references_resolve_to_earlier_stages():
    run = Path("/tmp/run")
    data = {"model": {"name_or_path": "@pretrain"}, "data": {"path": "@gen/samples.jsonl"}}
    resolved = resolve_references(data, run, {"pretrain", "gen"})
    assert resolved == {"model": {"name_or_path": "/tmp/run/pretrain"},
                        "data": {"path": "/tmp/run/gen/samples.jsonl"}}
    with pytest.raises(ConfigError, match="does not come earlier"):
        resolve_references(data, run, {"pretrain"})


def test_bad_stage_is_caught_before_running():
    recipe = {"stages": [{"name": "a", "type": "sft", "data": {"task": {"name": "arithmetic"}}},
                         {"name": "b", "type": "sft", "train": {"max_stepz": 1}}]}
    with pytest.raises(ConfigError, match="max_stepz"):
        validate_recipe(recipe)
    with pytest.raises(ConfigError, match="valid names"):
        validate_recipe({"stages": [{"name": "a", "type": "nope"}]})
    with pytest.raises(ConfigError, match="not a file"):
        load_recipe("no-such-recipe")


def test_the_plan_gives_steps_only_to_stages_that_train(tmp_path):
    plan = {row["stage"]: row for row in plan_recipe(load_recipe("oaif-arithmetic"), tmp_path / "run")}
    assert plan["judge"]["steps"] == 3000 and plan["oaif"]["steps"] == 150
    assert plan["judge_data"]["steps"] is None and plan["judge_eval"]["steps"] is None
    assert {row["action"] for row in plan.values()} == {"train"}
    from tether.stages.registry import STAGES

    wrapped = {name for name, t in STAGES.items() if (t.run.__doc__ or "").startswith("The stage of")}
    assert wrapped <= {name for name, t in STAGES.items() if t.trains_model}  # every train_* stage trains
    assert not STAGES["judge_eval"].trains_model and STAGES["self_distill"].trains_model


def test_select_stages_keeps_the_named_stages_and_what_they_use_in_recipe_order():
    from tether.stages.recipes import select_stages

    recipe = load_recipe("dpo-onpolicy-arithmetic")
    orpo = select_stages(recipe, ["orpo"])
    # orpo trains from @sft on @pairs/pairs.jsonl; pairs reads @samples/corpus.jsonl, samples @sft, sft @pretrain
    assert [s["name"] for s in orpo["stages"]] == ["pretrain", "sft", "samples", "pairs", "orpo"]
    assert orpo["name"] == recipe["name"] and len(recipe["stages"]) > 5  # the recipe itself is not changed
    assert [s["name"] for s in select_stages(recipe, ["sft", "pretrain"])["stages"]] == ["pretrain", "sft"]
    both = select_stages(recipe, ["kto", "rpo"])["stages"]
    assert [s["name"] for s in both] == ["pretrain", "sft", "samples", "pairs", "kto", "rpo"]
    with pytest.raises(ConfigError, match=r"no stage 'orpoo' in recipe 'dpo-onpolicy-arithmetic'; its stages: "
                                          r"pretrain, sft, samples"):
        select_stages(recipe, ["orpoo"])
    with pytest.raises(ConfigError, match="names no stage"):
        select_stages(recipe, [])


def test_select_stages_follows_references_made_in_the_recipe_defaults():
    from tether.stages.recipes import select_stages

    recipe = {"name": "r", "defaults": {"model": {"name_or_path": "@base"}},
              "stages": [{"name": "base", "type": "sft", "model": {"name_or_path": "tether/tiny"}},
                         {"name": "other", "type": "sft"}, {"name": "a", "type": "sft"}]}
    assert [s["name"] for s in select_stages(recipe, ["a"])["stages"]] == ["base", "a"]
