"""Python call stacks of allocations: user frames only, interned per call site."""

from __future__ import annotations

import os
import sys
from types import FrameType

import torch

import hyperdryrun

MAX_FRAMES = 64
_FILTERED_ROOTS = tuple(
    os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (torch, hyperdryrun)
) + (os.path.dirname(os.path.abspath(os.__file__)) + os.sep + "contextlib.py",)

Frame = tuple[str, int, str]


class StackTable:
    """Interns stacks: ``capture()`` returns a small int id; ``frames(id)`` the frames, innermost first.

    Frames inside torch and hyperdryrun are dropped; what remains is the model and step code a user can change.
    A stack is keyed by its (code object, line) pairs so the string work happens once per distinct call site.
    """

    def __init__(self) -> None:
        self._ids: dict[tuple, int] = {(): 0}
        self._frames: list[tuple[Frame, ...]] = [()]
        self._filtered: dict[str, bool] = {}

    def _keep(self, filename: str) -> bool:
        keep = self._filtered.get(filename)
        if keep is None:
            absf = os.path.abspath(filename)
            keep = not (absf.startswith(_FILTERED_ROOTS) or filename.startswith("<"))
            self._filtered[filename] = keep
        return keep

    def capture(self, frame: FrameType | None = None) -> int:
        f = frame if frame is not None else sys._getframe(1)
        key = []
        keep = self._keep
        while f is not None and len(key) < MAX_FRAMES:
            code = f.f_code
            if keep(code.co_filename):
                key.append((code, f.f_lineno))
            f = f.f_back
        tkey = tuple(key)
        sid = self._ids.get(tkey)
        if sid is None:
            sid = len(self._frames)
            self._ids[tkey] = sid
            self._frames.append(tuple((c.co_filename, line, c.co_name) for c, line in tkey))
        return sid

    def frames(self, stack_id: int) -> tuple[Frame, ...]:
        return self._frames[stack_id]

    def __len__(self) -> int:
        return len(self._frames)


def format_stack(frames: tuple[Frame, ...]) -> str:
    """CSV form: ``File:..;Line:..;Function:..`` joined by ``|``, innermost first."""
    return "|".join(f"File:{f};Line:{ln};Function:{fn}" for f, ln, fn in frames)
