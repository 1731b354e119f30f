"""Name -> function registries: one per kind of math (advantage, policy loss, KL, ...).

Users write these names in configs; trainers always dispatch through the registry,
and a lookup error lists every valid name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """A named collection of functions of one kind, filled by the ``register`` decorator."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, F] = {}
        self._needs: dict[str, frozenset[str]] = {}

    def register(self, name: str, *aliases: str, needs: tuple[str, ...] = ()) -> Callable[[F], F]:
        """Decorator: register ``fn`` under ``name`` (and any aliases).

        ``needs`` names the inputs the entry reads beyond what every entry of its kind gets (an
        advantage estimator's ``values`` or ``baseline_rewards``), so a trainer asks the registry
        what to prepare instead of special-casing names.
        """

        def decorator(fn: F) -> F:
            for key in (name, *aliases):
                if key in self._entries:
                    raise ValueError(f"{self.kind} {key!r} is already registered")
                self._entries[key] = fn
                self._needs[key] = frozenset(needs)
            return fn

        return decorator

    def needs(self, name: str) -> frozenset[str]:
        """The extra inputs the entry ``name`` declared (empty for most); KeyError for an unknown name."""
        self.get(name)
        return self._needs[name]

    def get(self, name: str) -> F:
        try:
            return self._entries[name]
        except KeyError:
            valid = ", ".join(sorted(self._entries))
            raise KeyError(f"unknown {self.kind} {name!r}; valid names: {valid}") from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._entries))

    def __len__(self) -> int:
        return len(self._entries)
