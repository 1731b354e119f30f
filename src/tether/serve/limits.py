"""The request-body guard of ``tether serve``: pure ASGI middleware, so an oversized body is refused before it
is read, let alone parsed."""

from __future__ import annotations

import json
from typing import Any

from tether.serve.openai_format import error_body


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
    body = json.dumps(error_body(message, "invalid_request_error", status)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
