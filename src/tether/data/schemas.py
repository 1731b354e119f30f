"""Record formats: one name per shape of training row, as written in configs (``format:``).

=================  =======================================================================
format             fields
=================  =======================================================================
text               ``text``: raw text for next-token pre-training
chat               ``messages``: [{role, content}, ...], optional ``tools``
prompt_completion  ``prompt``, ``completion``: both strings (raw text) or both lists of
                   messages (conversational; the TRL convention)
preference         ``prompt`` (optional), ``chosen``, ``rejected``
unpaired           ``prompt``, ``completion``, ``label`` (bool; KTO-style)
prompt_answer      ``prompt``, ``answer``; any extra columns are kept (RL with a checker)
stepwise           ``prompt``, ``steps`` (list of str), ``labels`` (list of bool/int, same length)
ranking            ``prompt``, ``completions`` (K >= 2, best first), optional ``ranks`` (ints, lower
                   is better, equal ranks tie) when the list is not in order or has ties
segments           ``segments``: [{text, loss}, ...], one text in pieces with and without loss (ReAct
                   episodes without a chat template); optional ``eos`` (default true)
=================  =======================================================================

Every validator returns a new, normalised dict and keeps columns it does not know.
Normalisation: ``None``-valued optional columns count as absent (Arrow fills missing keys
with None); ``None``-valued keys inside messages are dropped; ``answer`` becomes a string;
``unpaired.label`` becomes a bool; a preference row with no prompt has it split off (see
``split_implicit_prompt``); ``ranking.ranks`` become dense ranks 0, 1, ... (0 the best, order kept).

Bad rows raise :class:`DataError`, whose message names the source, the 1-based row (or the
line, for jsonl) and the field.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from tether.core.registry import Registry

ROLES = ("system", "user", "assistant", "tool")


class DataError(ValueError):
    """A bad data row or file. ``source``, ``row`` (1-based) and ``field`` say where."""

    def __init__(self, message: str, *, source: str | None = None, row: int | None = None,
                 field: str | None = None) -> None:
        super().__init__(message)
        self.source, self.row, self.field = source, row, field


class _FieldError(Exception):
    """Raised inside a validator; ``validate_records`` adds the source and row."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(problem)
        self.field, self.problem = field, problem


Validator = Callable[[dict], dict]
FORMATS: Registry[Validator] = Registry("record format")


# ---------------------------------------------------------------- field checks


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _present(row: dict, field: str) -> bool:
    return row.get(field) is not None


def _require(row: dict, field: str) -> Any:
    if not _present(row, field):
        raise _FieldError(field, "missing field" if field not in row else "field is null")
    return row[field]


