"""Scorers built from configs: reward lists, judges with the engines behind them, and *the* scorer.

A **scorer** gives each (prompt, completion) one number, or None where it has none. Every stage that
ranks, filters, pairs or rewards samples builds its scorer here from a
:class:`~tether.config.ScorerConfig`: reward functions (a verifier, by default the task's checker), a
trained reward model, or an LLM judge. Below this module the pieces know nothing of engines or
servers: ``tether.rewards`` holds the functions and judges, ``tether.rollout`` the engines.

- :func:`build_judge`: the judge a :class:`~tether.config.JudgeConfig` describes, with its engine (a
  local model, the live policy, an endpoint, a ``tether serve`` process started for it, a function).
- :func:`reward_composer`: a reward list as a :class:`~tether.rewards.RewardComposer` (or its Ray
  twin); entries whose registry entry ``needs`` a judge get one built from their ``judge`` block.
- :class:`Scorer`: a scorer config, built; scores plain lists, corpus records, or K samples per prompt
  (a pairwise judge ranks them by mean win probability).
"""

from __future__ import annotations

import atexit
import importlib
import json
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from tether.config.rewards import JudgeConfig, RewardRoutes, RewardSpec, ScorerConfig
from tether.core.pairing import pairwise_scores
from tether.rewards import REWARD_FUNCTIONS, RewardComposer, as_reward_spec
from tether.rewards.judge import (
    EndpointJudgeBackend,
    EngineJudgeBackend,
    PairwiseJudge,
    PointwiseJudge,
    as_backend,
)
from tether.rewards.routing import RoutedRewardComposer

NOT_COLUMNS = ("prompt", "completion")


# ---- judges --------------------------------------------------------------------------------------------


def _judge_backend(cfg: JudgeConfig, *, policy: Any, tokenizer: Any, cache_dir: str | Path | None,
                   log_dir: str | Path | None) -> tuple[Callable, Callable[[], None] | None]:
    if cfg.backend == "callable":
        module, _, name = cfg.model.partition(":")
        return as_backend(getattr(importlib.import_module(module), name)), None
    if cfg.backend in ("policy", "model"):
        from tether.rollout import HFEngine

        if cfg.backend == "model":
            from tether.models import load_model

            policy, tokenizer = load_model(cfg.model)
        if policy is None or tokenizer is None:
            raise ValueError("judge backend 'policy' needs the policy model and its tokenizer")
        engine = HFEngine(policy, tokenizer, batch_size=cfg.sampling.engine_batch_size)
        return EngineJudgeBackend(engine, tokenizer, sampling=cfg.sampling, chat=cfg.chat,
                              seed=cfg.sampling.seed), None
    from tether.rollout.openai_engine import OpenAIEngine

    closer, base_url, name = None, cfg.base_url, cfg.model
    if cfg.backend == "serve":
        from tether.serve import ServerProcess

        server = ServerProcess(cfg.model, model_name=str(Path(cfg.model).resolve()), extra_args=cfg.serve_args,
                               log_path=Path(log_dir) / "judge-server.log" if log_dir else None).start()
        closer, base_url, name = server.stop, server.base_url, server.model_name
    engine = OpenAIEngine(base_url, name, api_key_env=cfg.api_key_env, timeout=cfg.timeout,
                          max_retries=cfg.max_retries, concurrency=cfg.concurrency, backoff=cfg.backoff,
                          cache_dir=cache_dir if cfg.cache else None, chat=cfg.chat,
                          prompts_per_request=1 if cfg.chat else cfg.prompts_per_request)
    return EndpointJudgeBackend(engine, sampling=cfg.sampling, seed=cfg.sampling.seed), closer


def build_judge(cfg: JudgeConfig | dict, *, policy: Any = None, tokenizer: Any = None,
                cache_dir: str | Path | None = None, log_dir: str | Path | None = None
                ) -> PointwiseJudge | PairwiseJudge:
    """The judge a config describes; call ``.close()`` when done (it stops a ``serve`` backend's server).
    ``policy`` / ``tokenizer``: the model a ``policy`` backend judges with."""
    cfg = cfg if isinstance(cfg, JudgeConfig) else JudgeConfig.model_validate(cfg)
    backend, closer = _judge_backend(cfg, policy=policy, tokenizer=tokenizer, cache_dir=cache_dir, log_dir=log_dir)
    if cfg.kind == "pointwise":
        return PointwiseJudge(backend, template=cfg.template or "pointwise", scale=cfg.scale, samples=cfg.samples,
                              principle=cfg.principle, closer=closer, answer_only=cfg.answer_only)
    return PairwiseJudge(backend, template=cfg.template or "pairwise", swap=cfg.swap, principle=cfg.principle,
                         closer=closer, answer_only=cfg.answer_only)


