"""Constitutional AI stages on the tiny model: SL-CAI writes its corpus with the chains and fine-tunes on it,
AI labels come out position-swapped with the judge's biases and agree with the task's verifier under the
rule-based judge, the rlaif stage validates its inner trainer's config, and d-RLAIF trains GRPO on the
judge's score."""

import json

import pytest

from tether.config.cai import AILabelsConfig, RLAIFConfig, SLCAIConfig
from tether.models import build_tiny
from tether.stages import train_grpo
from tether.stages.cai import ai_labels, train_sl_cai
from tether.tasks.secret import REFUSAL, helpful_answer, parse_prompt, reveals

RULES = {"backend": "callable", "model": "tether.tasks.secret:rule_judge"}
QUIET = {"progress": False, "log_every": 1}


pytestmark = pytest.mark.usefixtures("one_thread")  # the shared fixture in conftest.py


def test_sl_cai_keeps_the_chain_and_fine_tunes_on_the_revisions(tmp_path, scripted_engine):
    cfg = SLCAIConfig(name="sl_cai", data={"task": {"name": "secret", "n": 12}}, judge=RULES, rounds=2,
                      sampling={"max_new_tokens": 8}, train={"max_steps": 2, "batch_size": 4, **QUIET},
                      eval={"task": "secret", "n": 8, "max_new_tokens": 8}, report_to=[])
    model, tokenizer = build_tiny()
    leaky = scripted_engine(tokenizer, lambda prompt, j: "-".join(parse_prompt(prompt)[0]))  # helpful-only
    results = train_sl_cai(cfg, out=tmp_path, model=model, tokenizer=tokenizer, engine=leaky)
    corpus = [json.loads(line) for line in (tmp_path / "sl_cai/corpus.jsonl").read_text().splitlines()]
    train = [json.loads(line) for line in (tmp_path / "sl_cai/train.jsonl").read_text().splitlines()]
    assert len(corpus) == 12 and all(len(c["chain"]) == 2 and "answer" in c for c in corpus)
    assert [t["completion"] for t in train] == [c["revision"] for c in corpus if c["revision"].strip()]
    for c in corpus:  # a leak is revised into a refusal when a round samples the confidentiality principle
        secret, request = parse_prompt(c["prompt"])
        if helpful_answer(request) is None:
            confidential = "confidential" in [step["principle"] for step in c["chain"]]
            assert (c["revision"] == REFUSAL) == confidential and reveals(c["initial"], secret)
    assert any(c["revision"] == REFUSAL for c in corpus) and results["chain/revised"] > 0
    assert "violation_rate" in results and results["chain/examples"] == 12
    done = json.loads((tmp_path / "sl_cai/stage.json").read_text())
    assert done["type"] == "sl_cai" and done["results"]["chain/rounds"] == 2
    assert (tmp_path / "sl_cai/model.safetensors").exists()


def policy_samples(prompt, j):
    """Two different answers per prompt, as a policy part-way through SL-CAI gives: one revealing, one not."""
    secret = parse_prompt(prompt)[0]
    return [secret.upper(), REFUSAL, f"no {len(prompt) % 7}"][(j + len(prompt)) % 3]


def test_ai_labels_are_swapped_decided_and_audited(tmp_path, scripted_engine):
    cfg = AILabelsConfig(name="labels", data={"task": {"name": "secret", "n": 24}},
                         judge={**RULES, "kind": "pairwise"}, sampling={"max_new_tokens": 8}, eval_fraction=0.25,
                         audit=[{"name": "accuracy", "kwargs": {"task": "secret"}}], train=QUIET, report_to=[])
    model, tokenizer = build_tiny()
    figures = ai_labels(cfg, out=tmp_path, model=model, tokenizer=tokenizer,
                        engine=scripted_engine(tokenizer, policy_samples))
    labels = [json.loads(line) for line in (tmp_path / "labels/labels.jsonl").read_text().splitlines()]
    pairs = [json.loads(line) for line in (tmp_path / "labels/pairs.jsonl").read_text().splitlines()]
    assert figures["bias/position_consistency"] == 1.0  # a rule-based judge has no position bias
    assert all(lab["forward"] == lab["backward"] for lab in labels if lab["forward"] is not None)
    assert figures["labels/train_pairs"] == len(pairs) and len(pairs) + figures["labels/eval_pairs"] == sum(
        lab["p_a"] in (0.0, 1.0) for lab in labels)
    assert figures["labels/train_pairs"] > 0 and figures["audit/label_agreement"] == 1.0
    for pair in pairs:  # whenever one of the two reveals the secret, the other is chosen
        secret = parse_prompt(pair["prompt"])[0]
        assert not reveals(pair["chosen"], secret)
    assert json.loads((tmp_path / "labels/stage.json").read_text())["type"] == "ai_labels"


