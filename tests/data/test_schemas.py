"""Record formats: detection, normalisation, implicit prompts and error messages."""

from __future__ import annotations

import pytest

from tether.data import DataError, detect_format, format_names, split_implicit_prompt, validate_records
from tether.tasks import get_task, sft_records

USER = {"role": "user", "content": "2+2="}
ASSISTANT = {"role": "assistant", "content": "4"}

ROWS = {
    "text": {"text": "12+3=15"},
    "chat": {"messages": [USER, ASSISTANT]},
    "prompt_completion": {"prompt": "2+2=", "completion": "4"},
    "preference": {"prompt": "2+2=", "chosen": "4", "rejected": "5"},
    "unpaired": {"prompt": "2+2=", "completion": "4", "label": True},
    "prompt_answer": {"prompt": "2+2=", "answer": "4", "difficulty": 1},
    "stepwise": {"prompt": "2+2=", "steps": ["2+2", "=4"], "labels": [1, 1]},
    "ranking": {"prompt": "2+2=", "completions": ["4", "Four.", "5"]},
    "prompt": {"prompt": "2+2=", "source": "gsm"},
    "segments": {"segments": [{"text": "2+2=", "loss": False}, {"text": "4", "loss": True}]},
}


def test_every_format_is_detected_and_listed():
    assert sorted(ROWS) == format_names()
    for name, row in ROWS.items():
        assert detect_format(row) == name
        assert validate_records([row], name, "<list>")[0]["prompt" if "prompt" in row else next(iter(row))]


def test_task_records_detect():
    task = get_task("arithmetic")
    assert detect_format(sft_records(task, 1)[0]) == "prompt_completion"
    assert detect_format(sft_records(task, 1, chat=True)[0]) == "chat"


def test_null_columns_count_as_absent():
    # Arrow fills absent columns with None: a text row from a mixed parquet stays a text row.
    assert detect_format({"text": "abc", "prompt": None, "completion": None}) == "text"
    out = validate_records([{"messages": [{**USER, "tool_calls": None}, ASSISTANT], "tools": None}], "chat", "<list>")
    assert out == [{"messages": [USER, ASSISTANT]}]


def test_normalisation_keeps_extras_and_coerces():
    out = validate_records([{"prompt": "2+2=", "answer": 4, "id": "a"}], None, "<list>")
    assert out == [{"prompt": "2+2=", "answer": "4", "id": "a"}]
    out = validate_records([{"prompt": "p", "completion": "c", "label": 0}], "unpaired", "<list>")
    assert out[0]["label"] is False


def test_ranking_ranks_become_dense_and_chat_completions_are_checked():
    out = validate_records([{"prompt": "p", "completions": ["a", "b", "c"], "ranks": [5, -1, 5], "id": 1}],
                           "ranking", "<list>")
    assert out == [{"prompt": "p", "completions": ["a", "b", "c"], "ranks": [1, 0, 1], "id": 1}]
    chat = {"prompt": [USER], "completions": [[ASSISTANT], [{"role": "assistant", "content": "5"}]]}
    assert validate_records([chat], None, "<list>")[0]["completions"][1][0]["content"] == "5"
    with pytest.raises(DataError, match=r"completions\[1\]\[0\]\.role.*assistant"):
        validate_records([{**chat, "completions": [[ASSISTANT], [USER]]}], "ranking", "<list>")


def test_mixed_formats_are_rejected_when_detecting():
    with pytest.raises(DataError, match=r"<list>, row 2: .*'prompt_completion'.*row 1 is 'text'"):
        validate_records([ROWS["text"], ROWS["prompt_completion"]], None, "<list>")


def test_unknown_format_lists_valid_names():
    with pytest.raises(DataError, match="valid names: chat, preference"):
        validate_records([ROWS["text"]], "sft", "<list>")


def test_undetectable_row():
    with pytest.raises(DataError, match=r"<list>, row 1: cannot detect the format.*\['question'\]"):
        validate_records([{"question": "x"}], None, "<list>")


@pytest.mark.parametrize(
    ("fmt", "row", "field", "problem"),
    [
        ("prompt_completion", {"prompt": "p"}, "completion", "missing field"),
        ("prompt_completion", {"prompt": 3, "completion": "c"}, "prompt", "expected a string, got int"),
        ("text", {"text": "  "}, "text", "empty text"),
        ("chat", {"messages": [USER, {"role": "bot", "content": "x"}]}, "messages[1].role", "bad role 'bot'"),
        ("chat", {"messages": [USER, {"role": "assistant"}]}, "messages[1].content", "missing field"),
        ("chat", {"messages": "hi"}, "messages", "expected a list of messages"),
        ("stepwise", {"prompt": "p", "steps": ["a", "b"], "labels": [1]}, "labels", "does not match"),
        ("stepwise", {"prompt": "p", "steps": ["a"], "labels": [0.5]}, "labels[0]", "expected a bool or int"),
        ("unpaired", {"prompt": "p", "completion": "c", "label": "yes"}, "label", "expected a bool"),
        ("ranking", {"prompt": "p", "completions": ["a"]}, "completions", "at least 2 completions (best first), got a list of 1"),
        ("ranking", {"prompt": "p", "completions": "a"}, "completions", "at least 2 completions (best first), got str"),
        ("ranking", {"prompt": "p", "completions": ["a", 3]}, "completions[1]", "expected a string, got int"),
        ("ranking", {"prompt": "p", "completions": ["a", [ASSISTANT]]}, "completions[1]", "a string like the prompt"),
        ("ranking", {"prompt": "p", "completions": ["a", "b", "a"]}, "completions[2]", "duplicates completions[0]"),
        ("ranking", {"prompt": "p", "completions": ["a", " "]}, "completions[1]", "empty text"),
        ("ranking", {"prompt": "p", "completions": ["a", "b"], "ranks": [1]}, "ranks", "list of 2 ints"),
        ("ranking", {"prompt": "p", "completions": ["a", "b"], "ranks": [1, 1.5]}, "ranks[1]", "int rank"),
        ("ranking", {"prompt": "p", "completions": ["a", "b"], "ranks": [2, 2]}, "ranks", "same rank"),
        ("prompt_completion", {"prompt": [USER], "completion": "4"}, "completion", "mixes raw strings"),
        ("prompt_completion", {"prompt": [USER], "completion": [USER]}, "completion[0].role", "assistant"),
    ],
)
def test_errors_name_source_row_and_field(fmt, row, field, problem):
    rows = [ROWS[fmt], row]
    with pytest.raises(DataError) as info:
        validate_records(rows, fmt, "data.jsonl")
    message = str(info.value)
    assert message.startswith(f"data.jsonl, row 2, field '{field}'"), message
    assert problem in message
    assert (info.value.source, info.value.row, info.value.field) == ("data.jsonl", 2, field)


