"""`tether serve` driven by the official `openai` Python client: completions and chat, streaming (with usage),
log-probs and top alternatives, the request budget, fair turns between a large and a small request, clear
errors (unknown model, unsupported parameters, invalid text), and the non-loopback refusal."""

import json
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from tether.data import tokenize_prompts
from tether.models import build_tiny
from tether.serve import BackgroundServer, ServeBudget, create_app, serve

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def server():
    model, tokenizer = build_tiny()
    with BackgroundServer(create_app(model, tokenizer, model_name="tiny", max_tokens_default=16)) as running:
        yield running, model, tokenizer


def client(running):
    return openai.OpenAI(base_url=running.base_url, api_key="unused", max_retries=0, timeout=60)


def test_completions_and_chat_through_the_client(server):
    running, _, _ = server
    c = client(running)
    out = c.completions.create(model="tiny", prompt=["1+2=", "3+4="], n=2, max_tokens=8, seed=3)
    assert len(out.choices) == 4 and out.usage.completion_tokens > 0
    again = c.completions.create(model="tiny", prompt=["1+2=", "3+4="], n=2, max_tokens=8, seed=3)
    assert [x.text for x in again.choices] == [x.text for x in out.choices]  # the same seed, the same samples
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6)
    assert chat.choices[0].message.role == "assistant" and chat.object == "chat.completion"
    assert [m.id for m in c.models.list().data] == ["tiny"] and c.models.retrieve("tiny").id == "tiny"


def test_streaming_equals_the_whole_answer_and_reports_usage(server):
    running, _, _ = server
    c = client(running)
    whole = c.completions.create(model="tiny", prompt="12+3=", n=3, max_tokens=10, seed=7)
    texts, usage, finish = {}, None, {}
    for chunk in c.completions.create(model="tiny", prompt="12+3=", n=3, max_tokens=10, seed=7, stream=True,
                                      stream_options={"include_usage": True}):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            finish[choice.index] = choice.finish_reason
        usage = chunk.usage or usage
    assert [texts[i] for i in range(3)] == [x.text for x in whole.choices]
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    chat = "".join(chunk.choices[0].delta.content or "" for chunk in c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "7+8="}], max_tokens=8, seed=1, stream=True)
        if chunk.choices)
    assert chat == c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "7+8="}],
                                             max_tokens=8, seed=1).choices[0].message.content


def test_logprobs_and_top_alternatives_match_a_forward_pass(server):
    running, model, tokenizer = server
    c = client(running)
    out = c.completions.create(model="tiny", prompt="5+5=", max_tokens=6, temperature=0.7, seed=2, logprobs=3)
    block = out.choices[0].logprobs
    assert len(block.tokens) == len(block.token_logprobs) == len(block.top_logprobs) > 0
    prompt = tokenize_prompts(["5+5="], tokenizer)[0]
    completion = [tokenizer.convert_tokens_to_ids(t) for t in block.tokens]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1]
    values, ids = torch.log_softmax(logits / 0.7, -1).topk(3, -1)
    for t, top in enumerate(block.top_logprobs):
        expected = {tokenizer.decode([i]): v for i, v in zip(ids[t].tolist(), values[t].tolist(), strict=True)}
        assert top.keys() == expected.keys()
        assert all(abs(top[k] - expected[k]) < 1e-4 for k in top)
        sampled = torch.log_softmax(logits[t] / 0.7, -1)[completion[t]].item()
        assert abs(block.token_logprobs[t] - sampled) < 1e-4
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                     logprobs=True, top_logprobs=2, seed=4)
    content = chat.choices[0].logprobs.content
    assert content and all(len(item.top_logprobs) == 2 for item in content)


def test_a_request_over_the_budget_is_refused_at_once(server):
    running, _, _ = server
    start = time.perf_counter()
    with pytest.raises(openai.BadRequestError, match="12800 sequences"):
        client(running).completions.create(model="tiny", prompt=["1+1="] * 200, n=64, max_tokens=8)
    assert time.perf_counter() - start < 1.0
    with pytest.raises(openai.BadRequestError, match="max-request-tokens"):
        client(running).completions.create(model="tiny", prompt=["1+1="] * 16, n=8, max_tokens=512)


def test_a_small_request_is_served_between_the_chunks_of_a_large_one():
    model, tokenizer = build_tiny()
    budget = ServeBudget(max_sequences=256, max_request_tokens=1 << 20, chunk_sequences=16)
    with BackgroundServer(create_app(model, tokenizer, model_name="tiny", budget=budget)) as running:
        c = client(running)
        c.completions.create(model="tiny", prompt="1", max_tokens=1)  # warm up
        finished = {}

        def large():
            c.completions.create(model="tiny", prompt=["1+1="] * 256, max_tokens=48, temperature=1.0)
            finished["large"] = time.perf_counter()

        thread = threading.Thread(target=large)
        thread.start()
        time.sleep(0.3)  # the large request is generating its chunks
        c.completions.create(model="tiny", prompt="2+2=", max_tokens=4)
        finished["small"] = time.perf_counter()
        thread.join()
    assert finished["small"] < finished["large"]


def test_clear_errors_for_a_wrong_model_unsupported_parameters_and_invalid_text(server):
    running, _, _ = server
    c = client(running)
    with pytest.raises(openai.NotFoundError) as err:
        c.completions.create(model="gpt-9", prompt="1", max_tokens=2)
    assert err.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-9")
    with pytest.raises(openai.BadRequestError, match="response_format: not supported"):
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                  response_format={"type": "json_object"})
    with pytest.raises(openai.BadRequestError, match="tools: not supported"):
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                  tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    # a lone surrogate cannot leave the client (it encodes UTF-8): sent as the JSON escape, as other clients can
    request = urllib.request.Request(f"{running.base_url}/completions", data=b'{"prompt": "ab\\ud800"}',
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as http_error:
        urllib.request.urlopen(request, timeout=30)
    assert http_error.value.code == 400
    assert "prompt: invalid text" in json.loads(http_error.value.read())["error"]["message"]


def test_a_non_loopback_host_needs_an_api_key():
    with pytest.raises(ValueError, match="--insecure-no-api-key"):
        serve("tether/tiny", host="0.0.0.0", port=0)
