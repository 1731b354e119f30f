"""The OpenAI API's shapes that ``tether serve`` answers in: errors, log-prob blocks, streamed chunks, and the
request parameters it refuses rather than silently ignores."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

# Accepted and ignored: they change nothing about a completion.
IGNORED = frozenset({"user", "metadata", "store", "service_tier"})


def error_body(message: str, kind: str, code: int | str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def model_not_found(name: str) -> dict:
    return error_body(f"The model `{name}` does not exist: this server serves one model (GET /v1/models)",
                      "invalid_request_error", "model_not_found", "model")


def unsupported(extra: dict[str, Any]) -> str | None:
    """The first parameter a request sets that this server does not implement (a non-empty value of a field it
    does not know, other than :data:`IGNORED`), as a one-line message; None when there is none."""
    for key, value in extra.items():
        if key in IGNORED or value in (None, False, 0, "", [], {}):
            continue
        return f"{key}: not supported by tether serve"
    return None


def invalid_text(**fields: Any) -> str | None:
    """The first field holding text that is not valid Unicode (a lone surrogate), as a one-line message."""
    for name, value in fields.items():
        for i, text in enumerate([value] if isinstance(value, str) else list(value or [])):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                where = name if isinstance(value, str) else f"{name}[{i}]"
                return f"{where}: invalid text (a lone surrogate or other character that is not valid Unicode)"
    return None


def strip_stop(text: str, stop: Sequence[str]) -> str:
    """OpenAI returns the text before the first stop string, without it."""
    cuts = [text.find(s) for s in stop if s in text]
    return text[: min(cuts)] if cuts else text


def completion_logprobs(choice: dict) -> dict:
    """The completions API's ``logprobs`` block: every sampled token (also past a stop string, as sampled), its
    log-prob at the request's temperature before top-p / top-k, and the top alternatives when asked."""
    tokens = choice["tokens"]
    offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    top = choice.get("top_logprobs")
    return {"tokens": tokens, "token_logprobs": choice["token_logprobs"],
            "top_logprobs": [dict(alternatives) for alternatives in top] if top is not None else None,
            "text_offset": offsets}


def chat_logprobs(choice: dict) -> dict:
    """The chat API's ``logprobs`` block, the same figures as :func:`completion_logprobs`."""
    top = choice.get("top_logprobs") or [[] for _ in choice["tokens"]]
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                         "top_logprobs": [{"token": a, "logprob": b, "bytes": list(a.encode())} for a, b in alt]}
                        for t, lp, alt in zip(choice["tokens"], choice["token_logprobs"], top, strict=True)]}


def sse(data: dict | str) -> str:
    """One server-sent event of the OpenAI stream."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"