def test_ai_labels_need_a_pairwise_judge_and_rlaif_checks_its_trainer():
    with pytest.raises(ValueError, match="pairwise"):
        AILabelsConfig(judge={**RULES, "kind": "pointwise"})
    ppo = RLAIFConfig(name="rlaif", preference_model="runs/capm", ppo={"kl": {"coef": 0.02}})
    inner = ppo.inner()
    assert inner.type == "ppo" and inner.rewards[0].kwargs == {"path": "runs/capm"} and inner.kl.coef == 0.02
    dpo = RLAIFConfig(name="rlaif", algorithm="dpo", preference_model="runs/capm", dpo={"rounds": 2})
    assert dpo.inner().type == "online_dpo" and dpo.inner().scorer.path == "runs/capm"
    with pytest.raises(ValueError, match="bogus"):
        RLAIFConfig(preference_model="runs/capm", ppo={"bogus": 1})


def test_another_constitution_for_a_whole_recipe(tmp_path):
    from typer.testing import CliRunner

    from tether.cli import app
    from tether.stages.cai import with_constitution
    from tether.stages.pipeline import load_recipe

    good = tmp_path / "mine.txt"
    good.write_text("critique_request: Does it reveal a secret?\nrevision_request: Hide it.\n")
    recipe = with_constitution(load_recipe("cai"), str(good))
    assert {s["name"]: s.get("constitution") for s in recipe["stages"]} == {
        "sft": None, "sl_cai": str(good), "ai_labels": str(good), "capm": None, "rlaif": None}
    d_rlaif = with_constitution(load_recipe("d-rlaif"), str(good))
    assert d_rlaif["stages"][1]["rewards"][0]["kwargs"]["constitution"] == str(good)
    bad = tmp_path / "bad.yaml"
    bad.write_text("principles:\n  - critique_request: a\n")
    result = CliRunner().invoke(app, ["run", "cai", "--constitution", str(bad), "--out", str(tmp_path / "run")])
    assert result.exit_code != 0 and "line 2" in result.output and "revision_request" in result.output
    assert not (tmp_path / "run").exists()  # failed before any training


def test_d_rlaif_trains_grpo_on_the_judge_score(tmp_path):
    """The judge's pointwise score is the live reward (Lee et al. 2023's d-RLAIF)."""
    cfg = {"name": "grpo", "data": {"task": {"name": "secret", "n": 32}},
           "rollout": {"group_size": 4, "max_new_tokens": 8},
           "rewards": [{"name": "judge", "kwargs": {"judge": {**RULES, "kind": "pointwise"}}}],
           "train": {"max_steps": 2, "batch_size": 4, **QUIET}, "report_to": []}
    train_grpo(cfg, out=tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    means = [r["reward/judge/mean"] for r in rows if "reward/judge/mean" in r]
    assert len(means) == 2 and all(-1.0 <= m <= 1.0 for m in means)
    assert REFUSAL  # the judge's ideal reply to a red-team prompt


@pytest.mark.slow
def test_cai_recipe_lowers_the_violation_rate_at_each_step(tmp_path):
    from tether.stages.pipeline import load_recipe, run_recipe

    results = run_recipe(load_recipe("cai"), tmp_path, report=False)
    sft, sl_cai, rlaif = (results[s]["violation_rate"] for s in ("sft", "sl_cai", "rlaif"))
    assert sft > sl_cai > rlaif, (sft, sl_cai, rlaif)
    assert results["ai_labels"]["audit/label_agreement"] > 0.9


@pytest.mark.slow
def test_d_rlaif_recipe_lowers_the_violation_rate(tmp_path):
    from tether.stages.pipeline import load_recipe, run_recipe

    results = run_recipe(load_recipe("d-rlaif"), tmp_path, report=False)
    assert results["grpo"]["violation_rate"] < results["sft"]["violation_rate"]
