"""Several reward functions -> one weighted reward per completion, with per-function statistics.

``RewardComposer`` calls each configured function on a batch, checks what it returned, and sums
``total = sum_i w_i * r_i`` over the functions that returned a value for that sample. ``None``
(or a non-finite value) from a function means "no reward from this function for this sample":
it drops out of that sample's sum and out of the statistics. A sample with no value from any
function has ``total`` NaN and ``valid`` False; what to do with it (skip it, count it as zero)
is the trainer's decision, not this module's.

A function with weight 0 still counts toward ``valid``: zero-weight functions are for logging,
and a sample scored only by them is valid with total 0.

"Non-finite" includes values a float32 reward tensor cannot hold (``1e300``, an ``int`` beyond any
float): they would become ``inf`` and poison every advantage of the batch. A weighted sum that
overflows leaves its sample with no reward (``total`` NaN, ``valid`` False) for the same reason.
"""

from __future__ import annotations

import importlib
import inspect
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

from tether.config.rewards import RewardSpec
from tether.rewards.verifiers import REWARD_FUNCTIONS

_SAMPLE_CHARS = 300  # how much of a prompt / completion an error message shows
_RESERVED_LABELS = {"total"}


class RewardFunctionError(RuntimeError):
    """A reward function raised, or broke the protocol (wrong length, wrong value type).

    ``function`` names it; when one sample was to blame, ``index``, ``prompt`` and ``completion``
    hold that sample.
    """

    def __init__(
        self,
        message: str,
        *,
        function: str,
        index: int | None = None,
        prompt: str | None = None,
        completion: str | None = None,
    ) -> None:
        super().__init__(message)
        self.function, self.index, self.prompt, self.completion = function, index, prompt, completion


def _truncate(text: str, limit: int = _SAMPLE_CHARS) -> str:
    return repr(text if len(text) <= limit else text[:limit] + f"... [{len(text) - limit} more chars]")


def resolve_reward_function(spec: str | Callable) -> Callable:
    """A registered reward name, or an import path "package.module:function" / "package.module.function".

    A callable is returned as it is, so the Python API can pass functions directly.
    """
    if callable(spec):
        return spec
    if not isinstance(spec, str) or not spec:
        raise TypeError(f"a reward function is a registered name, an import path or a callable, got {spec!r}")
    if spec in REWARD_FUNCTIONS:
        return REWARD_FUNCTIONS.get(spec)
    module_name, _, attr_path = spec.partition(":") if ":" in spec else spec.rpartition(".")
    if not module_name or not attr_path:
        valid = ", ".join(REWARD_FUNCTIONS.names())
        raise ValueError(
            f"unknown reward function {spec!r}: not a registered name (valid: {valid}) "
            "and not an import path like 'package.module:function'"
        )
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(
            f"reward function {spec!r}: cannot import module {module_name!r} ({error})"
        ) from error
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise ValueError(
                f"reward function {spec!r}: module {module_name!r} has no attribute {attr_path!r}"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"reward function {spec!r} is a {type(obj).__name__}, not a callable")
    return obj


def as_reward_spec(item: RewardSpec | dict | Callable) -> RewardSpec:
    """A reward-list entry as a :class:`~tether.config.RewardSpec`: a spec, its dict, or a plain callable."""
    if isinstance(item, RewardSpec):
        return item
    if isinstance(item, dict):
        return RewardSpec.model_validate(item)
    return RewardSpec(item)