def _encodable(value: str, field: str) -> str:
    """Text a tokenizer can take: a lone surrogate (from a JSON ``\\ud800`` escape or a bad decode)
    would fail deep inside the tokenizer instead."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise _FieldError(field, f"not valid Unicode text ({err.reason} at character {err.start})") from None
    return value


def _text(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise _FieldError(field, f"expected a string, got {_type_name(value)}")
    if not value.strip():
        raise _FieldError(field, "empty text")
    return _encodable(value, field)


def _messages(value: Any, field: str) -> list[dict]:
    """A non-empty list of {role, content} dicts; None-valued keys are dropped."""
    if not isinstance(value, list):
        raise _FieldError(field, f"expected a list of messages, got {_type_name(value)}")
    if not value:
        raise _FieldError(field, "empty list of messages")
    out = []
    for i, message in enumerate(value):
        where = f"{field}[{i}]"
        if not isinstance(message, dict):
            raise _FieldError(where, f"expected a message dict, got {_type_name(message)}")
        message = {k: v for k, v in message.items() if v is not None}
        role = message.get("role")
        if role not in ROLES:
            problem = "missing role" if role is None else f"bad role {role!r}"
            raise _FieldError(f"{where}.role", f"{problem} (valid roles: {', '.join(ROLES)})")
        if "content" not in message:
            if not message.get("tool_calls"):
                raise _FieldError(f"{where}.content", "missing field")
            message["content"] = ""
        elif not isinstance(message["content"], str):
            raise _FieldError(f"{where}.content", f"expected a string, got {_type_name(message['content'])}")
        elif not message["content"].strip() and not message.get("tool_calls"):
            raise _FieldError(f"{where}.content", "empty text")
        else:
            _encodable(message["content"], f"{where}.content")
        out.append(message)
    return out


def _text_or_messages(value: Any, field: str) -> str | list[dict]:
    return _messages(value, field) if isinstance(value, list) else _text(value, field)


def _same_kind(row: dict, fields: Sequence[str]) -> None:
    """Strings and message lists cannot be mixed within one row."""
    kinds = {f: isinstance(row[f], list) for f in fields if _present(row, f)}
    if len(set(kinds.values())) > 1:
        desc = ", ".join(f"{f}={'messages' if k else 'string'}" for f, k in kinds.items())
        raise _FieldError(fields[-1], f"mixes raw strings and message lists ({desc})")


def _completion_messages(messages: list[dict], field: str) -> None:
    if not messages:
        raise _FieldError(field, "no messages left after the prompt")
    if messages[0]["role"] != "assistant":
        raise _FieldError(f"{field}[0].role", f"a completion must start with an assistant message, "
                                               f"got {messages[0]['role']!r}")


def _extras(row: dict, known: Sequence[str]) -> dict:
    return {k: v for k, v in row.items() if k not in known}


# ---------------------------------------------------------------- formats


@FORMATS.register("text")
def _validate_text(row: dict) -> dict:
    """Raw text for pretraining: ``text``."""
    return {"text": _text(_require(row, "text"), "text"), **_extras(row, ["text"])}


@FORMATS.register("segments")
def _validate_segments(row: dict) -> dict:
    """One text in pieces: ``segments``, a list of ``{text, loss}``; SFT trains on the pieces with ``loss``
    (each piece tokenised on its own, after BOS), then on EOS unless ``eos`` is false."""
    value = _require(row, "segments")
    if not isinstance(value, list) or not value:
        raise _FieldError("segments", f"expected a non-empty list of {{text, loss}}, got {_type_name(value)}")
    out = []
    for i, piece in enumerate(value):
        if not isinstance(piece, dict) or not isinstance(piece.get("text"), str) or not isinstance(piece.get("loss"), bool):
            raise _FieldError(f"segments[{i}]", f"expected {{text: str, loss: bool}}, got {piece!r:.80}")
        out.append({"text": piece["text"], "loss": piece["loss"]})
    if not any(piece["loss"] for piece in out):
        raise _FieldError("segments", "no segment has loss: true")
    eos = row.get("eos", True)
    if not isinstance(eos, bool):
        raise _FieldError("eos", f"expected a bool, got {eos!r}")
    return {"segments": out, "eos": eos, **_extras(row, ["segments", "eos"])}


@FORMATS.register("chat")
def _validate_chat(row: dict) -> dict:
    """A conversation: ``messages``, a list of ``{role, content}``."""
    out = {"messages": _messages(_require(row, "messages"), "messages")}
    if _present(row, "tools"):
        tools = row["tools"]
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise _FieldError("tools", f"expected a list of tool schemas (dicts), got {_type_name(tools)}")
        out["tools"] = tools
    return {**out, **_extras(row, ["messages", "tools"])}


def _prompt_completion(row: dict) -> dict:
    prompt = _text_or_messages(_require(row, "prompt"), "prompt")
    completion = _text_or_messages(_require(row, "completion"), "completion")
    _same_kind(row, ["prompt", "completion"])
    if isinstance(completion, list):
        _completion_messages(completion, "completion")
    return {"prompt": prompt, "completion": completion}


@FORMATS.register("prompt_completion")
def _validate_prompt_completion(row: dict) -> dict:
    """A prompt and its completion (strings, or message lists for the chat template)."""
    return {**_prompt_completion(row), **_extras(row, ["prompt", "completion"])}


@FORMATS.register("unpaired")
def _validate_unpaired(row: dict) -> dict:
    """KTO's unpaired records: ``prompt``, ``completion`` and a boolean ``label``."""
    out = _prompt_completion(row)
    label = _require(row, "label")
    if isinstance(label, int) and label in (0, 1):  # bool is an int too
        label = bool(label)
    else:
        raise _FieldError("label", f"expected a bool, got {label!r}")
    return {**out, "label": label, **_extras(row, ["prompt", "completion", "label"])}


