"""An OpenAI-compatible HTTP server over any checkpoint: ``tether serve MODEL``.

``/v1/completions`` (a prompt string or a list of them), ``/v1/chat/completions`` (a message list,
rendered with the tokenizer's chat template) and ``/v1/models``, on FastAPI + uvicorn, generating
with a rollout engine (:class:`tether.rollout.HFEngine` by default, or any ``GenerationEngine``).
Sampling options: ``n``, ``temperature`` (0 = greedy), ``top_p``, ``top_k`` (an extension, as in
vLLM), ``max_tokens``, ``stop`` (a string or a list), ``seed``.

Safety defaults: bound to 127.0.0.1; request bodies over ``max_request_bytes`` get 413 before
they are parsed; ``n`` and ``max_tokens`` are capped; with an API key (read from an environment
variable, never a command-line argument) every ``/v1`` route needs ``Authorization: Bearer KEY``.
Errors use OpenAI's shape, ``{"error": {"message", "type", "code"}}``.

How it departs from OpenAI's API: no streaming, no log-probs, no tools; requests are served one
at a time (a lock around the engine; the engine batches the ``n`` samples and the prompts of one
request); a stop string is removed from the returned text, as OpenAI does, though the engine
stops on it after the token that completed it.
"""

# no `from __future__ import annotations`: FastAPI reads the route signatures' annotations, which
# name classes defined inside create_app
import hmac
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
MAX_REQUEST_BYTES = 1 << 20
MAX_N = 64
MAX_TOKENS_LIMIT = 4096
LISTENING = "tether serve: listening on "


class _TooLarge(Exception):
    pass


class BodyLimit:
    """Pure ASGI middleware: a request body over ``limit`` bytes gets 413, whether the client sent a
    ``Content-Length`` or a chunked body (counted as it arrives)."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            await _send_error(send, 413, f"request body of {int(length)} bytes is over the limit of {self.limit}")
            return
        received = 0
        started = False

        async def limited_receive() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise _TooLarge
            return message

        async def tracking_send(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _TooLarge:
            if not started:
                await _send_error(send, 413, f"request body is over the limit of {self.limit} bytes")


async def _send_error(send: Any, status: int, message: str) -> None:
    body = json.dumps(_error_body(message, "invalid_request_error", status)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _error_body(message: str, kind: str, code: int | str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "code": code}}


def _strip_stop(text: str, stop: Sequence[str]) -> str:
    """OpenAI returns the text before the first stop string, without it."""
    cuts = [text.find(s) for s in stop if s in text]
    return text[: min(cuts)] if cuts else text


def _sampling_fields(body: Any, max_tokens_default: int) -> dict[str, Any]:
    stop = body.stop
    return {"n": body.n, "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
            "max_new_tokens": body.max_tokens or max_tokens_default, "greedy": body.temperature == 0,
            "stop": [stop] if isinstance(stop, str) else list(stop or []), "seed": body.seed}


class ServeState:
    """What the routes share: the engine, its tokenizer, the lock that serialises generation, limits."""

    def __init__(self, engine: Any, tokenizer: Any, model_name: str, *, max_n: int, max_tokens_limit: int,
                 max_tokens_default: int, context_length: int | None) -> None:
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.max_n, self.max_tokens_limit, self.max_tokens_default = max_n, max_tokens_limit, max_tokens_default
        self.context_length = context_length
        self.lock = threading.Lock()
        self.created = int(time.time())

    def generate(self, prompts: list[str | list[dict]], fields: dict[str, Any]) -> tuple[list[dict], dict]:
        """Choices (prompt-major, ``n`` per prompt) and the usage block; ValueError on a bad request."""
        from tether.data import tokenize_prompts
        from tether.rollout import SamplingParams

        if fields["n"] > self.max_n:
            raise ValueError(f"n={fields['n']} is over this server's limit of {self.max_n}")
        if fields["max_new_tokens"] > self.max_tokens_limit:
            raise ValueError(f"max_tokens={fields['max_new_tokens']} is over this server's limit of "
                             f"{self.max_tokens_limit}")
        params = SamplingParams(**fields)
        ids = tokenize_prompts(prompts, self.tokenizer)
        longest = max(len(p) for p in ids)
        if self.context_length and longest + params.max_new_tokens > self.context_length:
            raise ValueError(f"prompt ({longest} tokens) + max_tokens ({params.max_new_tokens}) exceeds the "
                             f"model's context length of {self.context_length}")
        with self.lock:
            rollout = self.engine.generate(ids, params)
        choices = [{"index": i, "text": _strip_stop(text, params.stop), "finish_reason": reason,
                    "tokens": [self.tokenizer.decode([t]) for t in ids], "token_logprobs": list(logprobs)}
                   for i, (text, reason, ids, logprobs) in enumerate(zip(
                       rollout.texts, rollout.finish_reasons, rollout.completion_ids, rollout.completion_logprobs,
                       strict=True))]
        prompt_tokens = sum(len(p) for p in ids)
        completion_tokens = sum(len(c) for c in rollout.completion_ids)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens}
        return choices, usage


def _completion_logprobs(choice: dict) -> dict:
    """The completions API's ``logprobs`` block: every sampled token (also past a stop string, as sampled) and
    its log-prob at the request's temperature, before top-p / top-k; no top alternatives."""
    tokens = choice["tokens"]
    offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    return {"tokens": tokens, "token_logprobs": choice["token_logprobs"], "top_logprobs": None,
            "text_offset": offsets}


