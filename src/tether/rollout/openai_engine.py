"""A client for any OpenAI-compatible endpoint (``tether serve``, vLLM, a hosted API) as a generation engine.

``OpenAIEngine`` sends one request per prompt (``/v1/completions``, or ``/v1/chat/completions`` with
``chat=True``), ``concurrency`` at a time from a thread pool, with the Python standard library's
``urllib`` (no extra dependency). What makes it usable for judges and teachers over a flaky network:

- **timeouts**: ``timeout`` seconds bound each socket read and the whole response body;
- **retries with exponential backoff**: connection errors, timeouts, HTTP 408 / 409 / 425 / 429 and
  5xx, and replies that are not the JSON an OpenAI endpoint sends are retried ``max_retries`` times,
  waiting ``backoff * 2**attempt`` seconds (or the server's ``Retry-After``, at most ``max_backoff``);
  other 4xx answers (a bad key, a bad request) fail at once, with the server's message;
- **an on-disk cache** (``cache_dir``): every successful response is written, atomically, as soon as
  it arrives, under the SHA-256 of the request (route + JSON body, which holds the model name and
  every sampling option; the base URL is left out so a server restarted on another port still hits
  it). A rerun, or the rest of a run whose endpoint went down, reuses everything answered so far;
- **a clear error**: when requests still fail after their retries, the other requests of the call
  are finished (and cached) first, then :class:`EndpointError` says how many failed, the last error,
  and where the answered ones are kept.

Two interfaces: :meth:`OpenAIEngine.complete` takes text prompts (or message lists) and returns a
:class:`TextRollout`; :meth:`OpenAIEngine.generate` implements the :class:`GenerationEngine`
protocol (token ids in, a :class:`Rollout` out) when a ``tokenizer`` is given. Departures from a
local engine there: prompt ids are decoded to text (a leading BOS dropped, as the server adds its
own), completion ids are a re-tokenisation of the returned text, and the sampling log-probs are
unknown (NaN) unless ``logprobs=True`` asks the server for them (``/completions``: ``logprobs: 0``; chat:
``logprobs: true``) and its tokens are the re-tokenisation's (see :func:`aligned_logprobs`); a trainer that needs the exact sampled tokens must not use it.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import math
import os
import random
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tether.data.files import write_text_atomic
from tether.rollout.base import Rollout, SamplingParams

RETRY_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})


class EndpointError(RuntimeError):
    """An endpoint kept failing after its retries, or refused a request (4xx)."""


class _Retryable(Exception):
    pass


@dataclass
class TextRollout:
    """Text results of :meth:`OpenAIEngine.complete`: ``len(prompts) * n`` samples, prompt-major."""

    texts: list[str]
    finish_reasons: list[str]
    prompt_index: list[int]
    usage: dict[str, int] = field(default_factory=dict)
    logprobs: list[Any] = field(default_factory=list)  # per sample: (tokens, log-probs) the server sent, or None

    def __len__(self) -> int:
        return len(self.texts)


class RequestCache:
    """Responses on disk keyed by the hash of the request; written to a temporary name, then renamed."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    @staticmethod
    def key(route: str, body: dict) -> str:
        return hashlib.sha256(json.dumps({"route": route, "body": body}, sort_keys=True).encode()).hexdigest()

    def _path(self, key: str) -> Path:
        return self.directory / key[:2] / f"{key}.json"

    def get(self, key: str) -> dict | None:
        path = self._path(key)
        if not path.exists():
            return None
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return None  # a damaged entry is asked again

    def put(self, key: str, response: dict) -> None:
        write_text_atomic(self._path(key), json.dumps(response), concurrent=True)

    def __len__(self) -> int:
        return sum(1 for _ in self.directory.glob("*/*.json"))


