"""What every reader of a recorded file shares: the one-line :class:`IngestError`, which recorded frames are user
code, and reading a file's bytes, (gzipped) JSON and a CUDA snapshot pickle without running foreign code."""

from __future__ import annotations

import gzip
import io
import json
import os
import pickle
import sysconfig
import zlib
from pathlib import Path
from typing import Any

PICKLE_MAGIC = b"\x80"
GZIP_MAGIC = b"\x1f\x8b"
_STDLIB = sysconfig.get_paths()["stdlib"].replace("\\", "/").rstrip("/") + "/"


class IngestError(ValueError):
    """A file that cannot be read as a memory picture: ``<file>: <what is wrong>`` on one line."""

    def __init__(self, source: str | os.PathLike, problem: str) -> None:
        super().__init__(f"{source}: {' '.join(str(problem).split())}")
        self.source, self.problem = str(source), problem


def user_file(filename: str) -> bool:
    """Whether a recorded frame's file is user code (not torch, the interpreter, C++ or hyperdryrun machinery).

    Traces store paths relative to ``sys.path`` entries (``torch/nn/modules/module.py``) or absolute ones.
    """
    f = filename.replace("\\", "/")
    if os.path.isabs(f) and f.startswith(_STDLIB) and "-packages/" not in f:
        return False
    if f and not os.path.isabs(f) and os.path.exists(_STDLIB + f):
        return False  # traces name files relative to their sys.path entry: one found in the stdlib is
    if not f or f.startswith(("<", "??")) or f.endswith((".cpp", ".h", ".cu", ".cc", ".hpp")):
        return False
    if f.startswith("torch/") or "/torch/" in f or "/_pytest/" in f or "/pluggy/" in f:
        return False
    if f.startswith("hyperdryrun/") or "/hyperdryrun/" in f:
        return "hyperdryrun/models/" in f
    return True


class _NoObjects(pickle.Unpickler):
    """A snapshot is dicts, lists, strings and numbers: refuse any class, so a foreign pickle runs no code."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"it references {module}.{name}")


def read_bytes(path: Path) -> bytes:
    """The bytes of ``path``; a missing, directory or unreadable path is an :class:`IngestError` naming it."""
    if not path.exists():
        raise IngestError(path, "no such file")
    if path.is_dir():
        raise IngestError(path, "is a directory, not a file")
    try:
        return path.read_bytes()
    except OSError as err:
        raise IngestError(path, f"cannot read: {err.strerror or err}") from None


def read_json(path: Path, raw: bytes) -> Any:
    """The JSON document in ``raw`` (the bytes of ``path``, gzipped or not); unparsable is an :class:`IngestError`."""
    if raw[:2] == GZIP_MAGIC:
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as err:
            raise IngestError(path, f"corrupt gzip data ({err})") from None
    if not raw.strip():
        raise IngestError(path, "empty file")
    try:
        return json.loads(raw)
    except UnicodeDecodeError:
        raise IngestError(path, "not UTF-8 text (neither JSON nor CSV)") from None
    except json.JSONDecodeError as err:
        raise IngestError(
            path, f"invalid or truncated JSON at line {err.lineno} column {err.colno}"
        ) from None


def read_snapshot(path: Path, raw: bytes) -> Any:
    """The CUDA snapshot pickle in ``raw`` (the bytes of ``path``), unpickled with every class refused."""
    try:
        return _NoObjects(io.BytesIO(raw)).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError) as err:
        raise IngestError(path, f"not a CUDA memory snapshot pickle ({err})") from None
