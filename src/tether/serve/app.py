"""The FastAPI app of ``tether serve``: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models`` and
``/v1/models/{id}``, in OpenAI's request and response shapes, generating with a rollout engine.

A request is checked before anything is generated: its size against the :class:`ServeBudget` (samples
per prompt, ``max_tokens``, prompts x n sequences, prompts x n x max_tokens new tokens), its text (valid
Unicode), its ``model`` (404 ``model_not_found`` for another), and its parameters (400 for one this server
does not implement, such as ``tools`` or ``response_format``). Generation runs in chunks of at most
``chunk_sequences`` sequences that take turns with other requests' chunks (:class:`FairScheduler`), so a
small request is served between the chunks of a large one. ``stream: true`` sends each choice as an OpenAI
chunk (server-sent events) as soon as its chunk is generated, then ``[DONE]``; ``stream_options:
{include_usage: true}`` adds the usage chunk. Log-probs: the sampled tokens' (``logprobs: 0`` / chat
``logprobs: true``) come from the engine; top alternatives (``logprobs: k``, ``top_logprobs: k``, k <= 5)
from one forward pass of the served model over the finished sequences. A completions ``prompt`` may be
token ids (a list of ints, or a list of such lists); ``echo: true`` puts the prompt before each choice's
text, and with ``logprobs: 0`` its tokens' log-probs (temperature 1; None for the first token) before the
sampled ones, from one forward pass of the served model: what an on-policy distillation teacher returns.
"""

# no `from __future__ import annotations`: FastAPI reads the route signatures' annotations, which
# name classes defined inside create_app
import hmac
import logging
import time
import uuid
from collections.abc import Iterator
from typing import Any

from tether.serve.limits import BodyLimit
from tether.serve.openai_format import (
    chat_logprobs,
    completion_logprobs,
    error_body,
    invalid_text,
    model_not_found,
    sse,
    strip_stop,
    unsupported,
)
from tether.serve.scheduler import FairScheduler, ServeBudget

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 1 << 20
MAX_TOP_LOGPROBS = 5


class ServeState:
    """What the routes share: the engine, its tokenizer, the served model (for top log-probs), the budget and
    the scheduler that gives generation chunks their turns."""

    def __init__(self, engine: Any, tokenizer: Any, model_name: str, *, budget: ServeBudget, max_tokens_default: int,
                 context_length: int | None, model: Any = None) -> None:
        self.engine, self.tokenizer, self.model_name, self.model = engine, tokenizer, model_name, model
        self.budget, self.max_tokens_default, self.context_length = budget, max_tokens_default, context_length
        self.scheduler = FairScheduler()
        self.created = int(time.time())

    def prepare(self, prompts: list, fields: dict[str, Any]) -> tuple[list[list[int]], Any]:
        """Token ids and sampling parameters of a request; ValueError (a 400) for one over the budget."""
        from tether.data import tokenize_prompts
        from tether.rollout import SamplingParams

        self.budget.check(len(prompts), fields["n"], fields["max_new_tokens"])
        params = SamplingParams(**fields)
        if all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompts):  # token ids
            vocabulary = len(self.tokenizer)
            if any(not 0 <= t < vocabulary for p in prompts for t in p) or not all(prompts):
                raise ValueError(f"prompt: token ids must be non-empty lists of ids in [0, {vocabulary})")
            ids = [list(p) for p in prompts]
        else:
            ids = tokenize_prompts(prompts, self.tokenizer)
        longest = max(len(p) for p in ids)
        if self.context_length and longest + params.max_new_tokens > self.context_length:
            raise ValueError(f"prompt ({longest} tokens) + max_tokens ({params.max_new_tokens}) exceeds the "
                             f"model's context length of {self.context_length}")
        return ids, params

    def generate(self, ids: list[list[int]], params: Any, top_logprobs: int = 0) -> Iterator[tuple[list[dict], dict]]:
        """Each chunk's choices (prompt-major, ``n`` per prompt, numbered across the request) and usage, as the
        chunks are generated in their turns. Chunk k samples with ``seed + k`` (the same seed: the same samples)."""
        import dataclasses

        per_chunk = self.budget.prompts_per_chunk(params.n)
        for k, start in enumerate(range(0, len(ids), per_chunk)):
            part = ids[start:start + per_chunk]
            chunk_params = params if params.seed is None else dataclasses.replace(params, seed=params.seed + k)
            with self.scheduler.turn():
                rollout = self.engine.generate(part, chunk_params)
                top = self.top_alternatives(rollout, params, top_logprobs) if top_logprobs else None
            first = start * params.n
            choices = [{"index": first + i, "text": strip_stop(text, params.stop), "finish_reason": reason,
                        "tokens": [self.tokenizer.decode([t]) for t in completion], "token_logprobs": list(logprobs),
                        "top_logprobs": top[i] if top is not None else None}
                       for i, (text, reason, completion, logprobs) in enumerate(zip(
                           rollout.texts, rollout.finish_reasons, rollout.completion_ids, rollout.completion_logprobs,
                           strict=True))]
            prompt_tokens = sum(len(p) for p in part)
            completion_tokens = sum(len(c) for c in rollout.completion_ids)
            yield choices, {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                            "total_tokens": prompt_tokens + completion_tokens}

    def prompt_logprobs(self, ids: list[int]) -> list[float | None]:
        """``log p(x_t | x_<t)`` of every prompt token under the served model at temperature 1 (None for the
        first, which nothing predicts): the echoed prompt's log-probs."""
        import torch

        with torch.inference_mode():
            tokens = torch.tensor([ids], device=next(self.model.parameters()).device)
            logps = torch.log_softmax(self.model(input_ids=tokens).logits[0, :-1].float(), -1)
            return [None, *logps.gather(-1, tokens[0, 1:, None]).squeeze(-1).tolist()]

    def top_alternatives(self, rollout: Any, params: Any, k: int) -> list[list[tuple[str, float]]]:
        """Per sample, per completion token: the k most likely tokens and their log-probs at the sampling
        temperature (1 when greedy), from one forward pass of the served model per sequence."""
        import torch

        temperature = 1.0 if params.is_greedy else params.temperature
        out = []
        with torch.inference_mode():
            for prompt, completion in zip(rollout.prompt_ids, rollout.completion_ids, strict=True):
                if not completion:
                    out.append([])
                    continue
                ids = torch.tensor([prompt + completion], device=next(self.model.parameters()).device)
                logits = self.model(input_ids=ids).logits[0, len(prompt) - 1:len(prompt) + len(completion) - 1]
                values, tokens = torch.log_softmax(logits.float() / temperature, -1).topk(k, -1)
                out.append([[(self.tokenizer.decode([int(t)]), float(v)) for t, v in zip(row_t, row_v, strict=True)]
                            for row_t, row_v in zip(tokens.tolist(), values.tolist(), strict=True)])
        return out


