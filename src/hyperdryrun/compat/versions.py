"""The torch releases HyperDryRun supports, and the versions of the libraries a report modelled.

Torch-free (``importlib.metadata``), so that the command line refuses an unsupported torch in a few milliseconds,
before it imports torch or does any work. The supported range is the ``torch`` requirement of ``pyproject.toml``
(a test checks that they agree), so installing the package never moves a supported torch; each release in it is
tested by ``.ci/run`` (docs/TORCH_VERSIONS.md says what differs between them).
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import sys

SUPPORTED_TORCH: tuple[tuple[int, int], tuple[int, int]] = ((2, 11), (2, 15))
"""The first and last supported torch release (major, minor), both included: 2.11, 2.12, 2.13, 2.14 and 2.15."""
TORCH_REQUIREMENT = ">=2.11,<2.16"
"""The same range as a pip specifier: the ``torch`` requirement of pyproject.toml."""
ALLOW_UNSUPPORTED = "HYPERDRYRUN_ALLOW_UNSUPPORTED_TORCH"
"""Set to 1 to run on a torch outside the range anyway (trying a new release); reports still name the version."""


def installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution`` (the module's ``__version__`` when it is already imported, else
    the package metadata, which imports nothing), or None when it is not installed."""
    module = sys.modules.get(distribution)
    version = getattr(module, "__version__", None)
    if isinstance(version, str):
        return version
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def torch_version() -> str:
    """The running torch's version string (``torch.__version__``, e.g. ``2.13.0+cpu``), what reports and messages
    name: the one place outside this module's torch-free functions that reads it (imports torch)."""
    import torch

    return torch.__version__


def torch_cuda_build() -> str | None:
    """The CUDA version the running torch was built with (``torch.version.cuda``, e.g. ``13.0``), None for a CPU
    build (imports torch)."""
    import torch

    return torch.version.cuda


def release(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a version string such as ``2.13.0+cpu`` or ``2.15.0.dev20260101``; None if unreadable."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else None


def supported_range() -> str:
    """The supported releases in words: ``torch 2.11 to 2.15 (>=2.11,<2.16)``."""
    (a, b), (c, d) = SUPPORTED_TORCH
    return f"torch {a}.{b} to {c}.{d} ({TORCH_REQUIREMENT})"


def torch_problem(version: str | None = None) -> str | None:
    """One line saying why the installed torch (or ``version``) is not supported, or None when it is (or when
    :data:`ALLOW_UNSUPPORTED` is set)."""
    version = installed_version("torch") if version is None else version
    if version is None:
        return f"torch is needed and not installed: hyperdryrun supports {supported_range()}"
    if os.environ.get(ALLOW_UNSUPPORTED, "") not in ("", "0"):
        return None
    found = release(version)
    low, high = SUPPORTED_TORCH
    if found is None or not low <= found <= high:
        return (
            f"torch {version} is not supported: hyperdryrun supports {supported_range()} "
            f"(set {ALLOW_UNSUPPORTED}=1 to try it anyway)"
        )
    return None


class UnsupportedTorchError(RuntimeError):
    """The installed torch is outside the supported range (the message is :func:`torch_problem`'s line)."""


def require_supported_torch() -> None:
    """Raise :class:`UnsupportedTorchError` when the installed torch is not supported: the Python API's check, as
    the command line's, before any work."""
    if problem := torch_problem():
        raise UnsupportedTorchError(problem)


def library_versions(*names: str) -> dict[str, str | None]:
    """``{name: installed version or None}`` for each library named, torch first: what a report modelled."""
    return {name: installed_version(name) for name in ("torch", *names)}
