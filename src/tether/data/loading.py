"""Load records from files, ``datasets`` objects or Python lists, validated against a format.

Sources: ``.jsonl`` (one object a line; blank lines skipped; errors give the line number),
``.json`` (a list of objects), ``.parquet``, a directory written by ``datasets``'
``save_to_disk``, a ``datasets.Dataset`` / ``DatasetDict``, or a list of dicts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tether.data.schemas import DataError, validate_records

EXTENSIONS = (".jsonl", ".json", ".parquet")


def read_rows(source: str | Path | list[dict] | Any, *, split: str = "train"
              ) -> tuple[list[Any], list[int] | None, str]:
    """Rows exactly as stored, before validation: ``(rows, jsonl line numbers or None, source name)``.

    For callers that filter rows before validating them (e.g. dropping identical preference pairs)
    while keeping the original file's numbering in error messages.
    """
    if isinstance(source, list):
        return source, None, "<list>"
    if isinstance(source, str | Path):
        return _read_path(Path(source), split)
    import datasets

    if isinstance(source, datasets.DatasetDict):
        source = _pick_split(source, split, "<dataset>")
    if isinstance(source, datasets.Dataset):
        return source.to_list(), None, "<dataset>"
    raise TypeError(f"cannot load records from a {type(source).__name__}; give a path (.jsonl, .json, "
                    ".parquet or a saved datasets directory), a list of dicts or a datasets.Dataset")


def load_records(source: str | Path | list[dict] | Any, format: str | None = None, *,
                 split: str = "train", skipped: dict[str, int] | None = None) -> list[dict]:
    """Read every row of ``source`` and validate it as ``format`` (detected when None).

    ``split`` picks the split of a ``DatasetDict`` (in memory or saved to disk).
    Returns normalised dicts; raises :class:`DataError` naming the source, row and field of every bad row,
    or ``FileNotFoundError`` for a missing path. With ``skipped`` (a dict), bad rows are left out and
    counted there by kind instead.
    """
    rows, lines, name = read_rows(source, split=split)
    return validate_records(rows, format, name, line_numbers=lines, skipped=skipped)


def _read_path(path: Path, split: str) -> tuple[list[Any], list[int] | None, str]:
    if not path.exists():
        raise FileNotFoundError(f"data file not found: {path}")
    source = str(path)
    if path.is_dir():
        import datasets

        try:
            data = datasets.load_from_disk(source)
        except Exception as e:  # missing state files, a damaged arrow file, ...: all the same to the user
            raise DataError(f"{source}: a directory must be one saved by datasets' save_to_disk "
                            f"({type(e).__name__}: {e})", source=source) from None
        if isinstance(data, datasets.DatasetDict):
            data = _pick_split(data, split, source)
        return data.to_list(), None, source
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        rows, lines = _read_jsonl(path)
        return rows, lines, source
    if suffix == ".json":
        return _read_json(path), None, source
    if suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist(), None, source
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{source}: not a readable parquet file ({e})", source=source) from None
    raise DataError(f"{source}: unknown file extension {path.suffix!r}; expected one of "
                    f"{', '.join(EXTENSIONS)} or a datasets directory", source=source)


def _read_jsonl(path: Path) -> tuple[list[Any], list[int]]:
    rows, lines = [], []
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}, line {number}: not UTF-8 (byte {raw[e.start]:#04x} at column "
                                f"{e.start + 1})", source=str(path), row=number) from None
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}, line {number}: invalid JSON ({e.msg} at column {e.colno})",
                                source=str(path), row=number) from None
            except RecursionError:
                raise DataError(f"{path}, line {number}: JSON nested too deeply", source=str(path),
                                row=number) from None
            lines.append(number)
    return rows, lines


def _read_json(path: Path) -> list[Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 (at byte {e.start})", source=str(path)) from None
    except RecursionError:
        raise DataError(f"{path}: JSON nested too deeply", source=str(path)) from None
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: invalid JSON ({e.msg} at line {e.lineno}, column {e.colno}); "
                        "use .jsonl for one object a line", source=str(path), row=e.lineno) from None
    if not isinstance(data, list):
        raise DataError(f"{path}: a .json file must hold a list of records, got {type(data).__name__}",
                        source=str(path))
    return data


def _pick_split(data: Any, split: str, source: str) -> Any:
    if split not in data:
        raise DataError(f"{source}: no split {split!r}; available: {', '.join(data)}", source=source)
    return data[split]
