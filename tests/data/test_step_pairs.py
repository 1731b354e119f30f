"""Step-DPO's pair builder: a trace pair cut to the first wrong step, by divergence or by a step checker."""

import pytest

from tether.data import DataError
from tether.data.pairs import tokenize_pairs
from tether.data.step_pairs import step_pairs, trace_steps
from tether.models import build_tiny
from tether.tasks import get_task
from tether.tasks.preferences import preference_records

PAIR = {"prompt": "Q: 17+25=", "chosen": "<think>7+5=12 c1|1+2+1=4 c0|</think>42",
        "rejected": "<think>7+5=12 c1|1+2=3 c0|</think>32", "kind": "correctness"}


def test_trace_steps_keep_their_separator_and_join_back():
    assert trace_steps("a|b|c", "|") == ["a|", "b|", "c"]
    assert trace_steps("a|b|", "|") == ["a|", "b|"]
    assert "".join(trace_steps(PAIR["chosen"], "|")) == PAIR["chosen"]
    with pytest.raises(ValueError, match="separator"):
        trace_steps("a", "")


def test_the_first_divergent_step_makes_the_pair():
    (pair,), stats = step_pairs([PAIR], separator="|")
    assert pair["prompt"] == "Q: 17+25=<think>7+5=12 c1|"
    assert (pair["chosen"], pair["rejected"]) == ("1+2+1=4 c0|", "1+2=3 c0|")
    assert pair["chosen_partial"] and pair["rejected_partial"] and pair["step"] == 1 and pair["kind"] == "correctness"
    assert stats == {"no_wrong_step": 0, "prefix_differs": 0}
    # an error in the answer alone: the last step, which keeps its eos
    answer_only = {**PAIR, "rejected": "<think>7+5=12 c1|1+2+1=4 c0|</think>43"}
    (last,), _ = step_pairs([answer_only], separator="|")
    assert (last["chosen"], last["rejected"], last["chosen_partial"], last["rejected_partial"]) == \
        ("</think>42", "</think>43", False, False)


def test_a_step_checker_locates_the_error_and_bad_pairs_are_counted():
    # the checker says step 0 is wrong, where both traces agree: no different correct step to prefer
    _, stats = step_pairs([PAIR], separator="|", first_wrong=lambda prompt, steps: 0)
    assert stats["prefix_differs"] == 1
    _, stats = step_pairs([PAIR], separator="|", first_wrong=lambda prompt, steps: None)
    assert stats["no_wrong_step"] == 1
    (pair,), _ = step_pairs([PAIR], separator="|", first_wrong=lambda prompt, steps: 1)
    assert pair["rejected"] == "1+2=3 c0|"
    with pytest.raises(DataError, match="messages"):
        step_pairs([{**PAIR, "prompt": [{"role": "user", "content": "x"}]}], separator="|")


def test_middle_steps_tokenise_without_eos_and_the_last_with_it():
    _, tokenizer = build_tiny()
    (pair,), _ = step_pairs([PAIR], separator="|")
    (example,), _ = tokenize_pairs([pair], tokenizer, max_length=256)
    assert example.chosen.input_ids[-1] != tokenizer.eos_token_id
    assert tokenizer.decode(example.chosen.input_ids[-example.chosen.num_loss_tokens:]) == "1+2+1=4 c0|"
    answer_only = {**PAIR, "rejected": "<think>7+5=12 c1|1+2+1=4 c0|</think>43"}
    (last,), _ = tokenize_pairs(step_pairs([answer_only], separator="|")[0], tokenizer, max_length=256)
    assert last.chosen.input_ids[-1] == tokenizer.eos_token_id


def test_every_synthetic_correctness_pair_yields_a_step_pair():
    records = preference_records(get_task("arithmetic", digits=2, operators="+"), 200, kind="correctness")
    pairs, stats = step_pairs(records, separator="|")
    assert len(pairs) == 200 and stats == {"no_wrong_step": 0, "prefix_differs": 0}
    for record, pair in zip(records, pairs, strict=True):
        assert record["chosen"].startswith(pair["prompt"][len(record["prompt"]):] + pair["chosen"])
        assert record["rejected"].startswith(pair["prompt"][len(record["prompt"]):] + pair["rejected"])
