"""Lazy package exports: a package names what it exports and where, and a name's module loads on first use.

``__getattr__, __dir__ = lazy_exports(__name__, {"Name": "package.module", ...})`` in a package's
``__init__`` keeps ``import package`` cheap (``import tether`` and the CLI's start import no torch).
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from typing import Any


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of a package whose ``exports`` map names to defining modules."""

    def __getattr__(name: str) -> Any:
        if name in exports:
            return getattr(import_module(exports[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(exports)

    return __getattr__, __dir__
