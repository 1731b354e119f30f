"""Tokenisation: loss masks cover exactly the completion / assistant tokens and their eos."""

from __future__ import annotations

import logging

import pytest

from tether.data import IGNORE_INDEX, tokenize_dataset, tokenize_prompt, tokenize_sft, tokenize_text
from tether.models.tiny import build_tokenizer
from tether.tasks import get_task, pretrain_records, sft_records

BOS, EOS = 1, 2


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def trained_text(tok, example):
    """Decode the tokens that carry a label, keeping special tokens."""
    ids = [t for t, label in zip(example.input_ids, example.labels, strict=True) if label != IGNORE_INDEX]
    return tok.decode(ids, skip_special_tokens=False)


def contiguous_spans(labels):
    spans, start = [], None
    for i, label in enumerate([*labels, IGNORE_INDEX]):
        if label != IGNORE_INDEX and start is None:
            start = i
        elif label == IGNORE_INDEX and start is not None:
            spans.append((start, i))
            start = None
    return spans


def test_raw_prompt_completion_mask(tok):
    record = sft_records(get_task("arithmetic"), 1)[0]
    example = tokenize_sft(record, tok, max_length=128)
    assert example.input_ids[0] == BOS and example.input_ids[-1] == EOS
    assert tok.decode(example.input_ids, skip_special_tokens=False) == f"<s>{record['prompt']}{record['completion']}</s>"
    assert trained_text(tok, example) == record["completion"] + "</s>"
    n_prompt = 1 + len(record["prompt"])  # character tokenizer: one token a character
    assert example.labels[:n_prompt] == [IGNORE_INDEX] * n_prompt
    assert example.labels[n_prompt:] == example.input_ids[n_prompt:]
    # the prompt tokens are exactly what a generator is fed
    assert example.input_ids[:n_prompt] == tokenize_prompt(record["prompt"], tok)


def test_segments_train_on_their_loss_pieces_each_tokenised_alone(tok):
    record = {"segments": [{"text": "Q: 2+2\n", "loss": False}, {"text": "A: 4", "loss": True},
                           {"text": " ok\n", "loss": False}, {"text": "done", "loss": True}]}
    example = tokenize_sft(record, tok, max_length=128)
    assert tok.decode(example.input_ids, skip_special_tokens=False) == "<s>Q: 2+2\nA: 4 ok\ndone</s>"
    # character tokenizer: one token a character; BOS, prompt and the observation unscored
    expected = [IGNORE_INDEX] * 8 + example.input_ids[8:12] + [IGNORE_INDEX] * 4 + example.input_ids[16:]
    assert example.labels == expected and example.input_ids[-1] == EOS
    without_eos = tokenize_sft({**record, "eos": False}, tok, max_length=128)
    assert without_eos.input_ids == example.input_ids[:-1] and without_eos.labels == example.labels[:-1]


def test_chat_mask_multi_turn(tok):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "1+1="},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "2+2="},
        {"role": "assistant", "content": "<think>2+2</think>4"},
    ]
    example = tokenize_sft({"messages": messages}, tok, max_length=256)
    full = tok.apply_chat_template(messages, tokenize=False)
    assert tok.decode(example.input_ids, skip_special_tokens=False) == full
    spans = contiguous_spans(example.labels)
    assert [tok.decode(example.input_ids[a:b], skip_special_tokens=False) for a, b in spans] == [
        "2</s>", "<think>2+2</think>4</s>"]
    assert example.labels[-1] == EOS
    # the generation prompt for the second turn ends right where its loss starts
    prompt_ids = tokenize_prompt(messages[:4], tok)
    assert spans[1][0] == len(prompt_ids) and example.input_ids[: len(prompt_ids)] == prompt_ids


def test_task_chat_records(tok):
    for record in sft_records(get_task("arithmetic"), 3, chat=True):
        example = tokenize_sft(record, tok, max_length=256)
        assert trained_text(tok, example) == record["messages"][1]["content"] + "</s>"


def test_conversational_prompt_completion_trains_on_completion_only(tok):
    prompt = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"},
              {"role": "user", "content": "2+2="}]
    completion = [{"role": "assistant", "content": "4"}]
    example = tokenize_sft({"prompt": prompt, "completion": completion}, tok, max_length=256)
    assert trained_text(tok, example) == "4</s>"
    assert tokenize_prompt(prompt, tok) == example.input_ids[: example.labels.index(EOS) - 1]