@FORMATS.register("prompt_answer")
def _validate_prompt_answer(row: dict) -> dict:
    """RL prompts with their reference ``answer``; extra columns kept."""
    prompt = _text_or_messages(_require(row, "prompt"), "prompt")
    answer = _require(row, "answer")
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
        raise _FieldError("answer", f"expected a string or number, got {_type_name(answer)}")
    answer = str(answer)
    if not answer.strip():
        raise _FieldError("answer", "empty text")
    return {"prompt": prompt, "answer": answer, **_extras(row, ["prompt", "answer"])}


@FORMATS.register("prompt")
def _validate_prompt(row: dict) -> dict:
    """Prompts alone (generation, or RL scored by a reward model / judge); extra columns kept."""
    prompt = _text_or_messages(_require(row, "prompt"), "prompt")
    return {"prompt": prompt, **_extras(row, ["prompt"])}


@FORMATS.register("stepwise")
def _validate_stepwise(row: dict) -> dict:
    """Process-reward records: ``prompt``, ``steps`` and one boolean label per step."""
    prompt = _text_or_messages(_require(row, "prompt"), "prompt")
    steps, labels = _require(row, "steps"), _require(row, "labels")
    if not isinstance(steps, list) or not steps:
        raise _FieldError("steps", f"expected a non-empty list of strings, got {steps!r:.60}")
    for i, step in enumerate(steps):
        _text(step, f"steps[{i}]")
    if not isinstance(labels, list):
        raise _FieldError("labels", f"expected a list of bool/int, got {_type_name(labels)}")
    for i, label in enumerate(labels):
        if not isinstance(label, int):
            raise _FieldError(f"labels[{i}]", f"expected a bool or int, got {_type_name(label)}")
    if len(labels) != len(steps):
        raise _FieldError("labels", f"length {len(labels)} does not match steps length {len(steps)}")
    return {"prompt": prompt, "steps": steps, "labels": labels, **_extras(row, ["prompt", "steps", "labels"])}


@FORMATS.register("preference")
def _validate_preference(row: dict) -> dict:
    """Preference pairs: ``chosen`` and ``rejected``, with ``prompt`` or a shared prefix."""
    chosen = _text_or_messages(_require(row, "chosen"), "chosen")
    rejected = _text_or_messages(_require(row, "rejected"), "rejected")
    _same_kind(row, ["prompt", "chosen", "rejected"])
    if _present(row, "prompt"):
        prompt = _text_or_messages(row["prompt"], "prompt")
    else:
        prompt, chosen, rejected = split_implicit_prompt(chosen, rejected)
    if isinstance(chosen, list):
        _completion_messages(chosen, "chosen")
        _completion_messages(rejected, "rejected")
    else:
        _text(chosen, "chosen")
        _text(rejected, "rejected")
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected,
            **_extras(row, ["prompt", "chosen", "rejected"])}


@FORMATS.register("ranking")
def _validate_ranking(row: dict) -> dict:
    """K >= 2 distinct completions of one prompt, best first, or ordered by ``ranks``."""
    prompt = _text_or_messages(_require(row, "prompt"), "prompt")
    completions = _require(row, "completions")
    if not isinstance(completions, list) or len(completions) < 2:
        got = f"a list of {len(completions)}" if isinstance(completions, list) else _type_name(completions)
        raise _FieldError("completions", f"expected a list of at least 2 completions (best first), got {got}")
    kind = "a list of messages" if isinstance(prompt, list) else "a string"
    out: list[Any] = []
    for i, completion in enumerate(completions):
        where = f"completions[{i}]"
        if isinstance(completion, list) != isinstance(prompt, list):
            raise _FieldError(where, f"expected {kind} like the prompt, got {_type_name(completion)}")
        completion = _text_or_messages(completion, where)
        if isinstance(completion, list):
            _completion_messages(completion, where)
        if completion in out:
            raise _FieldError(where, f"duplicates completions[{out.index(completion)}]; list each answer once "
                                     "(tie different answers with equal 'ranks')")
        out.append(completion)
    normalised = {"prompt": prompt, "completions": out}
    if _present(row, "ranks"):
        normalised["ranks"] = _dense_ranks(row["ranks"], len(out))
    return {**normalised, **_extras(row, ["prompt", "completions", "ranks"])}


