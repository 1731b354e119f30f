"""Fair turns for generation: a request's work is cut into bounded chunks, and chunks take turns in the order
they asked, so a small request waits for at most one chunk of a large one, never for the whole of it."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class ServeBudget:
    """What one request may ask for; over it, a 400 before any generation."""

    max_n: int = 64  # samples per prompt
    max_tokens_limit: int = 4096  # max_tokens
    max_sequences: int = 256  # prompts x n
    max_request_tokens: int = 32768  # prompts x n x max_tokens
    chunk_sequences: int = 32  # sequences generated per turn

    def check(self, prompts: int, n: int, max_tokens: int) -> None:
        """ValueError naming the budget a request is over."""
        if n > self.max_n:
            raise ValueError(f"n={n} is over this server's limit of {self.max_n} (--max-n)")
        if max_tokens > self.max_tokens_limit:
            raise ValueError(f"max_tokens={max_tokens} is over this server's limit of {self.max_tokens_limit} "
                             "(--max-tokens-limit)")
        if prompts * n > self.max_sequences:
            raise ValueError(f"the request asks for {prompts * n} sequences ({prompts} prompts x n={n}); this "
                             f"server's budget is {self.max_sequences} per request (--max-sequences)")
        if prompts * n * max_tokens > self.max_request_tokens:
            raise ValueError(f"the request asks for up to {prompts * n * max_tokens} new tokens ({prompts} prompts x "
                             f"n={n} x max_tokens={max_tokens}); this server's budget is {self.max_request_tokens} "
                             "per request (--max-request-tokens)")

    def prompts_per_chunk(self, n: int) -> int:
        """How many prompts (each with its n samples) one turn generates."""
        return max(1, self.chunk_sequences // n)


class FairScheduler:
    """A FIFO ticket lock: each chunk takes a ticket when it is ready and runs when its ticket comes up, one at a
    time. A request takes its next ticket only after its previous chunk ran, so requests alternate chunk by chunk."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._next_ticket = 0
        self._serving = 0

    @contextmanager
    def turn(self) -> Iterator[None]:
        with self._condition:
            ticket = self._next_ticket
            self._next_ticket += 1
            while ticket != self._serving:
                self._condition.wait()
        try:
            yield
        finally:
            with self._condition:
                self._serving += 1
                self._condition.notify_all()