class OpenAIEngine:
    """Generation through an OpenAI-compatible HTTP endpoint; see the module docstring.

    Args:
        base_url: e.g. ``http://127.0.0.1:8000/v1``.
        model: the model id sent with every request.
        api_key_env: name of the environment variable holding the key (sent as a Bearer token).
        timeout: seconds per request attempt.
        max_retries: further attempts after the first, for retryable failures.
        concurrency: requests in flight at once.
        cache_dir: on-disk response cache; None disables it.
        backoff, max_backoff: first retry wait and cap, in seconds.
        chat: use ``/chat/completions`` (text prompts become one user message).
        tokenizer: needed only for :meth:`generate` (token-id prompts).
        prompts_per_request: text prompts sent together as one ``/completions`` request (its ``prompt``
            a list, as OpenAI's completions API, vLLM and ``tether serve`` accept), so a server that
            batches a request's prompts serves them in one pass; cached per request.
    """

    def __init__(self, base_url: str, model: str, api_key_env: str | None = None, timeout: float = 60.0,
                 max_retries: int = 4, concurrency: int = 8, cache_dir: str | Path | None = None, *,
                 backoff: float = 0.5, max_backoff: float = 30.0, chat: bool = False, tokenizer: Any = None,
                 prompts_per_request: int = 1, logprobs: bool = False) -> None:
        if max_retries < 0 or concurrency < 1 or timeout <= 0 or prompts_per_request < 1:
            raise ValueError("need max_retries >= 0, concurrency >= 1, timeout > 0 and prompts_per_request >= 1")
        if chat and prompts_per_request > 1:
            raise ValueError("a chat request holds one conversation: prompts_per_request must be 1 with chat=True")
        self.prompts_per_request = prompts_per_request
        self.logprobs = logprobs
        self.base_url, self.model = base_url.rstrip("/"), model
        self.api_key = None
        if api_key_env is not None:
            self.api_key = os.environ.get(api_key_env)
            if not self.api_key:
                raise EndpointError(f"api_key_env={api_key_env!r}: the environment variable is not set or empty")
        self.timeout, self.max_retries, self.concurrency = timeout, max_retries, concurrency
        self.backoff, self.max_backoff, self.chat, self.tokenizer = backoff, max_backoff, chat, tokenizer
        self.cache = RequestCache(cache_dir) if cache_dir is not None else None
        # a loopback server (tether serve) is never reached through an HTTP proxy from the environment
        host = urllib.parse.urlsplit(self.base_url).hostname or ""
        loopback = host in ("localhost", "::1") or host.startswith("127.")
        self._opener = urllib.request.build_opener(*([urllib.request.ProxyHandler({})] if loopback else []))
        self.stats = {"requests": 0, "attempts": 0, "retries": 0, "cache_hits": 0, "failed": 0, "bad_responses": 0}
        self._lock = threading.Lock()

    def _count(self, key: str, amount: int = 1) -> None:
        with self._lock:
            self.stats[key] += amount

    # ---- one request ---------------------------------------------------------------------------------
    def request(self, route: str, body: dict) -> dict:
        """POST ``body`` to ``base_url + route``: from the cache, else with retries; raises EndpointError."""
        key = RequestCache.key(route, body) if self.cache is not None else ""
        if self.cache is not None:
            cached = self.cache.get(key)
            if cached is not None:
                self._count("cache_hits")
                return cached
        self._count("requests")
        last = "no attempt made"
        for attempt in range(self.max_retries + 1):
            if attempt:
                self._count("retries")
            self._count("attempts")
            try:
                response = self._post(route, body)
            except _Retryable as err:
                last, wait = str(err.args[0]), err.args[1]
                if attempt < self.max_retries:
                    time.sleep(self._wait(attempt, wait))
                continue
            if self.cache is not None:
                self.cache.put(key, response)
            return response
        self._count("failed")
        raise EndpointError(f"{self.base_url}{route}: failed after {self.max_retries + 1} attempts; last error: {last}")

    def _wait(self, attempt: int, retry_after: float | None) -> float:
        if retry_after is not None:
            return min(retry_after, self.max_backoff)
        return min(self.backoff * 2**attempt, self.max_backoff) * (1 + 0.1 * random.random())

    def _post(self, route: str, body: dict) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.base_url + route, data=json.dumps(body).encode(), headers=headers,
                                         method="POST")
        deadline = time.monotonic() + self.timeout
        try:
            with self._opener.open(request, timeout=self.timeout) as reply:
                raw = _read_until(reply, deadline, self.timeout)
        except urllib.error.HTTPError as err:
            message = _error_message(err)
            if err.code in RETRY_STATUS or err.code >= 500:
                raise _Retryable(f"HTTP {err.code}: {message}", _retry_after(err)) from None
            raise EndpointError(f"{self.base_url}{route}: HTTP {err.code}: {message}") from None
        except (urllib.error.URLError, OSError) as err:  # refused, reset, timed out, DNS
            raise _Retryable(f"{type(err).__name__}: {getattr(err, 'reason', err)}", None) from None
        except http.client.HTTPException as err:  # a body cut short, a reply that is not HTTP
            raise _Retryable(f"{type(err).__name__}: {err!r}"[:300], None) from None
        try:
            response = json.loads(raw)
            if not isinstance(response, dict) or not isinstance(response.get("choices"), list):
                raise ValueError("no 'choices' list")
            for choice in response["choices"]:
                _choice_text(choice)
        except ValueError as err:
            self._count("bad_responses")
            raise _Retryable(f"not an OpenAI-style JSON response ({err}): {raw[:200]!r}", None) from None
        return response

    def model_ids(self) -> list[str]:
        """The ids ``GET base_url/models`` lists (one attempt): a check that the endpoint is up, and which
        model it serves; raises EndpointError, in one line, when it cannot be reached or answers otherwise."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        request = urllib.request.Request(self.base_url + "/models", headers=headers, method="GET")
        try:
            with self._opener.open(request, timeout=self.timeout) as reply:
                listed = json.loads(_read_until(reply, time.monotonic() + self.timeout, self.timeout))["data"]
            return [str(entry["id"]) for entry in listed]
        except urllib.error.HTTPError as err:
            raise EndpointError(f"{self.base_url}/models: HTTP {err.code}: {_error_message(err)}") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as err:
            raise EndpointError(f"cannot reach {self.base_url} ({getattr(err, 'reason', err)}); is the server "
                                "running (tether serve MODEL) and the URL right (it ends in /v1)?") from None
        except (ValueError, KeyError, TypeError):
            raise EndpointError(f"{self.base_url}/models did not answer with an OpenAI-style model list; "
                                "is this an OpenAI-compatible endpoint (its URL ends in /v1)?") from None

    # ---- batches -------------------------------------------------------------------------------------
    def _body(self, prompt: str | list[dict], params: SamplingParams) -> tuple[str, dict]:
        body: dict[str, Any] = {"model": self.model, "n": params.n, "max_tokens": params.max_new_tokens,
                                "temperature": 0.0 if params.is_greedy else params.temperature, "top_p": params.top_p}
        if params.top_k:
            body["top_k"] = params.top_k
        if params.stop:
            body["stop"] = list(params.stop)
        if params.seed is not None:
            body["seed"] = params.seed
        if self.logprobs:
            body["logprobs"] = True if self.chat or isinstance(prompt, list) else 0
        if self.chat or isinstance(prompt, list):
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            return "/chat/completions", {**body, "messages": messages}
        return "/completions", {**body, "prompt": prompt}

    def complete(self, prompts: Sequence[str | list[dict]], params: SamplingParams) -> TextRollout:
        """``params.n`` completions per prompt; raises EndpointError after finishing (and caching) the
        requests that can be finished."""
        size = self.prompts_per_request
        if size > 1 and not any(isinstance(p, list) for p in prompts):
            jobs = [("/completions", {**self._body("", params)[1], "prompt": list(prompts[k:k + size])})
                    for k in range(0, len(prompts), size)]
        else:
            size, jobs = 1, [self._body(p, params) for p in prompts]
        results: list[dict | None] = [None] * len(jobs)
        errors: list[str] = []

        def run(i: int) -> None:
            try:
                results[i] = self.request(*jobs[i])
            except EndpointError as err:
                errors.append(str(err))

        with ThreadPoolExecutor(max_workers=min(self.concurrency, max(len(jobs), 1))) as pool:
            list(pool.map(run, range(len(jobs))))
        if errors:
            where = f"; the {len(jobs) - len(errors)} answered are cached in {self.cache.directory}" if self.cache else ""
            raise EndpointError(f"{len(errors)} of {len(jobs)} requests failed{where}. Last error: {errors[-1]}")
        counts = [len(jobs[j][1]["prompt"]) if size > 1 else 1 for j in range(len(jobs))]
        return self._to_text_rollout(results, counts, params.n)

    @staticmethod
    def _to_text_rollout(results: list[dict], counts: list[int], n: int) -> TextRollout:
        """Choices of request j (for ``counts[j]`` prompts, ``n`` each, prompt-major) in prompt order."""
        texts, reasons, index, logprobs = [], [], [], []
        usage: dict[str, int] = {}
        first = 0
        for response, count in zip(results, counts, strict=True):
            choices = sorted(response["choices"], key=lambda c: c.get("index", 0))
            if len(choices) != n * count:
                raise EndpointError(f"asked for n={n} completions of {count} prompt(s), the endpoint returned "
                                    f"{len(choices)}")
            for k, choice in enumerate(choices):
                i = first + k // n
                texts.append(_choice_text(choice))
                logprobs.append(_choice_logprobs(choice))
                reasons.append("length" if choice.get("finish_reason") == "length" else "stop")
                index.append(i)
            first += count
            for k, v in (response.get("usage") or {}).items():
                if isinstance(v, int):
                    usage[k] = usage.get(k, 0) + v
        return TextRollout(texts, reasons, index, usage, logprobs)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> Rollout:
        """The :class:`GenerationEngine` protocol over HTTP (needs ``tokenizer``); see the module docstring."""
        if self.tokenizer is None:
            raise ValueError("OpenAIEngine.generate takes token ids and needs a tokenizer; use complete() for text")
        bos = getattr(self.tokenizer, "bos_token_id", None)
        texts = [self.tokenizer.decode(p[1:] if bos is not None and p and p[0] == bos else p) for p in prompts]
        out = self.complete(texts, params)
        ids = [list(self.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in out.texts]
        sent = out.logprobs or [None] * len(ids)
        logprobs = [aligned_logprobs(c, lp, self.tokenizer) for c, lp in zip(ids, sent, strict=True)]
        return Rollout(prompt_ids=[list(prompts[i]) for i in out.prompt_index], completion_ids=ids,
                       completion_logprobs=logprobs, finish_reasons=out.finish_reasons,
                       prompt_index=out.prompt_index, texts=out.texts)


def _read_until(reply: Any, deadline: float, timeout: float) -> bytes:
    """The reply body, given up at ``deadline``: ``timeout`` alone bounds each socket read, so a server
    sending a byte at a time could otherwise hold an attempt indefinitely."""
    parts = []
    while True:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the response was not complete after {timeout:g} s")
        chunk = reply.read1(65536)
        if not chunk:
            return b"".join(parts)
        parts.append(chunk)


def _choice_logprobs(choice: dict) -> tuple[list[str] | None, list[float]] | None:
    """The sampled tokens (text, when sent) and their log-probs of a choice (completions ``logprobs.tokens`` /
    ``token_logprobs``, chat ``logprobs.content[].token`` / ``.logprob``), or None when the server sent none."""
    block = choice.get("logprobs")
    if not isinstance(block, dict):
        return None
    tokens, values = block.get("tokens"), block.get("token_logprobs")
    if values is None and isinstance(block.get("content"), list):
        items = [item if isinstance(item, dict) else {} for item in block["content"]]
        tokens, values = [item.get("token") for item in items], [item.get("logprob") for item in items]
    if not isinstance(values, list):
        return None
    tokens = [str(t) for t in tokens] if isinstance(tokens, list) and len(tokens) == len(values) else None
    return tokens, [float(v) if isinstance(v, int | float) else math.nan for v in values]


def aligned_logprobs(ids: list[int], sent: tuple[list[str] | None, list[float]] | None, tokenizer: Any
                     ) -> list[float]:
    """The server's log-probs for the re-tokenised ``ids`` when its tokens are these (each id decodes to the
    server's token text, where it sent them), with at most one more at the end (the EOS the text leaves
    out); NaN for every token otherwise."""
    if sent is not None:
        tokens, values = sent
        if len(ids) <= len(values) <= len(ids) + 1 and (
                tokens is None or [tokenizer.decode([i]) for i in ids] == tokens[:len(ids)]):
            return values[:len(ids)]
    return [math.nan] * len(ids)


def _choice_text(choice: Any) -> str:
    """A choice's completion text (``text``, or a chat ``message.content``; None counts as empty);
    ValueError for a choice of the wrong shape."""
    if not isinstance(choice, dict):
        raise ValueError(f"a choice is {type(choice).__name__}, not an object")
    text = choice.get("text")
    if text is None:
        message = choice.get("message")
        if message is not None and not isinstance(message, dict):
            raise ValueError("a choice's 'message' is not an object")
        text = (message or {}).get("content") or ""
    if not isinstance(text, str):
        raise ValueError(f"a choice's text is {type(text).__name__}, not a string")
    return text


def _error_message(err: urllib.error.HTTPError) -> str:
    try:
        raw = err.read()
    except OSError:
        return err.reason or ""
    try:
        return str(json.loads(raw)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return raw[:200].decode(errors="replace") or str(err.reason)


def _retry_after(err: urllib.error.HTTPError) -> float | None:
    value = err.headers.get("Retry-After") if err.headers else None
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None
