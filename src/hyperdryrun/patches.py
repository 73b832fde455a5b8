"""Reversible monkeypatches: every patch of torch made by HyperDryRun goes through :class:`PatchSet`.

The lowest layer (it imports nothing of HyperDryRun), so the tracker, the world and the parallelisms all use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_MISSING = object()


@dataclass
class Patch:
    """Replace ``owner.name`` with ``new``; ``reason`` names the torch behaviour worked around."""

    owner: Any
    name: str
    new: Any
    reason: str
    _old: Any = _MISSING

    def apply(self) -> None:
        self._old = (
            self.owner.__dict__.get(self.name, _MISSING)
            if isinstance(self.owner, type)
            else getattr(self.owner, self.name, _MISSING)
        )
        setattr(self.owner, self.name, self.new)

    def undo(self) -> None:
        if self._old is _MISSING:
            delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, self._old)
        self._old = _MISSING


class PatchSet:
    """Applies patches in order and undoes them in reverse, also when applying one of them fails."""

    def __init__(self, patches: list[Patch]) -> None:
        self.patches = patches
        self._applied: list[Patch] = []

    def __enter__(self) -> PatchSet:
        try:
            for p in self.patches:
                p.apply()
                self._applied.append(p)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        while self._applied:
            self._applied.pop().undo()