def _chat_logprobs(choice: dict) -> dict:
    """The chat API's ``logprobs`` block, the same figures as :func:`_completion_logprobs`."""
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                        for t, lp in zip(choice["tokens"], choice["token_logprobs"], strict=True)]}


def _request_models() -> tuple[type, type]:
    from pydantic import BaseModel, ConfigDict, Field

    class Sampling(BaseModel):
        # OpenAI clients send fields this server does not use (user, logit_bias, ...): ignored
        model_config = ConfigDict(extra="ignore")
        model: str | None = None
        n: int = Field(1, ge=1)
        temperature: float = Field(1.0, ge=0, le=100)
        top_p: float = Field(1.0, gt=0, le=1)
        top_k: int = Field(0, ge=0)
        max_tokens: int | None = Field(None, ge=1)
        max_completion_tokens: int | None = Field(None, ge=1)
        stop: str | list[str] | None = None
        seed: int | None = None
        stream: bool = False

    class Completion(Sampling):
        prompt: str | list[str]
        logprobs: int | None = Field(None, ge=0, le=0, description="0: each sampled token's log-prob (top "
                                     "alternatives are not returned)")

    class Message(BaseModel):
        model_config = ConfigDict(extra="ignore")
        role: str
        content: str

    class Chat(Sampling):
        messages: list[Message] = Field(min_length=1)
        logprobs: bool = False
        top_logprobs: int | None = Field(None, ge=0, le=0, description="top alternatives are not returned: 0")

    return Completion, Chat