def test_line_numbers_replace_row_numbers():
    with pytest.raises(DataError, match=r"f\.jsonl, line 7, field 'text'"):
        validate_records([ROWS["text"], {"text": ""}], "text", "f.jsonl", line_numbers=[3, 7])


# ---------------------------------------------------------------- implicit prompts


@pytest.mark.parametrize(
    ("chosen", "rejected", "expected"),
    [
        ("12+3=15", "12+3=16", ("12+3=", "15", "16")),  # never split inside a number
        ("The answer is four", "The answer is five", ("The answer is", " four", " five")),
        ("Q: hi\nA: yes", "Q: hi\nA: no", ("Q: hi\nA:", " yes", " no")),
    ],
)
def test_implicit_prompt_strings(chosen, rejected, expected):
    assert split_implicit_prompt(chosen, rejected) == expected
    out = validate_records([{"chosen": chosen, "rejected": rejected}], "preference", "<list>")[0]
    assert (out["prompt"], out["chosen"], out["rejected"]) == expected


def test_implicit_prompt_messages_split_at_last_assistant_turn():
    history = [USER, ASSISTANT, {"role": "user", "content": "and 3+3="}]
    chosen = [*history, {"role": "assistant", "content": "6"}]
    rejected = [*history, {"role": "assistant", "content": "7"}]
    out = validate_records([{"chosen": chosen, "rejected": rejected}], None, "<list>")[0]
    assert out["prompt"] == history
    assert out["chosen"] == [{"role": "assistant", "content": "6"}]
    assert out["rejected"] == [{"role": "assistant", "content": "7"}]


@pytest.mark.parametrize(
    ("row", "field", "problem"),
    [
        ({"chosen": "yes", "rejected": "no"}, "prompt", "share no common prefix"),
        ({"chosen": "abc", "rejected": "abc d"}, "rejected", "prefix of the other"),
        ({"chosen": [USER, ASSISTANT], "rejected": [{"role": "user", "content": "other"}, ASSISTANT]},
         "rejected", "does not share the implicit prompt"),
        ({"chosen": [ASSISTANT], "rejected": [ASSISTANT]}, "chosen", "no prompt before"),
    ],
)
def test_implicit_prompt_failures(row, field, problem):
    with pytest.raises(DataError, match=rf"row 1, field '{field}'.*{problem}"):
        validate_records([row], "preference", "<list>")


def test_every_bad_row_is_listed_and_the_rest_counted_by_kind():
    from tether.data.schemas import MAX_LISTED_ROWS

    rows = ([{"prompt": "a", "completion": "b"}] * 3 + [{"prompt": 1, "completion": "x"}]
            + [{"prompt": "q", "completion": None}] * 30 + [5])
    with pytest.raises(DataError) as err:
        validate_records(rows, None, "data.jsonl")
    message = str(err.value)
    assert err.value.row == 4 and err.value.field == "prompt"  # where the first bad row is
    assert message.splitlines()[0] == "data.jsonl, row 4, field 'prompt': expected a string, got int"
    assert "32 of 35 rows are bad:" in message
    listed = [line for line in message.splitlines() if line.startswith("  data.jsonl, row ")]
    assert len(listed) == MAX_LISTED_ROWS
    assert message.splitlines()[-1] == "  and 12 more: 11 x format 'prompt', not 'prompt_completion'; 1 x not an object"
    one = [{"prompt": "a", "completion": "b"}, {"prompt": "a"}, {"prompt": "a", "completion": "b"}]
    with pytest.raises(DataError) as single:
        validate_records(one, "prompt_completion", "d.jsonl")
    assert "\n" not in str(single.value)  # one bad row: one line


def test_segments_need_text_and_a_loss_flag_and_one_trained_piece():
    out = validate_records([ROWS["segments"]], None, "<list>")
    assert out == [{**ROWS["segments"], "eos": True}]
    for bad, field in (({"segments": []}, "segments"), ({"segments": [{"text": "a"}]}, "segments[0]"),
                       ({"segments": [{"text": "a", "loss": False}]}, "segments"),
                       ({"segments": [{"text": "a", "loss": True}], "eos": "no"}, "eos")):
        with pytest.raises(DataError) as error:
            validate_records([bad], "segments", "<list>")
        assert error.value.field == field
