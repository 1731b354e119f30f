"""Loading records from jsonl, json, parquet, datasets and lists; errors name file, line and field."""

from __future__ import annotations

import json

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tether.data import DataError, load_records
from tether.tasks import get_task, sft_records

ROWS = sft_records(get_task("arithmetic"), 4)


def write_jsonl(path, rows, blank_after_first=False):
    lines = [json.dumps(r) for r in rows]
    if blank_after_first:
        lines.insert(1, "")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_every_source_gives_the_same_records(tmp_path):
    jsonl = write_jsonl(tmp_path / "d.jsonl", ROWS)
    (tmp_path / "d.json").write_text(json.dumps(ROWS))
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    dataset = datasets.Dataset.from_list(ROWS)
    datasets.DatasetDict({"train": dataset}).save_to_disk(str(tmp_path / "saved"))
    sources = [jsonl, str(tmp_path / "d.json"), tmp_path / "d.parquet", tmp_path / "saved", dataset,
               datasets.DatasetDict({"train": dataset}), ROWS]
    for source in sources:
        assert load_records(source) == ROWS, source
        assert load_records(source, "prompt_completion") == ROWS


def test_conversational_parquet_roundtrip(tmp_path):
    rows = sft_records(get_task("arithmetic"), 3, chat=True)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "chat.parquet")
    assert load_records(tmp_path / "chat.parquet") == rows


def test_dataset_split(tmp_path):
    data = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS),
                                 "test": datasets.Dataset.from_list(ROWS[:1])})
    assert load_records(data, split="test") == ROWS[:1]
    with pytest.raises(DataError, match="no split 'validation'; available: train, test"):
        load_records(data, split="validation")


def test_invalid_json_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\n{\"prompt\": \n")
    with pytest.raises(DataError, match=r"bad\.jsonl, line 3: invalid JSON"):
        load_records(path)


@pytest.mark.parametrize(
    ("row", "field", "problem"),
    [
        ({"prompt": "1+1="}, "completion", "missing field"),
        ({"prompt": "1+1=", "completion": 2}, "completion", "expected a string, got int"),
        ({"prompt": "1+1=", "completion": ""}, "completion", "empty text"),
    ],
)
def test_bad_rows_in_jsonl_report_the_line(tmp_path, row, field, problem):
    # Line 3: the blank line after row 1 is counted, as an editor would.
    path = write_jsonl(tmp_path / "train.jsonl", [ROWS[0], row], blank_after_first=True)
    with pytest.raises(DataError) as info:
        load_records(path, "prompt_completion")
    assert f"train.jsonl, line 3, field '{field}': {problem}" in str(info.value)


@pytest.mark.parametrize(
    ("row", "field", "problem"),
    [
        ({"messages": [{"role": "user", "content": "x"}, {"role": "robot", "content": "y"}]},
         "messages[1].role", "bad role 'robot'"),
        ({"messages": [{"role": "user", "content": ""}]}, "messages[0].content", "empty text"),
    ],
)
def test_bad_chat_rows_in_jsonl(tmp_path, row, field, problem):
    good = {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}
    path = write_jsonl(tmp_path / "chat.jsonl", [good, good, row])
    with pytest.raises(DataError) as info:
        load_records(path)
    assert f"chat.jsonl, line 3, field '{field}': {problem}" in str(info.value)


def test_bad_rows_in_parquet_report_the_row(tmp_path):
    rows = [{"prompt": "p", "steps": ["a", "b"], "labels": [1, 0]},
            {"prompt": "p", "steps": ["a", "b"], "labels": [1]}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "prm.parquet")
    with pytest.raises(DataError, match=r"prm\.parquet, row 2, field 'labels': length 1 does not match"):
        load_records(tmp_path / "prm.parquet")


def test_json_must_be_a_list(tmp_path):
    (tmp_path / "d.json").write_text(json.dumps({"data": ROWS}))
    with pytest.raises(DataError, match="must hold a list of records"):
        load_records(tmp_path / "d.json")


def test_missing_file_and_unknown_extension(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"data file not found: .*nope\.jsonl"):
        load_records(tmp_path / "nope.jsonl")
    (tmp_path / "d.csv").write_text("prompt,completion\n")
    with pytest.raises(DataError, match=r"unknown file extension '\.csv'"):
        load_records(tmp_path / "d.csv")


def test_empty_file_is_an_error(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="no records"):
        load_records(tmp_path / "empty.jsonl")
