"""The OpenAI-compatible client: retries with backoff, timeouts, refusals, the cache, concurrency, and
the GenerationEngine protocol, against a scripted server on a loopback port."""

import json
import math

import pytest

from tether.models.tiny import build_tokenizer
from tether.rollout import EndpointError, GenerationEngine, OpenAIEngine, SamplingParams
from tether.rollout.openai_engine import RequestCache

FAST = {"backoff": 0.001, "max_retries": 3}


def echo(body):
    return f"{body.get('prompt', 'chat')}|{body['temperature']}|{body.get('seed')}"


def test_requests_carry_the_sampling_options_and_n_choices(fake_endpoint):
    server = fake_endpoint(echo)
    engine = OpenAIEngine(server.base_url, "m", **FAST)
    out = engine.complete(["a", "b"], SamplingParams(n=3, temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=9,
                                                     stop=["\n"], seed=4))
    assert out.texts == ["a|0.7|4"] * 3 + ["b|0.7|4"] * 3 and out.prompt_index == [0, 0, 0, 1, 1, 1]
    body = server.requests[0]
    assert body == {"model": "m", "prompt": body["prompt"], "n": 3, "max_tokens": 9, "temperature": 0.7,
                    "top_p": 0.9, "top_k": 5, "stop": ["\n"], "seed": 4}
    assert out.usage == {"completion_tokens": 6}
    greedy = engine.complete(["a"], SamplingParams(greedy=True))
    assert greedy.texts == ["a|0.0|None"]
    chat = OpenAIEngine(server.base_url, "m", chat=True).complete(["hi"], SamplingParams())
    assert chat.texts == ["chat|1.0|None"] and server.requests[-1]["messages"] == [{"role": "user", "content": "hi"}]


def test_5xx_and_timeouts_are_retried_with_backoff(fake_endpoint):
    server = fake_endpoint(echo, faults=[500, 502, ("sleep", 1.0)])
    engine = OpenAIEngine(server.base_url, "m", timeout=0.3, concurrency=1, **FAST)
    assert engine.complete(["x"], SamplingParams(seed=1)).texts == ["x|1.0|1"]
    assert engine.stats == {"requests": 1, "attempts": 4, "retries": 3, "cache_hits": 0, "failed": 0,
                            "bad_responses": 0}


def test_persistent_failure_stops_after_the_retries_with_a_clear_error(fake_endpoint):
    server = fake_endpoint(echo, faults=[503] * 10)
    engine = OpenAIEngine(server.base_url, "m", **FAST)
    with pytest.raises(EndpointError, match=r"1 of 1 requests failed.*failed after 4 attempts.*HTTP 503: injected"):
        engine.complete(["x"], SamplingParams())
    assert len(server.requests) == 4  # 1 + max_retries, then it stops


def test_client_errors_are_not_retried(fake_endpoint):
    server = fake_endpoint(echo, faults=[401])
    engine = OpenAIEngine(server.base_url, "m", **FAST)
    with pytest.raises(EndpointError, match="HTTP 401: injected 401"):
        engine.complete(["x"], SamplingParams())
    assert len(server.requests) == 1


def test_the_api_key_comes_from_the_environment(fake_endpoint, monkeypatch):
    with pytest.raises(EndpointError, match="MY_KEY"):
        OpenAIEngine("http://127.0.0.1:9/v1", "m", api_key_env="MY_KEY")
    monkeypatch.setenv("MY_KEY", "sekrit")
    assert OpenAIEngine("http://127.0.0.1:9/v1", "m", api_key_env="MY_KEY").api_key == "sekrit"


