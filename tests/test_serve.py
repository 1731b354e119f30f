"""`tether serve`: the OpenAI-compatible server, in a child process over real HTTP on a loopback port
(and the app under uvicorn in a thread), with its limits, its API key, and a judge that reads it."""

import http.client
import json
import os
import urllib.error
import urllib.parse
import urllib.request

import pytest
import torch

from tether.config.rewards import JudgeSamplingConfig
from tether.data import tokenize_prompts
from tether.models import build_tiny, save_tiny
from tether.rewards.judge import EndpointJudgeBackend, EngineJudgeBackend, PointwiseJudge
from tether.rollout import HFEngine, OpenAIEngine, SamplingParams
from tether.serve import BackgroundServer, ServerProcess, create_app

KEY_ENV = "TETHER_TEST_SERVE_KEY"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`tether serve` of a saved tiny model in a child process, with an API key."""
    path = save_tiny(tmp_path_factory.mktemp("model") / "tiny-judge")
    os.environ[KEY_ENV] = "test-key"
    server = ServerProcess(path, api_key_env=KEY_ENV, extra_args=["--threads", "1"]).start()
    yield server, path
    server.stop()
    os.environ.pop(KEY_ENV, None)


def call(url, body=None, key="test-key", raw=None):
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(url, data=data, headers=headers, method="POST" if data else "GET")
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def declare_oversized_body(url, size, key="test-key"):
    """POST whose headers declare a ``size``-byte body, none of which is sent: the server must answer
    413 from the headers alone. (Sending the body races the server closing the socket: broken pipe.)"""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        conn.putrequest("POST", parts.path)
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Authorization", f"Bearer {key}")
        conn.putheader("Content-Length", str(size))
        conn.endheaders()
        reply = conn.getresponse()
        return reply.status, json.loads(reply.read())
    finally:
        conn.close()


def test_tether_serve_answers_like_the_local_engine(served):
    server, _ = served
    assert server.base_url.startswith("http://127.0.0.1:")
    status, models = call(f"{server.base_url}/models")
    assert status == 200 and models["data"][0]["id"] == "tiny-judge"
    prompts = ["12+34=", "7+8="]
    status, body = call(f"{server.base_url}/completions", {"model": "tiny-judge", "prompt": prompts, "max_tokens": 12,
                                                           "temperature": 0})
    assert status == 200 and [c["index"] for c in body["choices"]] == [0, 1]
    model, tokenizer = build_tiny()
    torch.set_num_threads(1)
    local = HFEngine(model, tokenizer).generate(tokenize_prompts(prompts, tokenizer),
                                                SamplingParams(greedy=True, max_new_tokens=12))
    assert [c["text"] for c in body["choices"]] == local.texts  # the same weights, the same greedy tokens
    assert body["usage"]["completion_tokens"] == sum(len(c) for c in local.completion_ids)
    sampled = {"model": "tiny-judge", "prompt": "1+1=", "n": 3, "max_tokens": 8, "seed": 5, "top_p": 0.9}
    first, second = call(f"{server.base_url}/completions", sampled)[1], call(f"{server.base_url}/completions", sampled)[1]
    assert len(first["choices"]) == 3 and first["choices"] == second["choices"]  # a seed reproduces
    status, chat = call(f"{server.base_url}/chat/completions",
                        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0})
    assert status == 200 and chat["choices"][0]["message"]["role"] == "assistant"


def test_tether_serve_refuses_bad_keys_big_bodies_and_bad_requests(served):
    server, _ = served
    assert call(f"{server.base_url}/models", key=None)[0] == 401
    status, err = call(f"{server.base_url}/completions", {"prompt": "x"}, key="wrong")
    assert status == 401 and "API key" in err["error"]["message"]
    status, err = declare_oversized_body(f"{server.base_url}/completions", 2 << 20)
    assert status == 413 and "over the limit" in err["error"]["message"]
    status, err = call(f"{server.base_url}/completions", {"prompt": "x", "n": 0})
    assert status == 400 and "n" in err["error"]["message"]
    status, err = call(f"{server.base_url}/completions", {"prompt": "x", "max_tokens": 10_000})
    assert status == 400 and "max_tokens" in err["error"]["message"]
    status, err = call(f"{server.base_url}/completions", {"prompt": "x", "max_tokens": 600})
    assert status == 400 and "context length" in err["error"]["message"]
    status, err = call(f"{server.base_url}/completions", {"prompt": "x", "tools": [{"type": "function"}]})
    assert status == 400 and err["error"]["message"] == "tools: not supported by tether serve"


def test_a_judge_over_tether_serve_equals_the_local_judge(served, tmp_path):
    server, _ = served
    prompts = [f"{a}+{b}=" for a, b in [(1, 2), (13, 27), (40, 5), (9, 9)]]
    responses = ["<think>1+2=3 c0|</think>3", "<think>3+7=10 c1|1+2+1=4 c0|</think>40", "45", "hmm"]
    engine = OpenAIEngine(server.base_url, "tiny-judge", api_key_env=KEY_ENV, cache_dir=tmp_path)
    remote = PointwiseJudge(EndpointJudgeBackend(engine, sampling=JudgeSamplingConfig(max_new_tokens=2)), template="compact-pointwise",
                            scale=(0, 9))
    model, tokenizer = build_tiny()
    local = PointwiseJudge(EngineJudgeBackend(HFEngine(model, tokenizer), tokenizer, sampling=JudgeSamplingConfig(max_new_tokens=2)),
                           template="compact-pointwise", scale=(0, 9))
    scores = remote.score(prompts, responses)
    assert scores == local.score(prompts, responses)
    remote_metrics, local_metrics = remote.take_metrics(), local.take_metrics()
    assert remote_metrics == local_metrics and remote_metrics["judge/replies"] == 4
    assert remote_metrics["judge/unparseable"] == sum(s is None for s in scores)
    assert engine.stats["requests"] == 4


class Scripted:
    """An engine for the app: the reply to a prompt is ``script(prompt_text)``; ``n`` copies of it."""

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script = tokenizer, script

    def generate(self, prompts, params):
        from tether.rollout import Rollout

        texts = [self.script(self.tokenizer.decode(p, skip_special_tokens=False)) for p in prompts
                 for _ in range(params.n)]
        ids = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        index = [i for i in range(len(prompts)) for _ in range(params.n)]
        return Rollout([prompts[i] for i in index], ids, [[0.0] * len(c) for c in ids],
                       ["stop"] * len(texts), index, texts)


def test_app_strips_stop_strings_renders_chat_and_caps_n(tmp_path):
    _, tokenizer = build_tiny()
    app = create_app(engine=Scripted(tokenizer, lambda p: f"[{p}] answer\nmore"), tokenizer=tokenizer,
                     model_name="scripted", max_n=4)
    with BackgroundServer(app) as server:
        status, body = call(f"{server.base_url}/completions", {"prompt": "q", "n": 2, "stop": "\n"}, key=None)
        assert status == 200 and [c["text"] for c in body["choices"]] == ["[<s>q] answer"] * 2
        status, body = call(f"{server.base_url}/chat/completions",
                            {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
                             "stop": ["\n"]}, key=None)
        assert body["choices"][0]["message"]["content"] == "[<s><|system|>s</s><|user|>u</s><|assistant|>] answer"
        status, err = call(f"{server.base_url}/completions", {"prompt": "q", "n": 5}, key=None)
        assert status == 400 and "limit of 4" in err["error"]["message"]


def test_body_limit_counts_a_chunked_body_as_it_arrives():
    import asyncio

    from tether.serve import BodyLimit

    async def echo_length(scope, receive, send):
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": str(len(body)).encode()})

    def run(chunks):
        queue = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
        sent = []

        async def receive():
            return queue.pop(0)

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "headers": [(b"transfer-encoding", b"chunked")]}
        asyncio.run(BodyLimit(echo_length, limit=10)(scope, receive, send))
        return sent[0]["status"], sent[1]["body"]

    assert run([b"12345", b"12345"]) == (200, b"10")
    status, body = run([b"123456", b"123456", b"1"])
    assert status == 413 and b"over the limit of 10 bytes" in body


def test_logprobs_are_the_samplers_and_reach_the_openai_engine():
    """``logprobs: 0`` (completions) and ``logprobs: true`` (chat) return each sampled token's log-prob, the
    same as a forward pass of the model; the OpenAI engine with ``logprobs=True`` puts them in its Rollout;
    more than 5 top alternatives are refused in one line."""
    from tether.models.logprobs import completion_logprobs

    model, tokenizer = build_tiny()
    with BackgroundServer(create_app(model, tokenizer, max_tokens_default=12)) as server:
        url = server.base_url
        status, body = call(f"{url}/completions", {"prompt": "12+3=", "logprobs": 0, "seed": 1, "max_tokens": 10},
                            key=None)
        assert status == 200
        block = body["choices"][0]["logprobs"]
        assert len(block["tokens"]) == len(block["token_logprobs"]) > 0 and block["top_logprobs"] is None
        status, chat = call(f"{url}/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                        "logprobs": True, "max_tokens": 6}, key=None)
        assert status == 200 and all("logprob" in t for t in chat["choices"][0]["logprobs"]["content"])
        status, error = call(f"{url}/completions", {"prompt": "1", "logprobs": 6}, key=None)
        assert status == 400 and "logprobs" in error["error"]["message"]
        engine = OpenAIEngine(url, "tether", tokenizer=tokenizer, logprobs=True, max_retries=0)
        prompt = tokenize_prompts(["12+3="], tokenizer)[0]
        rollout = engine.generate([prompt], SamplingParams(n=4, temperature=0.8, max_new_tokens=10, seed=2))
    padded = rollout.to_padded(tokenizer.pad_token_id)
    with torch.no_grad():
        trainer, _ = completion_logprobs(model, rollout.prompt_ids, rollout.completion_ids, temperature=0.8,
                                         row_tokens=128, pad_token_id=tokenizer.pad_token_id)
    aligned = 0
    for i, ids in enumerate(rollout.completion_ids):  # a sample whose text re-tokenises otherwise has none (NaN)
        sent = padded["logprobs"][i, :len(ids)]
        if torch.isnan(sent).all():
            continue
        torch.testing.assert_close(sent, trainer[i, :len(ids)], atol=1e-5, rtol=0)
        aligned += 1
    assert aligned >= 2, rollout.texts


def test_echo_returns_a_token_id_prompt_s_log_probs_and_serves_a_distillation_teacher(tmp_path):
    """``echo: true`` with ``logprobs: 0`` and a token-id prompt returns the prompt's tokens' log-probs under the
    served model (first None) before the sampled ones; an on-policy distillation teacher served this way gives
    the local teacher's log-probs; echo with streaming or top alternatives, and bad ids, are refused."""
    from tether.config.rl import TeacherConfig
    from tether.models.logprobs import completion_logprobs
    from tether.trainers.distillation import LocalTeacher, ServedTeacher

    model, tokenizer = build_tiny(seed=3)
    prompt = tokenize_prompts(["12+3="], tokenizer)[0]
    completion = tokenizer("<think>2+3=5 c0|</think>15", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        expected, _ = completion_logprobs(model, [prompt[:1]], [prompt[1:] + completion], temperature=1.0,
                                          row_tokens=128, pad_token_id=tokenizer.pad_token_id)
    with BackgroundServer(create_app(model, tokenizer, max_tokens_default=4)) as server:
        url = server.base_url
        status, body = call(f"{url}/completions", {"prompt": prompt + completion, "echo": True, "logprobs": 0,
                                                   "max_tokens": 1}, key=None)
        assert status == 200
        choice = body["choices"][0]
        assert choice["text"].startswith("12+3=<think>2+3=5 c0|</think>15")
        values = choice["logprobs"]["token_logprobs"]
        assert values[0] is None and len(values) == len(prompt) + len(completion) + 1
        torch.testing.assert_close(torch.tensor(values[1:-1]), expected[0], atol=1e-5, rtol=0)
        for bad in ({"echo": True, "logprobs": 2}, {"echo": True, "stream": True}):
            status, error = call(f"{url}/completions", {"prompt": prompt, **bad}, key=None)
            assert status == 400 and "echo" in error["error"]["message"]
        status, error = call(f"{url}/completions", {"prompt": [10**6]}, key=None)
        assert status == 400 and "token ids" in error["error"]["message"]
        served = ServedTeacher(TeacherConfig(kind="served", base_url=url, served_model="tether"))
        got = served.token_logprobs([prompt, prompt], [completion, completion[:3]])
    local = LocalTeacher(model, temperature=1.0, row_tokens=128, pad_token_id=tokenizer.pad_token_id, batch_size=8)
    torch.testing.assert_close(got, local.token_logprobs([prompt, prompt], [completion, completion[:3]]),
                               atol=1e-5, rtol=0)