def create_app(model: Any = None, tokenizer: Any = None, *, engine: Any = None, model_name: str = "tether",
               api_key: str | None = None, max_request_bytes: int = MAX_REQUEST_BYTES, max_n: int = MAX_N,
               max_tokens_limit: int = MAX_TOKENS_LIMIT, max_tokens_default: int = 64,
               engine_batch_size: int | None = None) -> Any:
    """The FastAPI app: pass a loaded ``model`` and ``tokenizer`` (an :class:`HFEngine` is built), or any
    ``engine`` with ``generate(prompt_ids, SamplingParams) -> Rollout`` and its ``tokenizer``."""
    from fastapi import Depends, FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse

    if tokenizer is None:
        raise ValueError("create_app needs the tokenizer")
    if engine is None:
        if model is None:
            raise ValueError("create_app needs a model or an engine")
        from tether.rollout import HFEngine

        engine = HFEngine(model, tokenizer, batch_size=engine_batch_size)
    config = getattr(model if model is not None else getattr(engine, "model", None), "config", None)
    state = ServeState(engine, tokenizer, model_name, max_n=max_n, max_tokens_limit=max_tokens_limit,
                       max_tokens_default=max_tokens_default,
                       context_length=getattr(config, "max_position_embeddings", None))
    Completion, Chat = _request_models()
    app = FastAPI(title="tether serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.tether = state

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        given = header[7:] if header.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(given.encode(), api_key.encode()):
            raise _HTTPError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')",
                             "authentication_error")

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        where = "; ".join(f"{'.'.join(str(x) for x in e['loc'][1:]) or 'body'}: {e['msg']}" for e in err.errors())
        return JSONResponse(_error_body(f"invalid request: {where}", "invalid_request_error", 400), status_code=400)

    @app.exception_handler(_HTTPError)
    async def _http_error(request: Request, err: _HTTPError) -> JSONResponse:
        return JSONResponse(_error_body(err.message, err.kind, err.status), status_code=err.status)

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    def models() -> dict:
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                            "owned_by": "tether"}]}

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    def completions(body: Completion) -> dict:
        prompts = [body.prompt] if isinstance(body.prompt, str) else list(body.prompt)
        if not prompts:
            raise _HTTPError(400, "prompt: an empty list")
        choices, usage = _run(state, prompts, body)
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": state.model_name, "usage": usage,
                "choices": [{"index": c["index"], "text": c["text"], "finish_reason": c["finish_reason"],
                             "logprobs": _completion_logprobs(c) if body.logprobs is not None else None}
                            for c in choices]}

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    def chat(body: Chat) -> dict:
        messages = [{"role": m.role, "content": m.content} for m in body.messages]
        choices, usage = _run(state, [messages], body)
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": state.model_name, "usage": usage,
                "choices": [{"index": c["index"], "finish_reason": c["finish_reason"],
                             "message": {"role": "assistant", "content": c["text"]},
                             "logprobs": _chat_logprobs(c) if body.logprobs else None} for c in choices]}

    return BodyLimit(app, max_request_bytes)


class _HTTPError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def _run(state: ServeState, prompts: list, body: Any) -> tuple[list[dict], dict]:
    if body.stream:
        raise _HTTPError(400, "stream: streaming is not supported by tether serve")
    if body.max_completion_tokens is not None and body.max_tokens is None:
        body.max_tokens = body.max_completion_tokens
    try:
        return state.generate(prompts, _sampling_fields(body, state.max_tokens_default))
    except ValueError as err:
        raise _HTTPError(400, str(err)) from None


# ---- running it ---------------------------------------------------------------------------------------


