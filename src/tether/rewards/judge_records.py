"""Synthetic judgments with known verdicts, to train a small judge (a generative reward model): the judge reads
the response, works the problem out itself (``solve_first``; in the letter digits A-J with ``letters``), checks
the response's answer (:func:`answer_check`), its whole worked solution (:func:`steps_check`) or works the answer
back (:func:`inverse_check`), then gives its score or verdict in the judge template's format. ``judge_records``
builds them from the task's correctness pairs, ``sample_judge_records`` from a policy's own verifier-scored
samples. The judges that read these replies are in :mod:`tether.rewards.judge`."""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from typing import Any, Literal

from tether.core.text_metrics import FROM_LETTERS, LETTER_DIGITS, TO_LETTERS
from tether.rewards.judge import format_number, load_template, render_template


def answer_check(own: str, seen: str) -> str:
    """The judge's check of an answer ``seen`` against its ``own``, digit by digit from the left, then the
    mark: ``"8/8= 8/9x wrong"``. Each digit pair is written before its sign (``=`` same, ``x`` different;
    ``_`` pads the shorter), so every sign depends only on the two characters just before it and the mark
    only on the signs: a comparison a small model can learn, where one mark after both whole numbers is not.
    ``own`` may be written in the letter digits (``"BDC"`` is 132): a letter equals the digit it stands for."""
    digits, _ = _digit_marks(own, seen)
    return f"{digits} {'right' if own.translate(FROM_LETTERS) == seen else 'wrong'}"


def _digit_marks(own: Sequence[str], seen: Sequence[str]) -> tuple[str, bool]:
    """``own`` and ``seen`` paired in order (``_`` pads the shorter), each pair written before its sign:
    ``"B/1= D/3= C/3x"``; and whether every pair is the same (a letter equals the digit it stands for)."""
    pairs = [(o, s, o.translate(FROM_LETTERS) == s) for o, s in itertools.zip_longest(own, seen, fillvalue="_")]
    return " ".join(f"{o}/{s}{'=' if same else 'x'}" for o, s, same in pairs), all(same for *_, same in pairs)


def _work_groups(text: str) -> list[str]:
    """A worked solution's steps and answer, ``["7+5=12 c1", "4+8+1=13 c1", "132"]`` for
    ``<think>7+5=12 c1|4+8+1=13 c1|</think>132``; a text without ``</think>`` is one group (a bare answer)."""
    from tether.tasks.base import THINK_CLOSE, THINK_OPEN
    from tether.tasks.preferences import completion_steps

    if THINK_CLOSE not in text:
        return [text]
    head, answer = text.split(THINK_CLOSE, 1)
    return [*completion_steps(head.strip().removeprefix(THINK_OPEN)), answer]


def steps_check(own: str, seen: str) -> str:
    """The judge's check of a whole worked solution ``seen`` against its ``own``, step by step and digit by
    digit: for each step (then the answer) the digits of the two are paired in order and marked as in
    :func:`answer_check` (``=`` same, ``x`` different, ``_`` pads the shorter; a step missing on one side, or
    one without digits, is ``_/_x``), steps divided by ``|``, then the mark: right only with no ``x``. For
    ``47+85=`` with the answer right but the first column miscounted::

        H/7= F/5= B/1= B/1x B/1=|E/4= I/8= B/1= B/1= D/3= B/1=|B/1= D/3= C/2= wrong

    The judge analogue of the ``worked_solution`` checker (``tether.rewards.verifiers``): a right answer reached
    through a wrong step is wrong, where :func:`answer_check` passes it (7.5% of the right answers of
    ``online-dpo-arithmetic``'s SFT model at temperature 0.3, each with a wrong digit in a step). Each mark
    depends only on the two characters just before it, a comparison a small model can learn; only the digits
    of a step are compared. ``own`` may be in the letter digits (a letter equals the digit it stands for)."""
    groups, right = [], True
    for mine, theirs in itertools.zip_longest(_work_groups(own), _work_groups(seen), fillvalue=""):
        marks, same = _digit_marks([c for c in mine if c.isdigit() or c in LETTER_DIGITS],
                                   [c for c in theirs if c.isdigit()])
        right = right and bool(marks) and same
        groups.append(marks or "_/_x")
    return f"{'|'.join(groups)} {'right' if right else 'wrong'}"


