"""How to sample: the engine-call parameters (``SamplingParams``) and the one ``SamplingConfig`` every stage uses.

One semantics everywhere: ``temperature: 0`` means greedy decoding. A stage that cannot use greedy
samples (RL, whose log-probs are taken at the sampling temperature; K samples per prompt that must
differ) says so in its own validator.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import Field

from tether.config.base import StrictModel


@dataclass
class SamplingParams:
    """How to sample: ``n`` samples per prompt, temperature / top-k / top-p, stop conditions.

    ``temperature == 0`` means greedy, as does ``greedy=True``. ``top_k == 0`` and ``top_p == 1``
    switch those filters off. A sample stops on the tokenizer's EOS or when its decoded text
    contains one of ``stop``; the stop string is kept in the returned text, which is cut right
    after it. ``seed`` makes sampling reproducible: the same seed, prompts and batch size give
    the same samples.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    greedy: bool = False
    stop: list[str] = field(default_factory=list)
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(
                f"SamplingParams.temperature must be >= 0 (0 means greedy), got {self.temperature}"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0 (0 switches it off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if isinstance(self.stop, str):
            raise ValueError(f"SamplingParams.stop must be a list of strings, got the string {self.stop!r}")
        self.stop = list(self.stop)
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise ValueError(f"SamplingParams.stop must hold non-empty strings, got {self.stop!r}")

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0


class SamplingConfig(StrictModel):
    """How completions are sampled; ``temperature: 0`` is greedy decoding."""

    temperature: float = Field(1.0, ge=0, description="softmax temperature; 0: greedy")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling mass; 1: off")
    top_k: int = Field(0, ge=0, description="sample among the k most likely tokens; 0: off")
    max_new_tokens: int = Field(64, ge=1, description="tokens generated per completion at most")
    stop: list[str] = Field(default_factory=list, description="strings that end a completion (kept in its text)")
    engine_batch_size: int | None = Field(None, ge=1, description="samples decoded together; None: a call's all")

    def params(self, n: int = 1, seed: int | None = None) -> SamplingParams:
        """The engine-call parameters for ``n`` samples per prompt."""
        return SamplingParams(n=n, temperature=self.temperature, greedy=self.temperature == 0, top_p=self.top_p,
                              top_k=self.top_k, max_new_tokens=self.max_new_tokens, stop=list(self.stop), seed=seed)
