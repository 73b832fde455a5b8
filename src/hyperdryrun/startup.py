"""CPython's cyclic garbage collector while one of our processes imports torch.

Importing what every dry run needs (torch, DTensor, FSDP2, ``torch._dynamo``, which a ``FakeTensorMode`` and every
dispatch mode import) makes ~310,000 objects that the collector tracks. CPython collects its youngest generation
every 700 new ones and the whole heap whenever the old generation has grown by a quarter, so these imports alone run
~750 collections, the full ones over an ever larger heap: 0.5-0.6 CPU s of the README's first command (~6 CPU s),
with its cache misses ~0.7-0.8 s, measured here (docs/PERFORMANCE.md). They find nothing to collect: the imports
make module-level objects that live as long as the process. Later full collections traverse them again.

So a process whose whole life is one of our commands (:func:`owned_process`: the command line's ``main``, the
spawned rank and search workers, the child a torchtitan job or a script runs in) imports that stack with the
collector paused (:func:`import_torch_stack`) and then moves what exists to the permanent generation
(``gc.freeze``), which later collections skip. After that the collector runs as before, with its default
thresholds, through the setup and the traced step.

Why a trace stays the same: the tracker closes a block when its storage dies (a weakref callback), and a storage
dies when its reference count drops to zero, whenever the collector runs; a storage kept alive only by a reference
cycle would die inside a collection, at a time that depends on the collector's counts (as on a real GPU, where it
depends on the real process's). ``tests/test_startup.py`` checks that no tracked storage dies inside a collection on
the jobs it runs, and that the reports are byte for byte those of a process that imports with the collector on.

Outside an owned process (the Python API in a user's own process) :func:`import_torch_stack` only imports: the
collector is the user's. On leaving :func:`owned_process`, what it froze is unfrozen (a ``cli.main`` called from
Python leaves the collector as it found it, and native extensions that report objects not freed at exit, nanobind's
in triton, do not see the frozen ones as leaked).
"""

from __future__ import annotations

import contextlib
import gc
import sys
from collections.abc import Iterator

TORCH_STACK = ("hyperdryrun.engine", "hyperdryrun.recipe")
"""What a dry run imports before its first step: torch, DTensor, FSDP2, torch._dynamo (via the fake mode and the
world's dispatch modes), our engine and presets."""

_owner: list[bool] = []
"""Holds one value while the outermost :func:`owned_process` is open (a nested one adds none): whether
:func:`import_torch_stack` froze objects in it. Empty: not an owned process."""


@contextlib.contextmanager
def owned_process() -> Iterator[None]:
    """This process's life is one command: :func:`import_torch_stack` may pause the collector and freeze. On exit,
    what it froze is unfrozen, also after an exception."""
    if _owner:
        yield
        return
    _owner.append(False)
    try:
        yield
    finally:
        if _owner.pop():
            gc.unfreeze()


def import_torch_stack() -> None:
    """Import :data:`TORCH_STACK`; in an owned process, with the collector paused, then freeze what exists. Once
    imported, or when something else froze objects before (``gc.unfreeze`` could not tell theirs from ours), or when
    the collector is off already, it only imports."""
    pause = bool(_owner) and gc.isenabled() and not gc.get_freeze_count()
    pause = pause and not all(name in sys.modules for name in TORCH_STACK)
    if pause:
        gc.disable()
    try:
        import hyperdryrun.engine  # noqa: F401
        import hyperdryrun.recipe  # noqa: F401

        if pause:
            gc.freeze()
            _owner[-1] = True
    finally:
        if pause:
            gc.enable()