def inverse_check(task: Any, prompt: str, seen: str) -> str:
    """The judge's work on an answer ``seen`` by the task's inverse check (``task.check``) instead of solving:
    ``Answer:85 <think>5+7=12 c1|8+4+1=13 c1|</think>132 1/1= 3/3= 2/2= right`` for ``132-47=`` (85 plus 47,
    column by column, gives 132, compared digit by digit with the prompt's 132). A judge that checks this way
    can be right about answers it could not produce itself (Yuan et al.'s self-rewarding needs a judge at
    least as good as the policy). An answer that is not a number is marked ``not a number wrong``."""
    from tether.tasks.base import THINK_CLOSE, THINK_OPEN

    checked = task.check(prompt, seen)
    if checked is None:
        return f"Answer:{seen} not a number wrong"
    steps, result, target = checked
    return f"Answer:{seen} {THINK_OPEN}{steps}{THINK_CLOSE}{result} {answer_check(target, result)}"


def pointwise_reply(task: Any, prompt: str, seen: str, value: float, *, check: str = "solve",
                    work: str | None = None, letters: bool = False, response: str | None = None) -> str:
    """A pointwise judge's reply on the answer ``seen``: the bare score; with the judge's own ``work``
    (``<think>worked solution</think>answer``) the answer read, that work, the digit check against its answer
    and the score (``Answer:133 <think>...</think>132 1/1= 3/3= 2/3x wrong Score: 0``); with ``check="inverse"``
    the :func:`inverse_check` of ``seen`` and the score; with ``check="steps"`` its work, the
    :func:`steps_check` of the whole ``response`` and the score. ``letters``: the judge's work is written in the
    letter digits A-J (``<think>H+F=BC cB|E+I+B=BD cB|</think>BDC B/1= D/3= C/3x wrong``), so that learning to
    judge does not teach the digit-written answers a policy gives (see ``judge_records``)."""
    from tether.tasks.base import extract_answer

    if check == "inverse":
        return f"{inverse_check(task, prompt, seen)} Score: {format_number(value)}"
    if work is None:
        return format_number(value)
    if letters:
        work = work.translate(TO_LETTERS)
    if check == "steps":
        return f"{work} {steps_check(work, response if response is not None else seen)} Score: {format_number(value)}"
    return f"Answer:{seen} {work} {answer_check(extract_answer(work), seen)} Score: {format_number(value)}"


def _scored(check: str, work: str | None, response: str, right: bool, scale: tuple[float, float]) -> float:
    """The score of a judge record: by the step check for ``check="steps"`` (a right answer through a wrong
    step is wrong), else ``right`` (the answer's verdict)."""
    if check == "steps" and work is not None:
        right = steps_check(work, response).endswith(" right")
    return scale[1] if right else scale[0]


def wrong_step(completion: str, rng: random.Random) -> str:
    """``completion`` with one digit of its ``<think>`` steps changed and its answer kept: a right answer
    reached through a wrong step, the error ``steps_check`` exists to catch."""
    from tether.tasks.base import THINK_CLOSE

    head, answer = completion.split(THINK_CLOSE, 1)
    places = [i for i, c in enumerate(head) if c.isdigit()]
    i = rng.choice(places)
    digit = rng.choice([d for d in "0123456789" if d != head[i]])
    return f"{head[:i]}{digit}{head[i + 1:]}{THINK_CLOSE}{answer}"


def _check_judge_task(task: Any, solve_first: bool, check: str, kind: str, letters: bool = False) -> None:
    if letters and not (solve_first and check in ("solve", "steps") and kind == "pointwise"):
        raise ValueError("work in letters is the pointwise judge's own solution: it needs kind pointwise, "
                         "solve_first and check 'solve' or 'steps'")
    if check not in ("solve", "inverse", "steps"):
        raise ValueError(f"check must be 'solve', 'inverse' or 'steps', got {check!r}")
    if check in ("inverse", "steps") and kind != "pointwise":
        raise ValueError(f"check {check!r} judge records are pointwise (each response is checked on its own)")
    if check == "steps" and not solve_first:
        raise ValueError("check 'steps' compares the response's steps with the judge's own: it needs solve_first")
    if check == "inverse" and not (solve_first and hasattr(task, "check")):
        raise ValueError(f"check 'inverse' needs solve_first and a task with an inverse check (check(prompt, "
                         f"answer)); {getattr(task, 'name', task)!r} has none")


