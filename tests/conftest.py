"""Shared test fixtures: a scripted generation engine, a scripted OpenAI-compatible endpoint for
fault-injection tests, and a byte-level BPE tokenizer like the ones real models ship."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from tether.rollout import Rollout, SamplingParams


class ScriptedEngine:
    """A :class:`GenerationEngine` whose sample ``j`` of a prompt is ``script(prompt_text, j)``, ended by
    EOS (``finish_reason`` "stop"). ``calls`` counts ``generate`` calls, ``samples`` the samples made."""

    def __init__(self, tokenizer, script: Callable[[str, int], str]) -> None:
        self.tokenizer, self.script = tokenizer, script
        self.calls = 0
        self.samples = 0

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> Rollout:
        self.calls += 1
        texts = [self.script(self.tokenizer.decode(p, skip_special_tokens=True), j)
                 for p in prompts for j in range(params.n)]
        self.samples += len(texts)
        ids = [[*self.tokenizer(t, add_special_tokens=False)["input_ids"], self.tokenizer.eos_token_id] for t in texts]
        index = [i for i in range(len(prompts)) for _ in range(params.n)]
        return Rollout(prompt_ids=[list(prompts[i]) for i in index], completion_ids=ids,
                       completion_logprobs=[[0.0] * len(c) for c in ids], finish_reasons=["stop"] * len(texts),
                       prompt_index=index, texts=texts)


@pytest.fixture
def scripted_engine():
    """``scripted_engine(tokenizer, script)`` -> a :class:`ScriptedEngine`."""
    return ScriptedEngine


class FakeEndpoint:
    """An OpenAI-style ``/v1/completions`` + ``/v1/chat/completions`` server on a free loopback port
    (the standard library's ``http.server`` in a thread), scripted for fault injection.

    ``reply(body) -> str`` makes each choice's text. ``faults`` is consumed one entry per request:
    ``None`` (answer normally), ``500`` (or any status), ``"garbage"`` (HTTP 200, a body that is not
    JSON) or ``("sleep", seconds)`` (answer late). ``requests`` records every request body received,
    ``max_in_flight`` the most requests handled at once. ``stop()`` closes the port (the server is down).
    """

    def __init__(self, reply: Callable[[dict], str] | None = None, faults: list | None = None) -> None:
        self.reply = reply or (lambda body: "ok")
        self.faults = list(faults or [])
        self.requests: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output quiet
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with endpoint._lock:
                    endpoint.requests.append(body)
                    fault = endpoint.faults.pop(0) if endpoint.faults else None
                    endpoint.in_flight += 1
                    endpoint.max_in_flight = max(endpoint.max_in_flight, endpoint.in_flight)
                endpoint._answer(self, body, fault)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)
        self.thread.start()

    def _answer(self, handler: BaseHTTPRequestHandler, body: dict, fault) -> None:
        if isinstance(fault, tuple) and fault[0] == "sleep":
            time.sleep(fault[1])
            fault = None
        if isinstance(fault, int):
            payload, status = json.dumps({"error": {"message": f"injected {fault}"}}).encode(), fault
        elif fault == "garbage":
            payload, status = b"<html>502 proxy error, this is not JSON", 200
        else:
            n = body.get("n", 1)
            chat = "messages" in body
            singles = [{**body, "prompt": p} for p in body["prompt"]] if isinstance(body.get("prompt"), list) else [body]
            choices = [{"finish_reason": "stop",
                        **({"message": {"role": "assistant", "content": self.reply(one)}} if chat
                           else {"text": self.reply(one)})} for one in singles for _ in range(n)]
            choices = [{"index": i, **c} for i, c in enumerate(choices)]
            payload = json.dumps({"choices": choices, "usage": {"completion_tokens": len(choices)}}).encode()
            status = 200
        with self._lock:  # done before the reply leaves: a client's next request may follow at once
            self.in_flight -= 1
        try:
            handler.send_response(status)
            handler.send_header("Content-Type", "application/json")
            handler.send_header("Content-Length", str(len(payload)))
            handler.end_headers()
            handler.wfile.write(payload)
        except OSError:  # the client gave up (timeout)
            pass

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_endpoint():
    """``fake_endpoint(reply=..., faults=[...])`` starts a :class:`FakeEndpoint`; all are stopped after the test."""
    started: list[FakeEndpoint] = []

    def start(reply: Callable[[dict], str] | None = None, faults: list | None = None) -> FakeEndpoint:
        endpoint = FakeEndpoint(reply, faults)
        started.append(endpoint)
        return endpoint

    yield start
    for endpoint in started:
        with contextlib.suppress(OSError):
            endpoint.stop()


# Qwen2's and Llama 3's pre-tokenisation: letters keep one leading non-letter (" calculator"), punctuation
# keeps the newlines after it (":\n" is one piece, so it can be one token).
PRETOKENIZE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")


@pytest.fixture(scope="session")
def bpe_tokenizer():
    """A byte-level BPE tokenizer (GPT-2's byte alphabet, Qwen2's pre-tokenisation, 358 tokens: pad 0, bos 1,
    eos 2, unk 3 as the tiny models expect) trained here on ReAct episodes and some accented and CJK text, so
    tokens hold several characters (":\n", " calculator", "café") and a character can take several byte tokens.
    Nothing is downloaded; the character tokenizer of the built-in models has one character per token and
    cannot show what a real model's tokenizer does at a stop string or a segment boundary."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [f"Question: {a}*{b}=\nThought: compute it.\nAction: calculator[{a}*{b}]\nObservation:\n {a * b}\n"
              f"Action: finish[{a * b}]\nObservation: done\n" for a in range(10, 99, 7) for b in range(3, 40, 9)]
    corpus += ["café crème, naïve résumé。日本語のテキスト。"] * 20
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(PRETOKENIZE), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module's tests: the tiny model is fastest so, and two OpenMP threads on a
    busy 2-core machine crawl. Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