def test_eos_learned_when_pad_equals_eos():
    tok = build_tokenizer()
    tok.pad_token = tok.eos_token
    example = tokenize_sft({"prompt": "a", "completion": "b"}, tok, max_length=16)
    assert example.labels == [IGNORE_INDEX, IGNORE_INDEX, tok.convert_tokens_to_ids("b"), EOS]


def test_template_without_eos_gets_one_appended():
    tok = build_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
    )
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    example = tokenize_sft({"messages": messages}, tok, max_length=64)
    assert trained_text(tok, example) == "a\n</s>"
    assert example.input_ids[-1] == EOS


def test_prefix_unstable_template_fails_loudly():
    tok = build_tokenizer()
    tok.chat_template = (  # writes the number of messages first: no rendering is a prefix of another
        "{{ messages | length }}{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + eos_token }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
    )
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    with pytest.raises(ValueError, match="not prefix-stable at message 1"):
        tokenize_sft({"messages": messages}, tok, max_length=64)


def test_truncate_and_drop(tok):
    record = {"prompt": "12+34=", "completion": "46"}  # 1 + 6 + 2 + 1 = 10 tokens
    assert len(tokenize_sft(record, tok, max_length=10).input_ids) == 10
    cut = tokenize_sft(record, tok, max_length=8)
    assert len(cut.input_ids) == 8 and trained_text(tok, cut) == "4"
    assert tokenize_sft(record, tok, max_length=8, overflow="drop") is None
    assert tokenize_sft(record, tok, max_length=7) is None  # truncated into the prompt: nothing to learn


def test_tokenize_dataset_counts(tok, caplog):
    records = [{"prompt": "1+1=", "completion": "2"},          # 7 tokens
               {"prompt": "12+34=", "completion": "46"},       # 10 tokens
               {"prompt": "123+456789=", "completion": "x"}]  # 14 tokens
    with caplog.at_level(logging.INFO, logger="tether.data.tokenize"):
        examples, stats = tokenize_dataset(records, tok, kind="sft", max_length=9)
    assert stats["truncated"] == 1 and stats["dropped"] == 1 and stats["examples"] == len(examples) == 2
    assert stats["records"] == 3 and stats["loss_tokens"] == 2 + 2  # "2</s>" and "46" (eos cut)
    assert "1 truncated, 1 dropped" in caplog.text
    assert [r.levelname for r in caplog.records if "truncated" in r.message] == ["WARNING"]  # shown without -v
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tether.data.tokenize"):
        tokenize_dataset(records[:1], tok, kind="sft", max_length=9)
    assert [r.levelname for r in caplog.records if "truncated" in r.message] == ["INFO"]  # nothing to report
    _, stats = tokenize_dataset(records, tok, kind="sft", max_length=9, overflow="drop")
    assert stats["truncated"] == 0 and stats["dropped"] == 2


def test_text_chunks_score_every_token_once(tok):
    text = "0123456789abcdefghij"  # bos + 20 + eos = 22 tokens
    whole = tokenize_text({"text": text}, tok, max_length=64)
    assert len(whole) == 1 and whole[0].labels == [IGNORE_INDEX, *whole[0].input_ids[1:]]
    chunks = tokenize_text({"text": text}, tok, max_length=8)
    assert all(len(c) <= 8 for c in chunks)
    assert sum(c.num_loss_tokens for c in chunks) == whole[0].num_loss_tokens == 21
    stitched = chunks[0].input_ids + [t for c in chunks[1:] for t in c.input_ids[1:]]
    assert stitched == whole[0].input_ids
    examples, stats = tokenize_dataset([{"text": text}, *pretrain_records(get_task("arithmetic"), 2)], tok,
                                       kind="text", max_length=8)
    assert stats["split"] == 3 and stats["examples"] == len(examples)


def test_tokenize_prompt(tok):
    assert tokenize_prompt("ab", tok) == [BOS, *tok("ab", add_special_tokens=False)["input_ids"]]
    ids = tokenize_prompt([{"role": "user", "content": "hi"}], tok)
    assert tok.decode(ids, skip_special_tokens=False) == "<s><|user|>hi</s><|assistant|>"


def test_tokenize_prompts_wraps_only_plain_strings_in_chat_mode():
    from tether.data import tokenize_prompt, tokenize_prompts
    from tether.models import build_tokenizer

    tok = build_tokenizer()
    messages = [{"role": "user", "content": "1+1="}]
    assert tokenize_prompts(["1+1="], tok) == [tokenize_prompt("1+1=", tok)]
    assert tokenize_prompts(["1+1=", messages], tok, chat=True) == [tokenize_prompt(messages, tok)] * 2