_JUDGES: dict[str, PointwiseJudge | PairwiseJudge] = {}


def shared_judge(options: dict[str, Any], *, kind: str = "pointwise") -> PointwiseJudge | PairwiseJudge:
    """The judge of a config block, built on first use and kept for the process (its server stopped at
    exit): a reward function's judge is asked every step."""
    key = json.dumps({**options, "kind": kind}, sort_keys=True, default=str)
    if key not in _JUDGES:
        _JUDGES[key] = build_judge({**options, "kind": kind})
        atexit.register(_JUDGES[key].close)
    return _JUDGES[key]


# ---- reward lists --------------------------------------------------------------------------------------


def _with_judges(spec: RewardSpec) -> RewardSpec:
    """A spec whose registry entry needs a judge, its ``judge`` block built into a (shared) pointwise judge."""
    if not (isinstance(spec.name, str) and spec.name in REWARD_FUNCTIONS):
        return spec
    if "judge" not in REWARD_FUNCTIONS.needs(spec.name) or not isinstance(spec.kwargs.get("judge"), dict):
        return spec
    return spec.model_copy(update={"kwargs": {**spec.kwargs, "judge": shared_judge(spec.kwargs["judge"])}})


def local_reward_composer(specs: Sequence[RewardSpec | dict | Callable], *, on_error: str = "raise",
                          defaults: dict[str, Any] | None = None) -> RewardComposer:
    """A reward list scored in this process, judges built."""
    return RewardComposer([_with_judges(as_reward_spec(s)) for s in specs], on_error=on_error, defaults=defaults)


def reward_composer(specs: Sequence[RewardSpec | dict | Callable], *, on_error: str = "raise",
                    defaults: dict[str, Any] | None = None, workers: int = 0,
                    routes: RewardRoutes | dict | None = None) -> Any:
    """A reward list as a composer: in this process, or (``workers`` > 0) spread over Ray actors, each
    building its own with :func:`local_reward_composer`. ``defaults``: options for functions that take
    them (a stage's task). ``routes``: reward lists per prompt type instead of ``specs``
    (:func:`routed_reward_composer`)."""
    if routes is not None:
        return routed_reward_composer(routes, on_error=on_error, defaults=defaults, workers=workers)
    if workers:
        from tether.rewards.ray_scoring import RayRewardComposer

        return RayRewardComposer([as_reward_spec(s) for s in specs], on_error=on_error, num_workers=workers,
                                 factory=partial(local_reward_composer, defaults=defaults))
    return local_reward_composer(specs, on_error=on_error, defaults=defaults)


def routed_reward_composer(routes: RewardRoutes | dict, *, on_error: str = "raise",
                           defaults: dict[str, Any] | None = None, workers: int = 0) -> RoutedRewardComposer:
    """Reward lists routed by a record column (:class:`~tether.rewards.routing.RoutedRewardComposer`), each route's
    list built as :func:`reward_composer` builds one."""
    routes = routes if isinstance(routes, RewardRoutes) else RewardRoutes.model_validate(routes)
    composers = {kind: reward_composer(route.rewards, on_error=on_error, defaults=defaults, workers=workers)
                 for kind, route in routes.routes.items()}
    return RoutedRewardComposer(composers, by=routes.by,
                                answer_only=[kind for kind, route in routes.routes.items() if route.answer_only])


# ---- the scorer ----------------------------------------------------------------------------------------


def corpus_columns(records: Sequence[dict]) -> dict[str, list]:
    """Columns every record has (``answer``, say), passed to reward functions as keyword lists."""
    keys = set.intersection(*(set(r) for r in records)) - set(NOT_COLUMNS) if records else set()
    return {k: [r[k] for r in records] for k in sorted(keys) if "/" not in k}