def _dense_ranks(ranks: Any, k: int) -> list[int]:
    if not isinstance(ranks, list) or len(ranks) != k:
        got = f"length {len(ranks)}" if isinstance(ranks, list) else _type_name(ranks)
        raise _FieldError("ranks", f"expected a list of {k} ints (one per completion, lower is better), got {got}")
    for i, rank in enumerate(ranks):
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise _FieldError(f"ranks[{i}]", f"expected an int rank (lower is better), got {_type_name(rank)}")
    levels = sorted(set(ranks))
    if len(levels) < 2:
        raise _FieldError("ranks", "every completion has the same rank, so there is no pair to learn from; "
                                   "give the better ones lower ranks")
    return [levels.index(r) for r in ranks]


# ---------------------------------------------------------------- implicit prompts

_WORD = re.compile(r"\w")


def split_implicit_prompt(chosen: str | list[dict], rejected: str | list[dict]) -> tuple[Any, Any, Any]:
    """Split a shared prompt off a preference pair given without one: ``(prompt, chosen, rejected)``.

    Message lists: the prompt is everything before the *last* assistant message of ``chosen``,
    and ``rejected`` must start with exactly those messages.

    Strings: the longest common prefix, moved back so it never ends inside a word or number
    (``"12+3=15"`` / ``"12+3=16"`` gives prompt ``"12+3="``, not ``"12+3=1"``); whitespace at
    the boundary goes to the responses, as TRL's ``extract_prompt`` does
    (``"The answer is four"`` -> prompt ``"The answer is"``, chosen ``" four"``).
    """
    if isinstance(chosen, list):
        last = max((i for i, m in enumerate(chosen) if m["role"] == "assistant"), default=None)
        if last is None:
            raise _FieldError("chosen", "no assistant message to split the implicit prompt at")
        if last == 0:
            raise _FieldError("chosen", "no prompt before the last assistant message; add a 'prompt' field")
        if rejected[:last] != chosen[:last]:
            raise _FieldError("rejected", f"does not share the implicit prompt (the first {last} messages "
                                          "of chosen); add a 'prompt' field")
        return chosen[:last], chosen[last:], rejected[last:]
    n = 0
    for a, b in zip(chosen, rejected, strict=False):
        if a != b:
            break
        n += 1
    if n == len(chosen) or n == len(rejected):
        raise _FieldError("rejected", "one of chosen/rejected is a prefix of the other; add a 'prompt' field")
    while n > 0 and _WORD.match(chosen[n - 1]) and (_WORD.match(chosen[n]) or _WORD.match(rejected[n])):
        n -= 1
    if n > 0 and chosen[n - 1].isspace():
        n -= 1
    if not chosen[:n].strip():
        raise _FieldError("prompt", "chosen and rejected share no common prefix to use as the prompt; "
                                    "add a 'prompt' field")
    return chosen[:n], chosen[n:], rejected[n:]


# ---------------------------------------------------------------- detection and validation

# Most specific first: a row with prompt + completion + label is unpaired, not prompt_completion.
_SIGNATURES: list[tuple[str, tuple[str, ...]]] = [
    ("preference", ("chosen", "rejected")),
    ("stepwise", ("steps", "labels")),
    ("ranking", ("prompt", "completions")),
    ("unpaired", ("prompt", "completion", "label")),
    ("prompt_completion", ("prompt", "completion")),
    ("chat", ("messages",)),
    ("segments", ("segments",)),
    ("prompt_answer", ("prompt", "answer")),
    ("text", ("text",)),
    ("prompt", ("prompt",)),
]


def _detect(row: dict) -> str | None:
    for name, fields in _SIGNATURES:
        if all(_present(row, f) for f in fields):
            return name
    return None


