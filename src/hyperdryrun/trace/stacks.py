"""Python call stacks of allocations: user frames only, interned per call site."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from types import CodeType, FrameType
from typing import TypeVar

MAX_FRAMES = 64


def _dir(module_file: str) -> str:
    return os.path.dirname(os.path.abspath(module_file)) + os.sep


_PKG = _dir(os.path.dirname(os.path.abspath(__file__)))  # hyperdryrun/, the parent of this file's trace/
_OWN_USER_CODE = (_PKG + "models" + os.sep,)  # the built-in recipe's model code is user code there


def _package_dirs(name: str) -> tuple[str, ...]:
    """The folder of an installed package, found, not imported (reports and the CLI stay torch-free); none when it
    is not installed (``hyperdryrun --help`` runs without torch)."""
    spec = importlib.util.find_spec(name)
    return (_dir(spec.origin),) if spec is not None and spec.origin else ()


_TORCH = _package_dirs("torch")
_LAUNCHERS = os.path.join(sys.prefix, "bin") + os.sep  # console-script entry points
_SITE = tuple(sorted({p + os.sep for p in sys.path if p.endswith(("site-packages", "dist-packages"))}))
_STDLIB = _dir(os.__file__)
_HARNESS = tuple(os.sep + name + os.sep for name in ("_pytest", "pytest", "pluggy"))


_STEP_CODE: set[CodeType] = set()
"""Code objects of hyperdryrun that are the training step a CLI user runs (see :func:`step_code`)."""
F = TypeVar("F", bound=Callable)


def step_code(fn: F) -> F:
    """Keep ``fn``'s frames in stacks although it lives in hyperdryrun: the built-in recipe's step, loss and
    batches are the training code of a CLI job (the line that calls ``loss.backward()`` or ``optimizer.step()``,
    the line that makes the batch), as a user's own step is for theirs."""
    _STEP_CODE.add(fn.__code__)
    return fn


def user_frame(filename: str) -> bool:
    """Whether a frame of ``filename`` is code the user can change: their model and step (or the built-in
    recipe's), not torch internals, hyperdryrun's machinery, the standard library, launchers or the test harness."""
    if filename.startswith("<") or any(h in filename for h in _HARNESS):
        return False
    f = os.path.abspath(filename)
    if f.startswith(_PKG):
        return f.startswith(_OWN_USER_CODE)
    if f.startswith((*_TORCH, _LAUNCHERS)):
        return False
    if f.startswith(_SITE):
        return True
    return not f.startswith(_STDLIB)


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
        self._kept: dict[CodeType, bool] = {}
        """Code object -> whether its frames are kept: one lookup per frame walked (stacks run ~100 frames deep
        through torch); answered again when :func:`step_code` registered more code since."""
        self._step_codes = len(_STEP_CODE)

    def _keep(self, filename: str) -> bool:
        keep = self._filtered.get(filename)
        if keep is None:
            keep = self._filtered[filename] = user_frame(filename)
        return keep

    def _keep_code(self, code: CodeType) -> bool:
        keep = self._kept[code] = self._keep(code.co_filename) or code in _STEP_CODE
        return keep

    def capture(self, frame: FrameType | None = None) -> int:
        f = frame if frame is not None else sys._getframe(1)
        key: list[tuple[CodeType, int]] = []
        if self._step_codes != len(_STEP_CODE):
            self._kept.clear()
            self._step_codes = len(_STEP_CODE)
        kept = self._kept
        while f is not None:
            code = f.f_code
            keep = kept.get(code)
            if keep is None:
                keep = self._keep_code(code)
            if keep:
                key.append((code, f.f_lineno))
                if len(key) == MAX_FRAMES:
                    break
            f = f.f_back
        tkey = tuple(key)
        sid = self._ids.get(tkey)
        if sid is None:
            sid = len(self._frames)
            self._ids[tkey] = sid
            self._frames.append(tuple((c.co_filename, line, c.co_name) for c, line in tkey))
        return sid

    def intern(self, frames: Sequence[Frame]) -> int:
        """The id of a stack given as frames (innermost first), e.g. one captured before this table existed."""
        key = ("frames", tuple(frames))
        sid = self._ids.get(key)
        if sid is None:
            if not frames:
                return 0
            sid = self._ids[key] = len(self._frames)
            self._frames.append(tuple(frames))
        return sid

    def frames(self, stack_id: int) -> tuple[Frame, ...]:
        return self._frames[stack_id]

    def __len__(self) -> int:
        return len(self._frames)


def format_stack(frames: tuple[Frame, ...]) -> str:
    """CSV form: ``File:..;Line:..;Function:..`` joined by ``|``, innermost first."""
    return "|".join(f"File:{f};Line:{ln};Function:{fn}" for f, ln, fn in frames)
