"""Step labels against a reference trace: hand-labelled traces, the stage writing PRM records from a corpus."""

import json

import pytest

from tether.data.schemas import DataError
from tether.data.step_labels import reference_step_labels, step_label_records
from tether.data.tokenize import split_steps

REFERENCE = "<think>7+5=12 c1|4+8+1=13 c1|</think>132"


@pytest.mark.parametrize(("completion", "labels"), [
    (REFERENCE, [1, 1, 1]),                                        # the reference itself
    ("<think>7+5=12 c1|4+8=12 c1|</think>122", [1, 0, 0]),         # a dropped carry, carried through
    ("<think>7+5=12 c1|4+8+1=13 c1|</think>133", [1, 1, 0]),       # the answer miscopied
    ("<think>7+5=11 c1|4+8+1=13 c1|</think>131", [0, 0, 0]),       # wrong from the first step
    ("<think>7+5=12 c1|4+8+1=13 c1", [1, 0]),                      # stops before the answer
    ("<think>7+5=12 c1", [0]),                                     # stops after one step
    ("<think>7+5=12 c1|4+8+1=13 c1|</think>132|extra", [1, 1, 1, 0]),  # goes on past the answer
])
def test_labels_are_one_until_the_first_step_off_the_reference(completion, labels):
    steps, got = reference_step_labels(completion, REFERENCE, "|")
    assert steps == split_steps(completion, "|") and got == labels


def test_records_count_kinds_drop_duplicates_and_refuse_unknown_prompts():
    corpus = [{"prompt": "57+86=", "completion": c} for c in
              [REFERENCE, REFERENCE, "<think>7+5=12 c1", "<think>7+5=11 c1|</think>11", "  "]]
    records, stats = step_label_records(corpus, {"57+86=": REFERENCE}, separator="|")
    assert stats == {"samples": 5, "records": 3, "correct": 1, "wrong": 1, "stopped": 1, "duplicates": 1, "empty": 1,
                     "cut": 0}
    assert [r["labels"] for r in records] == [[1, 1, 1], [0], [0, 0]]
    kept, _ = step_label_records(corpus[:2], {"57+86=": REFERENCE}, separator="|", dedupe=False)
    assert len(kept) == 2
    with pytest.raises(DataError, match="not one of the reference problems"):
        step_label_records([{"prompt": "1+1=", "completion": "2"}], {"57+86=": REFERENCE}, separator="|")


def test_step_labels_stage_labels_a_corpus_of_task_problems(tmp_path):
    from tether.data.tokenize import split_steps as cut
    from tether.stages.distill import label_steps
    from tether.tasks import get_task
    from tether.tasks.base import draw_problems, format_completion
    from tether.tasks.preferences import stepwise_records

    task = {"name": "arithmetic", "options": {"digits": 3, "operators": "+"}, "n": 20, "seed": 3}
    problems = draw_problems(get_task("arithmetic", digits=3, operators="+"), 20, seed=3, split="train")
    right = [format_completion(p, think=True) for p in problems]
    corpus = [{"prompt": p.prompt, "completion": c} for p, c in zip(problems, right, strict=True)]
    corpus += [{"prompt": p.prompt, "completion": cut(c, "|")[0]} for p, c in zip(problems, right, strict=True)]
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps(r) + "\n" for r in corpus))
    results = label_steps({"name": "labels", "corpus": str(tmp_path / "corpus.jsonl"), "references": task},
                          tmp_path / "labels")
    assert (results["correct"], results["stopped"], results["wrong"]) == (20, 20, 0)
    records = [json.loads(x) for x in (tmp_path / "labels" / "stepwise.jsonl").read_text().splitlines()]
    # the correct traces' records are the synthetic stepwise records' correct ones, token for token
    synthetic = {r["prompt"]: r for r in stepwise_records(get_task("arithmetic", digits=3, operators="+"), 20,
                                                          seed=3, wrong_fraction=0.0)}
    assert all(records[i] == synthetic[records[i]["prompt"]] for i in range(20))
    assert all(r["labels"] == [0] for r in records[20:])


def test_cut_copies_end_before_the_answer_with_the_step_they_end_on_wrong():
    corpus = [{"prompt": f"{a}+{a}=", "completion": REFERENCE} for a in range(400)]
    references = {r["prompt"]: REFERENCE for r in corpus}
    records, stats = step_label_records(corpus, references, separator="|", cut_fraction=0.25, seed=1)
    cut = [r for r in records if len(r["steps"]) < 3]
    assert stats["cut"] == len(cut) == len(records) - 400 and 60 < len(cut) < 140
    assert all(r["labels"] == [1] * (len(r["steps"]) - 1) + [0] for r in cut)
    assert {len(r["steps"]) for r in cut} == {1, 2}
    assert step_label_records(corpus, references, separator="|", cut_fraction=0.25, seed=1)[0] == records
    with pytest.raises(ValueError, match="cut_fraction"):
        step_label_records(corpus, references, separator="|", cut_fraction=2.0)