def _echo(state: ServeState, ids: list[int]) -> dict[str, Any]:
    """A prompt's text, tokens and log-probs, for ``echo``."""
    return {"text": state.tokenizer.decode(ids, skip_special_tokens=True), "tokens": [state.tokenizer.decode([t]) for t in ids],
            "token_logprobs": state.prompt_logprobs(ids)}


def _with_prompt(choice: dict, prompt: dict) -> dict:
    """``choice`` with the echoed prompt before its text, tokens and log-probs (OpenAI's ``echo``)."""
    return {**choice, "text": prompt["text"] + choice["text"], "tokens": prompt["tokens"] + choice["tokens"],
            "token_logprobs": prompt["token_logprobs"] + choice["token_logprobs"], "top_logprobs": None}


def _sampling_fields(body: Any, max_tokens_default: int) -> dict[str, Any]:
    stop = body.stop
    return {"n": body.n, "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
            "max_new_tokens": body.max_tokens or body.max_completion_tokens or max_tokens_default,
            "greedy": body.temperature == 0, "stop": [stop] if isinstance(stop, str) else list(stop or []),
            "seed": body.seed}


def _request_models() -> tuple[type, type]:
    from pydantic import BaseModel, ConfigDict, Field

    class StreamOptions(BaseModel):
        model_config = ConfigDict(extra="ignore")
        include_usage: bool = False

    class Sampling(BaseModel):
        # kept, not dropped: a parameter this server does not implement is refused (openai_format.unsupported)
        model_config = ConfigDict(extra="allow")
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
        stream_options: StreamOptions | None = None

    class Completion(Sampling):
        prompt: str | list[str] | list[int] | list[list[int]]
        logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
        echo: bool = False

    class Message(BaseModel):
        model_config = ConfigDict(extra="ignore")
        role: str
        content: str

    class Chat(Sampling):
        messages: list[Message] = Field(min_length=1)
        logprobs: bool = False
        top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    return Completion, Chat


class _HTTPError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", body: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.body = status, message, kind, body