def _another_wrong(correct: str, wrong: str, rng: random.Random) -> str | None:
    """An integer answer that is neither ``correct`` nor ``wrong`` (None when the answers are not integers)."""
    if not (correct.isdigit() and wrong.lstrip("-").isdigit()):
        return None
    choices = [int(correct) + d for d in (-10, -2, 2, 10) if int(correct) + d >= 0 and str(int(correct) + d) != wrong]
    return str(rng.choice(choices))


def sample_judge_records(task: Any, samples: Sequence[tuple[str, str, str]], *, template: str,
                         scale: tuple[float, float] = (0.0, 1.0), solve_first: bool = False,
                         check: str = "solve", letters: bool = False, answers_only: bool = False) -> list[dict]:
    """Pointwise judge records from a policy's own ``(prompt, response, gold answer)`` samples, each scored by
    the task's verifier (``scale[1]`` right, ``scale[0]`` wrong): the judge learns the errors the policy it will
    judge makes, which synthetic negatives may miss. With ``solve_first`` the reply is
    ``Answer:<seen> <think>the task's worked solution</think><answer> <digit check> Score: N`` as in
    :func:`judge_records` (the task needs ``solve(prompt)``); ``check="inverse"``: :func:`inverse_check`;
    ``check="steps"``: :func:`steps_check`, and the score is the step check's (a right answer through a wrong
    step scores ``scale[0]``); ``letters``: the judge's work in the letter digits (:func:`pointwise_reply`);
    ``answers_only``: the judge prompt shows each response's final answer, as a judge with ``answer_only`` sees
    it (:func:`tether.rewards.routing.final_answer`)."""
    from tether.rewards.routing import final_answer
    from tether.tasks.base import extract_answer, format_completion

    _check_judge_task(task, solve_first, check, "pointwise", letters)
    template_text = load_template(template)
    solve = getattr(task, "solve", None)
    if solve_first and solve is None:
        raise ValueError("solve_first judge records need a task that can solve its prompts (solve(prompt))")
    out = []
    for prompt, response, answer in samples:
        seen = extract_answer(response)
        work = None
        if solve_first and check in ("solve", "steps"):
            work = format_completion(solve(prompt), think=True)
        value = _scored(check, work, response, task.verify(response, answer) == 1.0, scale)
        shown = final_answer(response) if answers_only else response
        out.append({"prompt": render_template(template_text, prompt=prompt, response=shown, scale=scale),
                    "completion": pointwise_reply(task, prompt, seen, value, check=check, work=work,
                                                  letters=letters, response=response)})
    return out


