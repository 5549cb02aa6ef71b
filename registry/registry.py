"""The registry: register ops by decorator, look them up by name or alias, list them."""
from __future__ import annotations

import warnings
from typing import TypeVar

from .op import Op

OpT = TypeVar("OpT", bound=type[Op])


class Registry:
    def __init__(self) -> None:
        self._ops: dict[str, type[Op]] = {}
        self._names: dict[str, type[Op]] = {}
        self._legacy: set[str] = set()
        self._warned: set[str] = set()

    def register(self, op: OpT) -> OpT:
        """Class decorator: add ``op`` under NAME, ALIASES and LEGACY_ALIASES."""
        if not op.NAME:
            raise ValueError(f"{op.__qualname__} has no NAME")
        for name in (op.NAME, *op.ALIASES, *op.LEGACY_ALIASES):
            if name in self._names and self._names[name] is not op:
                raise ValueError(f"op name {name!r} already registered by {self._names[name].__qualname__}")
            self._names[name] = op
        self._legacy.update(op.LEGACY_ALIASES)
        self._ops[op.NAME] = op
        return op

    def add_alias(self, name: str, op: type[Op], legacy: bool = False) -> None:
        """Resolve ``name`` to the registered ``op`` too (``legacy``: warn once when it is used)."""
        if self._ops.get(op.NAME) is not op:
            raise ValueError(f"{op.__qualname__} is not registered")
        if name in self._names and self._names[name] is not op:
            raise ValueError(f"op name {name!r} already registered by {self._names[name].__qualname__}")
        self._names[name] = op
        if legacy:
            self._legacy.add(name)

    def get(self, name: str) -> type[Op]:
        """The op class registered under ``name`` (its NAME or an alias)."""
        try:
            op = self._names[name]
        except KeyError:
            raise ValueError(
                f"op={name!r} is not a registered op; registered: {', '.join(sorted(self._ops))}"
            ) from None
        if name in self._legacy and name not in self._warned:
            self._warned.add(name)
            # FutureWarning, not DeprecationWarning: the default filters hide DeprecationWarnings attributed
            # to library frames (op= reaches here through the selector), and this one is shown only once.
            warnings.warn(f"op name {name!r} is a legacy alias; use {op.NAME!r}", FutureWarning, stacklevel=3)
        return op

    def ops(self, kind: str | None = None) -> list[type[Op]]:
        """Registered ops in registration order, optionally only one KIND ("fw"/"bw")."""
        return [op for op in self._ops.values() if kind is None or op.KIND == kind]

    def names(self) -> dict[str, type[Op]]:
        return dict(self._names)

    def aliases(self, op: type[Op]) -> tuple[str, ...]:
        """Every name other than NAME that resolves to ``op`` (aliases, then legacy aliases)."""
        others = [n for n, o in self._names.items() if o is op and n != op.NAME]
        return tuple(sorted(others, key=lambda n: n in self._legacy))

    def is_legacy(self, name: str) -> bool:
        return name in self._legacy