class Scorer:
    """A :class:`~tether.config.ScorerConfig`, built: one score per completion (None where there is none).

    ``reward_functions`` (plain callables or specs) or ``judge`` (a judge object) replace what the config
    names, as the Python API allows; ``policy`` / ``tokenizer`` serve a ``policy`` judge (self-rewarding);
    ``defaults``: options for task-aware reward functions (a stage's task).
    """

    def __init__(self, cfg: ScorerConfig | dict | None = None, *, reward_functions: Sequence[Any] | None = None,
                 judge: Any = None, policy: Any = None, tokenizer: Any = None, cache_dir: str | Path | None = None,
                 log_dir: str | Path | None = None, defaults: dict[str, Any] | None = None) -> None:
        cfg = cfg if isinstance(cfg, ScorerConfig) else ScorerConfig.model_validate(cfg or {})
        self.label = cfg.label
        self.judge, self.rewards, self._owns_judge = judge, None, False
        if judge is None and reward_functions is None and cfg.kind == "judge":
            self.judge = build_judge(cfg.judge, policy=policy, tokenizer=tokenizer, cache_dir=cache_dir,
                                     log_dir=log_dir)
            self._owns_judge = True
        elif judge is None:
            if reward_functions is not None:
                specs: list[Any] = list(reward_functions)
            elif cfg.kind == "reward_model":
                specs = [RewardSpec("reward_model", kwargs={"path": cfg.path, "batch_size": cfg.batch_size})]
            else:
                specs = list(cfg.rewards)
            self.rewards = local_reward_composer(specs, defaults=defaults)

    def __call__(self, prompts: Sequence[Any], completions: Sequence[str], columns: dict[str, list] | None = None
                 ) -> list[float | None]:
        """Scores of single completions (a pairwise judge cannot score one alone)."""
        if self.rewards is not None:
            total = self.rewards.score(list(prompts), list(completions), columns).total
            return [None if v != v else float(v) for v in total.tolist()]  # NaN -> None
        if isinstance(self.judge, PairwiseJudge):
            raise ValueError("a pairwise judge compares two responses; score single ones with a pointwise judge")
        return self.judge.score(list(prompts), list(completions))

    def score_records(self, records: Sequence[dict]) -> list[float | None]:
        """Scores of corpus records (``prompt``, ``completion`` and their other columns)."""
        if not records:
            return []
        return self([r["prompt"] for r in records], [r["completion"] for r in records], corpus_columns(records))

    @property
    def pairwise(self) -> bool:
        """Whether :meth:`score_groups` returns mean win probabilities (a pairwise judge) rather than scores."""
        return self.rewards is None and isinstance(self.judge, PairwiseJudge)

    def score_groups(self, prompts: list[str], questions: list[str], completions: list[str],
                     columns: dict[str, list], k: int) -> tuple[list[float | None], dict[str, float]]:
        """Scores of ``k`` samples per prompt (groups contiguous) and the judge's figures. Reward functions see
        ``prompts`` (templated); a judge sees ``questions`` (the bare problems). A pairwise judge compares all
        k(k-1)/2 pairs of a group and scores each sample by its mean win probability (a Borda count)."""
        if self.rewards is not None:
            return self(prompts, completions, columns), {}
        if not isinstance(self.judge, PairwiseJudge):
            return self.judge.score(questions, completions), self.judge.take_metrics()
        pairs = [(g * k + i, g * k + j) for g in range(len(completions) // k) for i in range(k) for j in range(i + 1, k)]
        verdicts = self.judge.compare([questions[a] for a, _ in pairs], [completions[a] for a, _ in pairs],
                                      [completions[b] for _, b in pairs])
        scores: list[float | None] = []
        for g in range(len(completions) // k):
            group = {(a - g * k, b - g * k): v for (a, b), v in zip(pairs, verdicts, strict=True) if a // k == g}
            scores.extend(pairwise_scores(k, group))
        return scores, self.judge.take_metrics()

    def close(self) -> None:
        """Stop what this scorer started (a judge's server)."""
        if self.judge is not None and self._owns_judge:
            self.judge.close()


RecordScorer = Callable[[Sequence[dict]], list[float | None]]


def build_scorer(cfg: ScorerConfig | dict | Scorer | RecordScorer, **options: Any) -> RecordScorer:
    """A function from corpus records to their scores (:meth:`Scorer.score_records`), from a scorer config or
    a built :class:`Scorer`; a function of records is returned as it is. A judge it starts stops at exit."""
    if isinstance(cfg, Scorer):
        return cfg.score_records
    if callable(cfg):
        return cfg
    cfg = cfg if isinstance(cfg, ScorerConfig) else ScorerConfig.model_validate(cfg)
    if cfg.kind == "judge" and cfg.judge.kind != "pointwise":
        raise ValueError("a scorer of records scores one sample at a time: use a pointwise judge (judge.kind: pointwise)")
    scorer = Scorer(cfg, **options)
    atexit.register(scorer.close)
    return scorer.score_records