def create_app(model: Any = None, tokenizer: Any = None, *, engine: Any = None, model_name: str = "tether",
               api_key: str | None = None, max_request_bytes: int = MAX_REQUEST_BYTES, budget: ServeBudget | None = None,
               max_n: int | None = None, max_tokens_limit: int | None = None, max_tokens_default: int = 64,
               engine_batch_size: int | None = None) -> Any:
    """The ASGI app (FastAPI behind the body-size guard): pass a loaded ``model`` and ``tokenizer`` (an
    :class:`HFEngine` is built), or any ``engine`` with ``generate(prompt_ids, SamplingParams) -> Rollout`` and
    its ``tokenizer``. ``budget`` bounds a request (``max_n`` / ``max_tokens_limit`` override its fields)."""
    from fastapi import Depends, FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, StreamingResponse

    if tokenizer is None:
        raise ValueError("create_app needs the tokenizer")
    if engine is None:
        if model is None:
            raise ValueError("create_app needs a model or an engine")
        from tether.rollout import HFEngine

        engine = HFEngine(model, tokenizer, batch_size=engine_batch_size)
    budget = budget or ServeBudget()
    overrides = {k: v for k, v in (("max_n", max_n), ("max_tokens_limit", max_tokens_limit)) if v is not None}
    if overrides:
        import dataclasses

        budget = dataclasses.replace(budget, **overrides)
    served = model if model is not None else getattr(engine, "model", None)
    config = getattr(served, "config", None)
    state = ServeState(engine, tokenizer, model_name, budget=budget, max_tokens_default=max_tokens_default,
                       context_length=getattr(config, "max_position_embeddings", None), model=served)
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
        return JSONResponse(error_body(f"invalid request: {where}", "invalid_request_error", 400), status_code=400)

    @app.exception_handler(_HTTPError)
    async def _http_error(request: Request, err: _HTTPError) -> JSONResponse:
        return JSONResponse(err.body or error_body(err.message, err.kind, err.status), status_code=err.status)

    def model_card() -> dict:
        return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "tether"}

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(authorize)])
    def model_info(model_id: str) -> dict:
        if model_id != state.model_name:
            raise _HTTPError(404, "", body=model_not_found(model_id))
        return model_card()

    def start(body: Any, prompts: list, texts: dict[str, Any], top: int) -> tuple[list, Any]:
        """Every check before generation: the model, the parameters, the text, the budget."""
        if body.model is not None and body.model != state.model_name:
            raise _HTTPError(404, "", body=model_not_found(body.model))
        problem = unsupported(body.model_extra or {}) or invalid_text(**texts)
        if problem:
            raise _HTTPError(400, problem)
        if top and state.model is None:
            raise _HTTPError(400, "top log-probs need the served model's forward pass; this server has an engine only")
        try:
            return state.prepare(prompts, _sampling_fields(body, state.max_tokens_default))
        except ValueError as err:
            raise _HTTPError(400, str(err)) from None

    def respond(body: Any, ids: list, params: Any, top: int, shape: Any, kind: str, chunk_kind: str) -> Any:
        """The whole answer as JSON, or (``stream``) the choices as server-sent chunks as they are made."""
        header = {"id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}",
                  "created": int(time.time()), "model": state.model_name}
        if not body.stream:
            choices, usage = [], {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
            for part, part_usage in state.generate(ids, params, top):
                choices += part
                usage = {k: usage[k] + part_usage[k] for k in usage}
            return {**header, "object": kind, "choices": [shape(c, False) for c in choices], "usage": usage}
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def events() -> Iterator[str]:
            usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
            try:
                for part, part_usage in state.generate(ids, params, top):
                    usage = {k: usage[k] + part_usage[k] for k in usage}
                    for choice in part:
                        for delta in shape(choice, True):
                            yield sse({**header, "object": chunk_kind, "choices": [delta],
                                       **({"usage": None} if include_usage else {})})
            except Exception as err:  # the status line is sent: the error goes in the stream
                log.exception("generation failed while streaming")
                yield sse(error_body(f"generation failed: {err}", "server_error", 500))
                return
            if include_usage:
                yield sse({**header, "object": chunk_kind, "choices": [], "usage": usage})
            yield sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    def completions(body: Completion) -> Any:
        single = isinstance(body.prompt, str) or (bool(body.prompt) and isinstance(body.prompt[0], int))
        prompts = [body.prompt] if single else list(body.prompt)
        if not prompts:
            raise _HTTPError(400, "prompt: an empty list")
        top = body.logprobs or 0
        if body.echo and (body.stream or top or state.model is None):
            raise _HTTPError(400, "echo: supported without streaming, with logprobs 0 (or none), on a server "
                                  "that has the model")
        texts = body.prompt if isinstance(body.prompt, str) else [p for p in prompts if isinstance(p, str)]
        ids, params = start(body, prompts, {"prompt": texts, "stop": body.stop}, top)
        echoed = [_echo(state, p) for p in ids] if body.echo else None

        def shape(c: dict, streamed: bool) -> Any:
            if echoed is not None:
                c = _with_prompt(c, echoed[c["index"] // params.n])
            choice = {"index": c["index"], "text": c["text"], "finish_reason": c["finish_reason"],
                      "logprobs": completion_logprobs(c) if body.logprobs is not None else None}
            return [choice] if streamed else choice

        return respond(body, ids, params, top, shape, "text_completion", "text_completion")

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    def chat(body: Chat) -> Any:
        messages = [{"role": m.role, "content": m.content} for m in body.messages]
        top = body.top_logprobs or 0
        if top and not body.logprobs:
            raise _HTTPError(400, "top_logprobs: needs logprobs: true")
        ids, params = start(body, [messages], {"messages": [m["content"] for m in messages], "stop": body.stop}, top)

        def shape(c: dict, streamed: bool) -> Any:
            logprobs = chat_logprobs(c) if body.logprobs else None
            if not streamed:
                return {"index": c["index"], "finish_reason": c["finish_reason"], "logprobs": logprobs,
                        "message": {"role": "assistant", "content": c["text"]}}
            return [{"index": c["index"], "delta": {"role": "assistant", "content": c["text"]}, "logprobs": logprobs,
                     "finish_reason": None},
                    {"index": c["index"], "delta": {}, "logprobs": None, "finish_reason": c["finish_reason"]}]

        return respond(body, ids, params, top, shape, "chat.completion", "chat.completion.chunk")

    return BodyLimit(app, max_request_bytes)