def detect_format(row: dict) -> str:
    """The format name of one row, from which (non-null) fields it has."""
    if not isinstance(row, dict):
        raise DataError(f"expected a dict row, got {_type_name(row)}")
    name = _detect(row)
    if name is None:
        options = "; ".join(f"{n}: {', '.join(f)}" for n, f in _SIGNATURES)
        raise DataError(f"cannot detect the format of a row with fields {sorted(row)}; expected one of "
                        f"({options})")
    return name


MAX_LISTED_ROWS = 20


def validate_records(rows: Sequence[dict], format: str | None, source: str, *,
                     line_numbers: Sequence[int] | None = None, skipped: dict[str, int] | None = None) -> list[dict]:
    """Check every row against ``format`` and return normalised copies.

    ``format=None`` detects it from the first row and requires every row to agree.
    ``line_numbers`` (jsonl) makes errors say "line N" rather than "row N". Every row is checked; the
    :class:`DataError` (whose ``row`` / ``field`` are the first bad row's) lists the first
    :data:`MAX_LISTED_ROWS` bad rows in full and counts the rest by kind, so one run shows every problem
    of a file. Partial data is never returned, unless ``skipped`` (a dict) is given: then the bad rows are
    left out and counted there by kind (``data.on_error: skip``), and only a file with no good row raises.
    """
    if format is not None:
        validator = _lookup(format)
    if not rows:
        raise DataError(f"{source}: no records", source=source)
    out: list[dict] = []
    bad: list[tuple[DataError, str]] = []  # (the error, its kind for the counts)
    first = None
    for i, row in enumerate(rows):
        number, unit = (line_numbers[i], "line") if line_numbers is not None else (i + 1, "row")
        where = f"{source}, {unit} {number}"
        if not isinstance(row, dict):
            bad.append((DataError(f"{where}: expected a JSON object / dict, got {_type_name(row)}", source=source,
                                  row=number), "not an object"))
            continue
        if format is None:
            try:
                name = detect_format(row)
            except DataError as e:
                bad.append((DataError(f"{where}: {e}", source=source, row=number), "unknown format"))
                continue
            if first is None:
                first, validator = (name, number), _lookup(name)
            elif name != first[0]:
                bad.append((DataError(f"{where}: row looks like format {name!r} but {unit} {first[1]} is "
                                      f"{first[0]!r}; all rows must share one format", source=source, row=number),
                            f"format {name!r}, not {first[0]!r}"))
                continue
        try:
            out.append(validator(row))
        except _FieldError as e:
            bad.append((DataError(f"{where}, field {e.field!r}: {e.problem}", source=source, row=number,
                                  field=e.field), f"field {e.field!r}: {e.problem.split(';')[0][:60]}"))
    if bad and (skipped is None or not out):
        raise _all_bad_rows(bad, len(rows), unit="line" if line_numbers is not None else "row")
    for _, kind in bad:
        skipped[kind] = skipped.get(kind, 0) + 1
    return out


def _all_bad_rows(bad: list[tuple[DataError, str]], total: int, unit: str) -> DataError:
    """One error for every bad row: the first's message, then (when there are more) the first
    :data:`MAX_LISTED_ROWS` in full and the rest counted by kind."""
    head = bad[0][0]
    if len(bad) == 1:
        return head
    lines = [f"{head}", f"{len(bad)} of {total} {unit}s are bad:"]
    lines += [f"  {error}" for error, _ in bad[:MAX_LISTED_ROWS]]
    if len(bad) > MAX_LISTED_ROWS:
        kinds: dict[str, int] = {}
        for _, kind in bad[MAX_LISTED_ROWS:]:
            kinds[kind] = kinds.get(kind, 0) + 1
        lines.append(f"  and {len(bad) - MAX_LISTED_ROWS} more: " + "; ".join(f"{n} x {k}" for k, n in kinds.items()))
    return DataError("\n".join(lines), source=head.source, row=head.row, field=head.field)


def _lookup(format: str) -> Validator:
    try:
        return FORMATS.get(format)
    except KeyError as e:
        raise DataError(str(e.args[0])) from None


def format_names() -> list[str]:
    return FORMATS.names()