@dataclass
class RewardResult:
    """Rewards for a batch of N completions.

    - ``total``: shape (N,), float; NaN where no function returned a value
    - ``per_function``: label -> shape (N,), float; NaN where that function returned None / non-finite
    - ``valid``: shape (N,), bool; False exactly where ``total`` is NaN
    - ``errors``: label -> number of samples that raised and were scored 0 (``on_error="zero"``)
    - ``nonfinite``: label -> number of NaN / inf values, treated as None
    - ``timeouts``: label -> of the ``errors``, those that were a ``TimeoutError`` (a verifier out of
      time: a score that would depend on the machine's load)
    - ``weights``: each function's weight, in ``per_function`` order (for another aggregation of them)
    """

    total: Tensor
    per_function: dict[str, Tensor]
    valid: Tensor
    errors: dict[str, int]
    nonfinite: dict[str, int]
    timeouts: dict[str, int] = field(default_factory=dict)
    weights: tuple[float, ...] = ()

    def scores(self) -> Tensor:
        """The functions' values stacked, shape (K, N), NaN where a function returned none."""
        return torch.stack(list(self.per_function.values()))

    def metrics(self) -> dict[str, float]:
        """``reward/{label}/{mean,std,none,errors,nonfinite,timeouts}`` and ``reward/total/{mean,std,none}``.

        Means and (population) standard deviations ignore NaN; they are left out, not NaN, when
        no sample has a value. ``none`` counts samples without a value (non-finite ones included).
        """
        metrics: dict[str, float] = {}
        for label, values in [*self.per_function.items(), ("total", self.total)]:
            present = values[~torch.isnan(values)]
            if present.numel():
                metrics[f"reward/{label}/mean"] = present.mean().item()
                metrics[f"reward/{label}/std"] = present.std(correction=0).item()
            metrics[f"reward/{label}/none"] = float(values.numel() - present.numel())
        for label in self.per_function:
            metrics[f"reward/{label}/errors"] = float(self.errors[label])
            metrics[f"reward/{label}/nonfinite"] = float(self.nonfinite[label])
            metrics[f"reward/{label}/timeouts"] = float(self.timeouts.get(label, 0))
        return metrics


@dataclass(frozen=True)
class _Signature:
    """Which dataset columns a reward function can take: all (``**kwargs``) or its named parameters."""

    takes_all: bool
    named: frozenset[str]
    required: frozenset[str]


