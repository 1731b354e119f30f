"""Step-level preference pairs (Step-DPO): a trace pair cut down to the first wrong step.

Lai et al. 2024, "Step-DPO: Step-wise Preference Optimization for Long-chain Reasoning of LLMs", Sec. 3:
given a problem x and a trace whose steps s_1..s_{k-1} are right and s_k is the first wrong one, the pair
is ``(prompt = x + s_1..s_{k-1}, chosen = a correct s_k, rejected = the wrong s_k)``, and DPO is applied
to that step alone. :func:`step_pairs` builds such pairs from sequence-level ``{prompt, chosen,
rejected}`` records whose chosen trace is correct:

- the first wrong step of the rejected trace is found by ``first_wrong(prompt, steps)`` (a process
  reward model's first step scored below a threshold, or a task's step checker), or, without one, as
  the first step where the rejected trace leaves the chosen one (exact when the chosen trace is a
  verified solution and the rejected one shares its steps up to the error, as the synthetic pairs do);
- the chosen step is the chosen trace's step at the same index, which continues the same prefix only
  when both traces agree on every earlier step: pairs where they do not are dropped (``prefix_differs``),
  as are pairs with no wrong step found (``no_wrong_step``).

Steps are the completion cut after each ``separator`` (kept with its step, so a middle step's end is its
separator); a middle step carries ``chosen_partial`` / ``rejected_partial`` so tokenisation adds no eos
after it, and the last step keeps the eos. Text prompts only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tether.data.schemas import DataError

FirstWrong = Callable[[str, list[str]], "int | None"]


def trace_steps(completion: str, separator: str) -> list[str]:
    """``completion`` cut after each ``separator`` (kept): ``"a|b|c"`` -> ``["a|", "b|", "c"]``; joins back exactly."""
    if not separator:
        raise ValueError("the step separator must be a non-empty string")
    pieces = completion.split(separator)
    steps = [p + separator for p in pieces[:-1]]
    return [*steps, pieces[-1]] if pieces[-1] else steps


def _divergence(chosen: list[str], rejected: list[str]) -> int | None:
    for k, step in enumerate(rejected):
        if k >= len(chosen) or step != chosen[k]:
            return k
    return None


def step_pairs(records: Sequence[dict], *, separator: str, first_wrong: FirstWrong | None = None
               ) -> tuple[list[dict], dict[str, int]]:
    """Sequence-level pairs -> step-level pairs (see the module docstring); returns (pairs, drop counts)."""
    out, stats = [], {"no_wrong_step": 0, "prefix_differs": 0}
    for i, record in enumerate(records):
        prompt, chosen, rejected = record["prompt"], record["chosen"], record["rejected"]
        if not all(isinstance(x, str) for x in (prompt, chosen, rejected)):
            raise DataError(f"record {i + 1}: step-level pairs are built from text pairs; this one holds messages",
                            row=i + 1)
        good, bad = trace_steps(chosen, separator), trace_steps(rejected, separator)
        k = first_wrong(prompt, bad) if first_wrong is not None else _divergence(good, bad)
        if k is None or k >= len(bad):
            stats["no_wrong_step"] += 1
            continue
        if k >= len(good) or good[:k] != bad[:k] or good[k] == bad[k]:
            stats["prefix_differs"] += 1
            continue
        extra = {key: value for key, value in record.items() if key not in ("prompt", "chosen", "rejected")}
        out.append({**extra, "prompt": prompt + "".join(good[:k]), "chosen": good[k], "rejected": bad[k],
                    "chosen_partial": k < len(good) - 1, "rejected_partial": k < len(bad) - 1, "step": k})
    return out, stats