def bind_socket(host: str = DEFAULT_HOST, port: int = 0) -> socket.socket:
    """A listening TCP socket; port 0 takes a free one (read it back with ``getsockname()``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}/v1" if ":" in host else f"http://{host}:{port}/v1"


class BackgroundServer:
    """An app under uvicorn in a thread of this process on a free loopback port (tests, notebooks).

    >>> with BackgroundServer(create_app(model, tok)) as server:   # doctest: +SKIP
    ...     OpenAIEngine(server.base_url, "tether")
    """

    def __init__(self, app: Any, host: str = DEFAULT_HOST, port: int = 0) -> None:
        import uvicorn

        self.socket = bind_socket(host, port)
        self.port = self.socket.getsockname()[1]
        self.base_url = _url(host, self.port)
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)

    def start(self) -> "BackgroundServer":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the background server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.socket.close()

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class ServerProcess:
    """``tether serve MODEL`` as a child process on a free loopback port, stopped by :meth:`stop`.

    The child's output goes to ``log_path`` (a temporary file by default); :meth:`start` waits until
    the server answers ``/v1/models`` and fails with the log's tail if the child dies first.
    """

    def __init__(self, model: str | Path, *, host: str = DEFAULT_HOST, model_name: str | None = None,
                 api_key_env: str | None = None, log_path: str | Path | None = None,
                 extra_args: Sequence[str] = (), startup_timeout: float = 180.0) -> None:
        self.model, self.host, self.model_name = str(model), host, model_name or Path(str(model)).name
        self.api_key_env, self.extra_args, self.startup_timeout = api_key_env, list(extra_args), startup_timeout
        self.log_path = Path(log_path) if log_path else None
        self.process: subprocess.Popen | None = None
        self.base_url = ""

    def start(self) -> "ServerProcess":
        import tempfile

        if self.log_path is None:
            handle, name = tempfile.mkstemp(prefix="tether-serve-", suffix=".log")
            os.close(handle)
            self.log_path = Path(name)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "tether.cli", "serve", self.model, "--host", self.host, "--port", "0",
                   "--model-name", self.model_name, *self.extra_args]
        if self.api_key_env:
            command += ["--api-key-env", self.api_key_env]
        with open(self.log_path, "w") as log_file:
            self.process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL)
        self.base_url = self._wait_for_url()
        self._wait_ready()
        return self

    def _tail(self) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""
        return text[-2000:]

    def _wait_for_url(self) -> str:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            for line in self._tail().splitlines():
                if line.startswith(LISTENING):
                    return line[len(LISTENING):].split()[0]
            if self.process.poll() is not None:
                raise RuntimeError(f"tether serve exited with code {self.process.returncode}:\n{self._tail()}")
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"tether serve did not start within {self.startup_timeout:.0f}s:\n{self._tail()}")

    def _wait_ready(self) -> None:
        import urllib.request

        deadline = time.monotonic() + self.startup_timeout
        headers = {}
        if self.api_key_env and os.environ.get(self.api_key_env):
            headers["Authorization"] = f"Bearer {os.environ[self.api_key_env]}"
        while time.monotonic() < deadline:
            try:
                request = urllib.request.Request(f"{self.base_url}/models", headers=headers)
                with urllib.request.urlopen(request, timeout=2):
                    return
            except OSError:
                if self.process.poll() is not None:
                    raise RuntimeError(f"tether serve exited with code {self.process.returncode}:\n"
                                       f"{self._tail()}") from None
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"tether serve did not answer within {self.startup_timeout:.0f}s:\n{self._tail()}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def serve(model: str, *, host: str = DEFAULT_HOST, port: int = 8000, model_name: str | None = None,
          api_key_env: str | None = None, device: str = "cpu", dtype: str = "float32", threads: int | None = None,
          max_request_bytes: int = MAX_REQUEST_BYTES, max_n: int = MAX_N, max_tokens_limit: int = MAX_TOKENS_LIMIT,
          max_tokens_default: int = 64) -> None:
    """Load ``model`` and serve it until interrupted (what ``tether serve`` runs)."""
    import torch
    import uvicorn

    from tether.models import load_model

    api_key = None
    if api_key_env:
        api_key = os.environ.get(api_key_env)
        if not api_key:
            raise ValueError(f"--api-key-env {api_key_env}: the environment variable is not set or empty")
    elif host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("serving on %s without an API key: anyone who can reach it can use it", host)
    if threads:
        torch.set_num_threads(threads)
    policy, tokenizer = load_model(model, device=device, dtype=dtype)
    app = create_app(policy, tokenizer, model_name=model_name or Path(model).name, api_key=api_key,
                     max_request_bytes=max_request_bytes, max_n=max_n, max_tokens_limit=max_tokens_limit,
                     max_tokens_default=max_tokens_default)
    sock = bind_socket(host, port)
    print(f"{LISTENING}{_url(host, sock.getsockname()[1])} (model {model_name or Path(model).name})", flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