def test_cache_is_keyed_by_the_request_and_written_as_answers_arrive(fake_endpoint, tmp_path):
    server = fake_endpoint(echo)
    engine = OpenAIEngine(server.base_url, "m", cache_dir=tmp_path, **FAST)
    first = engine.complete(["a", "b"], SamplingParams(seed=1))
    assert len(RequestCache(tmp_path)) == 2 and len(server.requests) == 2
    again = engine.complete(["a", "b"], SamplingParams(seed=1))
    assert again.texts == first.texts and len(server.requests) == 2 and engine.stats["cache_hits"] == 2
    engine.complete(["a"], SamplingParams(seed=2))  # another seed is another request
    assert len(server.requests) == 3
    # a damaged entry is asked again rather than trusted
    entry = next(tmp_path.glob("*/*.json"))
    entry.write_text("{not json")
    engine.complete(["a", "b"], SamplingParams(seed=1))
    assert len(server.requests) == 4
    assert not list(tmp_path.glob("*/*.tmp"))  # no temporary files left behind
    assert json.loads(entry.read_text())["choices"]


def test_server_gone_mid_run_keeps_every_answer_received(fake_endpoint, tmp_path):
    server = fake_endpoint(echo)
    engine = OpenAIEngine(server.base_url, "m", cache_dir=tmp_path, concurrency=1, **FAST)
    engine.complete(["p0", "p1", "p2"], SamplingParams())
    server.stop()
    with pytest.raises(EndpointError, match=r"2 of 5 requests failed; the 3 answered are cached"):
        engine.complete([f"p{i}" for i in range(5)], SamplingParams())
    revived = fake_endpoint(echo)
    engine = OpenAIEngine(revived.base_url, "m", cache_dir=tmp_path, **FAST)
    out = engine.complete([f"p{i}" for i in range(5)], SamplingParams())
    assert out.texts == [f"p{i}|1.0|None" for i in range(5)]
    assert sorted(r["prompt"] for r in revived.requests) == ["p3", "p4"]


def test_concurrency_is_limited(fake_endpoint):
    server = fake_endpoint(echo, faults=[("sleep", 0.2)] * 9)
    OpenAIEngine(server.base_url, "m", concurrency=3, **FAST).complete([str(i) for i in range(9)], SamplingParams())
    assert 1 < server.max_in_flight <= 3  # requests overlap, never more than the limit


def test_several_prompts_per_request_come_back_in_order(fake_endpoint, tmp_path):
    server = fake_endpoint(lambda body: body["prompt"].upper())
    engine = OpenAIEngine(server.base_url, "m", prompts_per_request=2, cache_dir=tmp_path, **FAST)
    out = engine.complete(["a", "b", "c"], SamplingParams(n=2))
    assert out.texts == ["A", "A", "B", "B", "C", "C"] and out.prompt_index == [0, 0, 1, 1, 2, 2]
    assert sorted(r["prompt"] for r in server.requests) == [["a", "b"], ["c"]]  # sent concurrently
    with pytest.raises(ValueError, match="chat"):
        OpenAIEngine(server.base_url, "m", chat=True, prompts_per_request=2)


def test_generate_implements_the_engine_protocol(fake_endpoint):
    tokenizer = build_tokenizer()
    server = fake_endpoint(lambda body: body["prompt"][::-1])
    engine = OpenAIEngine(server.base_url, "m", tokenizer=tokenizer, **FAST)
    assert isinstance(engine, GenerationEngine)
    prompt = [tokenizer.bos_token_id, *tokenizer("12+3=", add_special_tokens=False)["input_ids"]]
    rollout = engine.generate([prompt], SamplingParams(n=2))
    assert server.requests[0]["prompt"] == "12+3="  # the BOS is left to the server
    assert rollout.texts == ["=3+21", "=3+21"] and rollout.prompt_ids == [prompt, prompt]
    assert tokenizer.decode(rollout.completion_ids[0]) == "=3+21"
    assert all(math.isnan(x) for x in rollout.completion_logprobs[0])
    with pytest.raises(ValueError, match="tokenizer"):
        OpenAIEngine(server.base_url, "m").generate([prompt], SamplingParams())

