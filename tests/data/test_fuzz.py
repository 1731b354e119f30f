"""Bad input, generated: any record, any bytes in a data file, any chat template ends in a DataError that says
where (or in clean training examples), never in an exception from deep inside json, pyarrow or tokenizers.

Example counts are bounded for CI (``TETHER_FUZZ_EXAMPLES`` raises them) and derandomised, so a run is
reproducible; a failure prints the smallest example hypothesis found.
"""

import contextlib
import copy
import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tether.data import DataError, load_records, tokenize_dataset, tokenize_prompts
from tether.data.pairs import tokenize_rankings
from tether.data.schemas import ROLES, detect_format, format_names
from tether.models import build_tokenizer

EXAMPLES = int(os.environ.get("TETHER_FUZZ_EXAMPLES", "60"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))
TOKENIZER = build_tokenizer()
FIELDS = ["text", "messages", "prompt", "completion", "chosen", "rejected", "label", "answer", "steps",
          "labels", "tools", "completions", "ranks"]

texts = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["", " ", "\n\t", "\x00", "a\ud800b", "\udfff", "😀日本", "<|assistant|>", "{{ x }}"]),
    st.builds(lambda ch, n: ch * n, st.characters(), st.integers(500, 5000)),  # huge strings
)
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(), texts)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)
messages = st.lists(st.one_of(
    st.fixed_dictionaries({}, optional={"role": st.one_of(st.sampled_from([*ROLES, "bot", ""]), json_values),
                                        "content": st.one_of(texts, json_values),
                                        "tool_calls": json_values, "name": json_values}),
    json_values), max_size=4)
field_values = st.one_of(texts, json_values, messages, st.lists(texts, max_size=3))
records = st.dictionaries(st.one_of(st.sampled_from(FIELDS), st.text(max_size=6)), field_values, max_size=5)


def tokenize_all(rows, fmt):
    """Everything a trainer does with validated rows before the first step (a DataError naming the
    record is an acceptable end: e.g. a conversation that opens with the assistant)."""
    fmt = fmt or (detect_format(rows[0]) if rows else None)
    kind = {"prompt_completion": "sft", "chat": "sft", "unpaired": "sft", "text": "text"}.get(fmt)
    if kind is not None:
        with contextlib.suppress(DataError):
            tokenize_dataset(rows, TOKENIZER, kind=kind, max_length=64)
    if fmt == "ranking":
        tokenize_rankings(rows, TOKENIZER, max_length=64)
    if fmt in ("prompt", "prompt_answer", "prompt_completion", "unpaired", "stepwise", "ranking"):  # a validated prompt
        tokenize_prompts([r["prompt"] for r in rows], TOKENIZER, chat=True)


@FUZZ
@given(rows=st.lists(records, min_size=0, max_size=4), fmt=st.one_of(st.none(), st.sampled_from(format_names())))
def test_any_records_validate_or_fail_with_a_data_error(rows, fmt):
    original = copy.deepcopy(rows)
    try:
        validated = load_records(rows, fmt)
    except DataError as err:
        message = str(err)
        assert message.startswith("<list>") and ("row" in message or "no records" in message), message
        return
    assert rows == original  # validation never mutates the caller's rows
    tokenize_all(validated, fmt)


@FUZZ
@given(lines=st.lists(st.one_of(st.binary(max_size=60), st.builds(lambda r: json.dumps(r).encode(), records)),
                      min_size=1, max_size=5),
       suffix=st.sampled_from([".jsonl", ".json", ".parquet"]))
def test_any_bytes_in_a_data_file_fail_with_the_file_and_line(tmp_path_factory, lines, suffix):
    path = tmp_path_factory.mktemp("data") / f"train{suffix}"
    path.write_bytes(b"\n".join(lines))
    try:
        rows = load_records(path)
    except DataError as err:
        assert str(path) in str(err), err
        return
    tokenize_all(rows, None)


TEMPLATE_PIECES = [
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}",
    "{% for m in messages|reverse %}{{ m['content'] }}{% endfor %}",  # not prefix-stable
    "{{ raise_exception('this template takes no system messages') }}",
    "{{ messages[0]['missing']['deeper'] }}",
    "{% for m in messages %}{{ m.content | upper }}{% endfor %}",
    "{% if add_generation_prompt %}<|assistant|>{% endif %}",
    "{{ undefined_variable.attribute }}",
    "{% for m in messages %",  # a syntax error
    "{{ eos_token }}",
    "",
]


@FUZZ
@given(pieces=st.lists(st.sampled_from(TEMPLATE_PIECES), min_size=0, max_size=3), rows=st.lists(
    st.fixed_dictionaries({"messages": st.lists(st.fixed_dictionaries({
        "role": st.sampled_from(["system", "user", "assistant"]), "content": st.text(min_size=1, max_size=12)}),
        min_size=1, max_size=4)}), min_size=1, max_size=3))
def test_a_chat_template_that_does_not_fit_fails_with_the_record(pieces, rows):
    tokenizer = copy.copy(TOKENIZER)
    tokenizer.chat_template = "".join(pieces) or None
    try:
        validated = load_records(rows, "chat")
    except DataError:
        return  # e.g. whitespace-only content
    try:
        examples, _ = tokenize_dataset(validated, tokenizer, kind="sft", max_length=64)
    except DataError as err:
        assert str(err).startswith("record "), err
        return
    assert all(len(e.input_ids) == len(e.labels) <= 64 for e in examples)


# ---- what the fuzzing found, pinned ----------------------------------------------------------------
def test_a_lone_surrogate_is_a_data_error_not_a_tokenizer_type_error():
    """A JSON escape like "\\ud800" decodes to a lone surrogate, which the Rust tokenizer rejects with a
    TypeError about its input types."""
    rows = [{"prompt": "1+1=", "completion": "2"}, {"prompt": "a\ud800", "completion": "b"}]
    with pytest.raises(DataError, match=r"row 2, field 'prompt': not valid Unicode text \(surrogates not "
                                        r"allowed at character 1\)"):
        load_records(rows)
    chat = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "\udfff"}]}]
    with pytest.raises(DataError, match=r"field 'messages\[1\]\.content': not valid Unicode"):
        load_records(chat)


def test_invalid_utf8_and_damaged_files_name_the_file(tmp_path):
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"train\.jsonl, line 2: not UTF-8 \(byte 0xe9 at column 14\)"):
        load_records(jsonl)
    parquet = tmp_path / "train.parquet"
    parquet.write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match=r"train\.parquet: not a readable parquet file"):
        load_records(parquet)
    deep = tmp_path / "deep.jsonl"
    deep.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(DataError, match=r"deep\.jsonl, line 1"):
        load_records(deep)


def test_a_template_error_names_the_record():
    tokenizer = copy.copy(TOKENIZER)
    tokenizer.chat_template = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system') }}{% endif %}x"
    rows = load_records([{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
                         {"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "b"}]}])
    with pytest.raises(DataError, match=r"record 2: cannot tokenise it \(the tokenizer's chat template cannot render "
                                        r"these messages \(TemplateError: no system\)\)"):
        tokenize_dataset(rows, tokenizer, kind="sft", max_length=64)
