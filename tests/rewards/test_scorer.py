"""RewardModelScorer: the same numbers as the model read by hand, batched, usable as a reward function."""

import pytest
import torch

from tether.core.reward import STEP_AGGREGATIONS
from tether.data import tokenize_sft
from tether.data.tokenize import step_sequence
from tether.models.reward_model import build_tiny_reward_model, set_reward_info
from tether.rewards import RewardComposer
from tether.rewards.scorer import RewardModelScorer, reward_model

torch.set_num_threads(1)
PROMPTS = ["12+5=", "3+4=", "40+41=", "9+9="]
COMPLETIONS = ["<think>2+5=7 c0|1+0=1 c0|</think>17", "<think>3+4=7 c0|</think>7", "81", "<think>9+9=18 c1|</think>18"]


@pytest.fixture(scope="module")
def rm():
    model, tok = build_tiny_reward_model(seed=0)
    model.config.pad_token_id = tok.pad_token_id
    return model.eval(), tok


def last_token_score(model, ids):
    with torch.no_grad():
        return float(model(input_ids=torch.tensor([ids])).logits[0, 0])


def test_outcome_scores_are_the_head_at_the_last_token(rm):
    model, tok = rm
    scorer = RewardModelScorer(model, tok, batch_size=3)
    scores = scorer.score(PROMPTS, COMPLETIONS)
    expected = [last_token_score(model, tokenize_sft({"prompt": p, "completion": c}, tok, max_length=512).input_ids)
                for p, c in zip(PROMPTS, COMPLETIONS, strict=True)]
    assert scores == pytest.approx(expected, abs=1e-5)
    assert scorer(PROMPTS, COMPLETIONS, answer=["17", "7", "81", "18"]) == pytest.approx(scores, abs=1e-6)
    assert RewardModelScorer(model, tok, batch_size=1).score(PROMPTS, COMPLETIONS) == pytest.approx(scores, abs=1e-5)


def test_process_scores_aggregate_step_scores(rm):
    model, tok = rm
    scorer = RewardModelScorer(model, tok, process=True, step_separator="|", aggregation="min")
    got = scorer.score(PROMPTS, COMPLETIONS)
    for prompt, completion, score in zip(PROMPTS, COMPLETIONS, got, strict=True):
        steps = [s for s in completion.split("|") if s]
        ids, positions = step_sequence(prompt, steps, tok, "|")
        step_scores = [torch.sigmoid(torch.tensor(last_token_score(model, ids[: p + 1]))) for p in positions]
        assert score == pytest.approx(float(min(step_scores)), abs=1e-5)
    product = RewardModelScorer(model, tok, process=True, step_separator="|", aggregation="product")
    assert all(p <= m + 1e-6 for p, m in zip(product.score(PROMPTS, COMPLETIONS), got, strict=True))
    assert scorer.score(["1+1="], ["  "]) == [0.0]  # no step: the aggregations' empty-row value


def test_step_scores_read_a_finished_trace_s_last_step_at_eos_and_an_open_one_s_at_the_separator(rm):
    model, tok = rm
    scorer = RewardModelScorer(model, tok, process=True, step_separator="|", batch_size=2)
    prompts, completions = PROMPTS[:2] * 2, COMPLETIONS[:2] * 2
    got = scorer.step_scores(prompts, completions, finished=[True, True, False, False])
    assert got[:2] == scorer.step_scores(prompts[:2], completions[:2])  # finished by default
    for prompt, completion, scores, finished in zip(prompts, completions, got, [True, True, False, False],
                                                    strict=True):
        steps = [s for s in completion.split("|") if s]
        ids, positions = step_sequence(prompt, steps, tok, "|", finished=finished)
        assert tok.decode([ids[positions[-1]]]) == ("</s>" if finished else "|")
        expected = [float(torch.sigmoid(torch.tensor(last_token_score(model, ids[: p + 1])))) for p in positions]
        assert scores == pytest.approx(expected, abs=1e-5)
    assert got[0][:-1] == pytest.approx(got[2][:-1], abs=1e-5) and got[0][-1] != pytest.approx(got[2][-1])
    with pytest.raises(ValueError, match="finished flags"):
        scorer.step_scores(prompts, completions, finished=[True])


def test_kind_is_read_from_the_saved_model(rm, tmp_path):
    model, tok = build_tiny_reward_model(seed=2)
    set_reward_info(model, process=True, step_separator="|", aggregation="last")
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    scorer = RewardModelScorer(tmp_path)
    assert scorer.process and scorer.step_separator == "|" and scorer.aggregate is STEP_AGGREGATIONS.get("last")
    assert not RewardModelScorer(tmp_path, process=False).process
    # and as a config reward function through the RL trainers' composer
    composer = RewardComposer([{"name": "tether.rewards.scorer:reward_model", "kwargs": {"path": str(tmp_path)}}])
    result = composer.score(PROMPTS, COMPLETIONS, {"answer": ["17", "7", "81", "18"]})
    assert result.total.tolist() == pytest.approx(scorer.score(PROMPTS, COMPLETIONS), abs=1e-6)
    assert reward_model(PROMPTS[:1], COMPLETIONS[:1], path=str(tmp_path)) == pytest.approx(
        scorer.score(PROMPTS[:1], COMPLETIONS[:1]), abs=1e-6)


def test_chat_prompts_use_the_template(rm):
    model, tok = rm
    scorer = RewardModelScorer(model, tok, chat=True)
    messages = [{"role": "user", "content": PROMPTS[0]}]
    ids = tokenize_sft({"prompt": messages, "completion": [{"role": "assistant", "content": COMPLETIONS[0]}]},
                       tok, max_length=512).input_ids
    assert scorer.score(PROMPTS[:1], COMPLETIONS[:1]) == pytest.approx([last_token_score(model, ids)], abs=1e-5)
    with pytest.raises(ValueError, match="tokenizer"):
        RewardModelScorer(model)


def test_reward_model_is_a_registered_reward_name():
    from tether.rewards import REWARD_FUNCTIONS
    from tether.rewards.scorer import reward_model

    assert REWARD_FUNCTIONS.get("reward_model") is reward_model