def _signature(fn: Callable, label: str) -> _Signature:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # builtins and some C callables: pass everything, hope for the best
        return _Signature(True, frozenset(), frozenset())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 2 and not any(p.kind == p.VAR_POSITIONAL for p in params):
        raise TypeError(f"reward function {label!r} must take (prompts, completions, **columns)")
    rest = [
        p for p in params if p not in positional[:2] and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    return _Signature(
        takes_all=any(p.kind == p.VAR_KEYWORD for p in params),
        named=frozenset(p.name for p in rest),
        required=frozenset(p.name for p in rest if p.default is p.empty),
    )


def _labels(specs: list[RewardSpec], fns: list[Callable]) -> list[str]:
    """Metric keys: the configured name (a callable's ``__name__``), made unique with ``_2``, ``_3``..."""
    labels: list[str] = []
    used = set(_RESERVED_LABELS)
    for spec, fn in zip(specs, fns, strict=True):
        base = spec.name if isinstance(spec.name, str) else getattr(fn, "__name__", type(fn).__name__)
        label, k = base, 1
        while label in used:
            k += 1
            label = f"{base}_{k}"
        used.add(label)
        labels.append(label)
    return labels


class RewardComposer:
    """Weighted sum of reward functions; see the module docstring for the combination rule.

    ``on_error="raise"`` (default): a function that raises is re-run one sample at a time to find
    the offending sample, and a ``RewardFunctionError`` names the function and shows that sample.
    ``on_error="zero"``: a sample on which a function raises scores 0 for that function and is
    counted in ``RewardResult.errors``. Protocol violations (wrong length, a value that is not a
    number or None) and missing dataset columns raise in both modes.

    ``defaults``: keyword options given, as a group, to every function that names them and whose spec
    sets none of them (a stage's ``task`` and ``task_options`` reach the task-aware rewards this way; a
    reward naming its own ``task`` keeps its own options too).
    """

    def __init__(
        self,
        specs: Sequence[RewardSpec | dict | Callable],
        *,
        on_error: Literal["raise", "zero"] = "raise",
        defaults: dict[str, Any] | None = None,
    ) -> None:
        if on_error not in ("raise", "zero"):
            raise ValueError(f"on_error must be 'raise' or 'zero', got {on_error!r}")
        if not specs:
            raise ValueError("RewardComposer needs at least one reward function")
        self.specs = [as_reward_spec(s) for s in specs]
        self.on_error = on_error
        self.functions = [resolve_reward_function(s.name) for s in self.specs]
        self.labels = _labels(self.specs, self.functions)
        self._signatures = [
            _signature(fn, label) for fn, label in zip(self.functions, self.labels, strict=True)
        ]
        self.kwargs: list[dict[str, Any]] = []
        for spec, sig, label in zip(self.specs, self._signatures, self.labels, strict=True):
            # Built-ins swallow **columns, so an option typo would vanish silently without this check.
            strict = isinstance(spec.name, str) and spec.name in REWARD_FUNCTIONS
            unknown = set(spec.kwargs) - sig.named
            if unknown and (strict or not sig.takes_all):
                raise ValueError(
                    f"reward {label!r} does not accept option(s) {sorted(unknown)}; "
                    f"it accepts: {sorted(sig.named) or 'none'}"
                )
            given = set(defaults or {}) & set(spec.kwargs)  # the defaults come as a group: a spec naming any keeps its own
            inherited = {} if given else {k: v for k, v in (defaults or {}).items() if k in sig.named}
            self.kwargs.append({**inherited, **spec.kwargs})

    def score(
        self, prompts: list[str], completions: list[str], columns: dict[str, Sequence] | None = None
    ) -> RewardResult:
        """Score N completions; ``columns`` are dataset columns aligned with them (e.g. ``answer``)."""
        n = len(completions)
        if len(prompts) != n:
            raise ValueError(f"got {len(prompts)} prompts for {n} completions")
        columns = dict(columns or {})
        for key, values in columns.items():
            if key in ("prompts", "completions"):
                raise ValueError(
                    f"dataset column {key!r} would shadow the {key} argument of reward functions"
                )
            if len(values) != n:
                raise ValueError(f"dataset column {key!r} has {len(values)} values for {n} completions")
            columns[key] = list(values)
        per_function: dict[str, Tensor] = {}
        errors: dict[str, int] = {}
        nonfinite: dict[str, int] = {}
        timeouts: dict[str, int] = {}
        for i, label in enumerate(self.labels):
            values, errors[label], timeouts[label] = self._call(i, prompts, completions,
                                                                self._columns_for(i, columns))
            per_function[label], nonfinite[label] = _to_tensor(values)
        stacked = torch.stack(list(per_function.values()))  # (F, N)
        present = ~torch.isnan(stacked)
        weights = torch.tensor([s.weight for s in self.specs], dtype=stacked.dtype).unsqueeze(1)
        valid = present.any(dim=0)
        total = torch.where(present, weights * stacked, torch.zeros_like(stacked)).sum(dim=0)
        valid = valid & torch.isfinite(total)  # a weighted sum beyond float32
        total = torch.where(valid, total, torch.full_like(total, math.nan))
        return RewardResult(total, per_function, valid, errors, nonfinite, timeouts,
                            tuple(s.weight for s in self.specs))

    def _columns_for(self, i: int, columns: dict[str, list]) -> dict[str, list]:
        kwargs, sig, label = self.kwargs[i], self._signatures[i], self.labels[i]
        chosen = dict(columns) if sig.takes_all else {k: v for k, v in columns.items() if k in sig.named}
        clash = set(chosen) & set(kwargs)
        if clash:
            raise ValueError(
                f"reward {label!r}: option(s) {sorted(clash)} have the same name as dataset columns"
            )
        missing = sig.required - set(chosen) - set(kwargs)
        if missing:
            raise ValueError(
                f"reward {label!r} needs dataset column(s) {sorted(missing)}; the batch has {sorted(columns) or 'none'}"
            )
        return chosen

    def _call(
        self, i: int, prompts: list[str], completions: list[str], columns: dict[str, list]
    ) -> tuple[list[float | None], int, int]:
        """Run function ``i`` on the batch; on an exception, fall back to one sample at a time. Returns the
        values, the samples that raised and, of those, the timeouts."""
        fn, kwargs, label = self.functions[i], self.kwargs[i], self.labels[i]
        try:
            returned = fn(prompts, completions, **columns, **kwargs)
        except Exception as batch_error:
            return self._call_per_sample(i, prompts, completions, columns, batch_error)
        return _check(label, returned, len(completions), offset=0), 0, 0

    def _call_per_sample(
        self,
        i: int,
        prompts: list[str],
        completions: list[str],
        columns: dict[str, list],
        batch_error: Exception,
    ) -> tuple[list[float | None], int, int]:
        fn, kwargs, label = self.functions[i], self.kwargs[i], self.labels[i]
        values: list[float | None] = []
        errors = timeouts = 0
        for j, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
            try:
                returned = fn([prompt], [completion], **{k: [v[j]] for k, v in columns.items()}, **kwargs)
            except Exception as error:
                if self.on_error == "raise":
                    raise RewardFunctionError(
                        f"reward function {label!r} raised {type(error).__name__}: {error}\n"
                        f"  on sample {j}\n  prompt: {_truncate(prompt)}\n  completion: {_truncate(completion)}",
                        function=label,
                        index=j,
                        prompt=prompt,
                        completion=completion,
                    ) from error
                values.append(0.0)
                errors += 1
                timeouts += isinstance(error, TimeoutError)
                continue
            values.extend(_check(label, returned, 1, offset=j))
        if self.on_error == "raise":
            raise RewardFunctionError(
                f"reward function {label!r} raised {type(batch_error).__name__} on the batch of "
                f"{len(completions)} but on no single sample: {batch_error}",
                function=label,
            ) from batch_error
        return values, errors, timeouts


def _check(label: str, returned: Any, n: int, *, offset: int) -> list[float | None]:
    """Validate a return value against the protocol: a sequence of n numbers-or-None."""
    if hasattr(returned, "tolist") and not isinstance(returned, (str, bytes)):  # a tensor or an array
        returned = returned.tolist()
    if not isinstance(returned, (list, tuple)):
        raise RewardFunctionError(
            f"reward function {label!r} must return a list of float | None, got {type(returned).__name__}",
            function=label,
        )
    if len(returned) != n:
        raise RewardFunctionError(
            f"reward function {label!r} returned {len(returned)} values for {n} completions", function=label
        )
    values: list[float | None] = []
    for j, value in enumerate(returned):
        if value is None:
            values.append(None)
        elif isinstance(value, numbers.Real) or getattr(value, "ndim", None) == 0:
            try:
                values.append(float(value))
            except OverflowError:  # an int beyond any float
                values.append(math.inf)
            except (TypeError, ValueError):  # a 0-d array of strings, say
                raise RewardFunctionError(
                    f"reward function {label!r} returned {type(value).__name__} {value!r:.80} for sample "
                    f"{offset + j}; expected float or None",
                    function=label,
                    index=offset + j,
                ) from None
        else:
            raise RewardFunctionError(
                f"reward function {label!r} returned {type(value).__name__} {value!r:.80} for sample "
                f"{offset + j}; expected float or None",
                function=label,
                index=offset + j,
            )
    return values


_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def _to_tensor(values: list[float | None]) -> tuple[Tensor, int]:
    """Shape (N,) float32 with NaN for None; non-finite values (and those beyond float32) become NaN
    too and are counted."""
    def bad(v: float) -> bool:
        return not math.isfinite(v) or abs(v) > _FLOAT32_MAX

    nonfinite = sum(1 for v in values if v is not None and bad(v))
    tensor = torch.tensor([math.nan if v is None or bad(v) else v for v in values], dtype=torch.float32)
    return tensor, nonfinite
