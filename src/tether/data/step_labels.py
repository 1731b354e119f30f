"""Step labels for a process reward model from a policy's own samples, checked against a reference trace.

Math-Shepherd (Wang et al. 2024) labels a step good when the solution can still be completed from it,
and trains the PRM on the policy's own solutions rather than on synthetic mistakes, so it sees the
errors the policy makes. For a task whose worked solution is canonical (each step determined by the
problem and the steps before it, as in tether's arithmetic traces) that label is exact without rollouts:
a sampled step is good while it equals the reference trace's step at the same place, and every step
from the first that differs is wrong (labels ``1 ... 1 0 ... 0``). A trace that stops before the
reference does (every step it has right, but no answer) gets its last step labelled 0: it ended
where the solution goes on, and a process model reads a finished trace's last step at eos
(:func:`tether.data.tokenize.step_sequence`), so it can learn that. Steps are the completion cut at the
separator, blank pieces dropped (:func:`tether.data.tokenize.split_steps`), as the scorer cuts them.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from tether.data.schemas import DataError
from tether.data.tokenize import split_steps


def reference_step_labels(completion: str, reference: str, separator: str) -> tuple[list[str], list[int]]:
    """``completion``'s steps and their labels against ``reference`` (see the module docstring)."""
    steps, labels, _ = _labelled(completion, reference, separator)
    return steps, labels


def _labelled(completion: str, reference: str, separator: str) -> tuple[list[str], list[int], str]:
    """Steps, labels, and how the trace went: ``correct``, ``wrong`` (a step differs) or ``stopped``."""
    steps, expected = split_steps(completion, separator), split_steps(reference, separator)
    first_wrong = next((k for k, step in enumerate(steps) if k >= len(expected) or step != expected[k]), len(steps))
    labels = [int(k < first_wrong) for k in range(len(steps))]
    if first_wrong < len(steps):
        return steps, labels, "wrong"
    if len(steps) < len(expected):
        return steps, [*labels[:-1], 0], "stopped"
    return steps, labels, "correct"


def step_label_records(corpus: Sequence[Mapping], references: Mapping[str, str], *, separator: str,
                       dedupe: bool = True, cut_fraction: float = 0.0, seed: int = 0
                       ) -> tuple[list[dict], dict[str, int]]:
    """Corpus samples ``{prompt, completion}`` -> stepwise records ``{prompt, steps, labels}``.

    ``references`` maps each prompt to its reference completion; a sample of a prompt without one is
    an error (the corpus and the references come from different problems). With ``dedupe`` a prompt's
    identical samples give one record. Returns ``(records, stats)``: ``samples``, ``records``,
    ``correct`` (every step right), ``wrong`` (a step differs), ``stopped`` (right so far, but ended
    early), ``duplicates``, ``empty`` (no step) and ``cut`` counts.

    ``cut_fraction``: that share of the records (drawn with ``seed``) is added again cut after a random
    step before its last, labelled as a trace that ends there (a sampled policy rarely stops early, a
    policy optimised against the model can learn to; the cut copy teaches the model that ending there is
    wrong).
    """
    if not 0.0 <= cut_fraction <= 1.0:
        raise ValueError(f"cut_fraction must be in [0, 1], got {cut_fraction}")
    rng = random.Random(f"step-labels:{seed}")
    stats = {"samples": len(corpus), "records": 0, "correct": 0, "wrong": 0, "stopped": 0, "duplicates": 0,
             "empty": 0, "cut": 0}
    records, seen = [], set()
    for row, sample in enumerate(corpus, start=1):
        prompt, completion = sample.get("prompt"), sample.get("completion")
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise DataError(f"sample {row}: step labels need text 'prompt' and 'completion' fields", row=row)
        if prompt not in references:
            raise DataError(f"sample {row}: prompt {prompt!r} is not one of the reference problems; sample the "
                            "corpus from the same task, split, n and seed as the references", row=row)
        if dedupe and (prompt, completion) in seen:
            stats["duplicates"] += 1
            continue
        seen.add((prompt, completion))
        steps, labels, kind = _labelled(completion, references[prompt], separator)
        if not steps:
            stats["empty"] += 1
            continue
        stats[kind] += 1
        records.append({"prompt": prompt, "steps": steps, "labels": labels})
        if len(steps) > 1 and rng.random() < cut_fraction:
            cut = separator.join(steps[:rng.randrange(1, len(steps))])
            steps, labels, _ = _labelled(cut, references[prompt], separator)
            records.append({"prompt": prompt, "steps": steps, "labels": labels})
            stats["cut"] += 1
    stats["records"] = len(records)
    return records, stats