def judge_records(task: Any, n: int, *, kind: Literal["pointwise", "pairwise"], template: str, seed: int = 0,
                  split: str = "train", errors: Sequence[str] | None = None,
                  scale: tuple[float, float] = (0.0, 1.0), solve_first: bool = False, ties: float = 0.0,
                  answers_only: bool = False, check: str = "solve", letters: bool = False) -> list[dict]:
    """``n`` SFT records ``{prompt: judge prompt, completion: verdict}`` whose verdicts are known exactly.

    Built from ``tether.tasks.preferences`` correctness pairs. Pairwise: the correct completion is
    shown as A in half the records and as B in the other half (so no position is favoured), the
    verdict is the bare letter. Pointwise: the correct and the wrong completion of a pair each make a
    record, scored ``scale[1]`` and ``scale[0]``.

    ``solve_first``: a reference-guided judge (Zheng et al. 2023, Sec. 3.4) that reasons before its
    verdict: it reads off each response's answer, works the problem out itself, checks each answer against
    its own digit by digit (:func:`answer_check`), then gives the verdict: ``A:133 B:132
    <think>...</think>132 A 1/1= 3/3= 2/3x wrong B 1/1= 3/3= 2/2= right [[B]]`` (pointwise
    ``Answer:133 <think>...</think>132 1/1= 3/3= 2/3x wrong Score: 0``). Its verdict is a comparison of
    answers, each step one a small model can learn, not a re-check of every step of a trace. The answers
    are read first, while the only ``</think>`` in sight are the responses' (read after its own work, a
    small judge copies its own answer instead).

    ``ties`` (pairwise, with ``solve_first``): the share of records whose verdict is a tie, ``[[C]]``:
    half show the correct completion twice, half two different wrong answers, so the judge learns to
    decide only where exactly one response agrees with its own answer.

    ``answers_only``: the judged responses are the completions' final answers, not their worked traces (the
    judge of a policy that answers directly); the judge's own work is unchanged.

    ``check="inverse"`` (pointwise, with ``solve_first``): the judge does not solve the problem but checks each
    answer by the task's inverse operation (:func:`inverse_check`), where checking is easier than answering.

    ``check="steps"`` (pointwise, with ``solve_first``): the judge checks the whole worked solution against its
    own, every step and the answer (:func:`steps_check`), so a right answer reached through a wrong step is
    wrong; every third pair's wrong completion is such a one (the chosen trace with one step digit changed).

    ``letters`` (pointwise, with ``solve_first``): the judge works the problem out in the letter digits A-J and
    compares that answer with the response's digits (:func:`pointwise_reply`). The worked solution is then not
    a demonstration of the digit-written answer, so a model trained to judge this way and to answer (self-
    rewarding's seed model) does not learn to answer from its judge training: its judging can stay ahead of
    its answering, the room self-rewarding learns from.
    """
    from tether.tasks.base import THINK_CLOSE, extract_answer
    from tether.tasks.preferences import ERRORS, preference_records

    if not 0.0 <= ties < 1.0:
        raise ValueError(f"ties must be in [0, 1), got {ties}")
    _check_judge_task(task, solve_first, check, kind, letters)
    template_text = load_template(template)
    pairs = preference_records(task, n if kind == "pairwise" else (n + 1) // 2, seed=seed, split=split,
                               errors=errors or ERRORS)
    rng = random.Random(f"judge-records:{seed}:{split}")
    out = []
    for i, pair in enumerate(pairs):
        own = extract_answer(pair["chosen"])
        if kind == "pairwise":
            first = i % 2 == 0
            a, b = (pair["chosen"], pair["rejected"]) if first else (pair["rejected"], pair["chosen"])
            verdict = "A" if first else "B"
            if solve_first and ties and rng.random() < ties:
                other = _another_wrong(own, extract_answer(pair["rejected"]), rng)
                if i % 4 < 2 or other is None:
                    a = b = pair["chosen"]
                else:
                    a, b = pair["rejected"], pair["chosen"].rsplit(THINK_CLOSE, 1)[0] + THINK_CLOSE + other
                verdict = "C"
            if answers_only:
                a, b = extract_answer(a), extract_answer(b)
            reply = verdict
            if solve_first:
                seen_a, seen_b = extract_answer(a), extract_answer(b)
                reply = (f"A:{seen_a} B:{seen_b} {pair['chosen']} A {answer_check(own, seen_a)} "
                         f"B {answer_check(own, seen_b)} [[{verdict}]]")
            out.append({"prompt": render_template(template_text, prompt=pair["prompt"], response_a=a, response_b=b),
                        "completion": reply})
            continue
        rejected = pair["rejected"]
        if check == "steps" and i % 3 == 2:
            rejected = wrong_step(pair["chosen"], rng)
        for response, right in ((pair["chosen"], True), (rejected, False)):
            seen = extract_answer(response)
            work = pair["chosen"] if solve_first else None
            value = _scored(check, work, response, right, scale)
            response = seen if answers_only else response
            reply = pointwise_reply(task, pair["prompt"], seen, value, check=check, work=work, letters=letters,
                                    response=response)
            out.append({"prompt": render_template(template_text, prompt=pair["prompt"], response=response,
                                                  scale=scale),
                        "completion": reply})
    if kind == "pointwise":
        rng.shuffle(out)
    return out[:n]
