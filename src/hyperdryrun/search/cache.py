"""Results on disk, keyed by the full job description and the versions that produced them.

Two kinds: a rank's step figures (``figures``: what a search reads for one rank class of one candidate) and a
sample run's table (``samples``: what an extrapolation reads, shared by every job whose plan asks for the same sample,
e.g. the same layout with another global batch). A key is the SHA-256 of the job config as JSON (every field,
the rank included; the capacity and output paths left out, they change no figure), the kind, the shortcut setting,
the entry :data:`FORMAT` and the hyperdryrun and torch versions. Entries are written atomically (temp file + rename), so concurrent writers
and an interrupted run leave whole files only; an unreadable entry counts as a miss.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hyperdryrun.report.writer import replaceable
from hyperdryrun.version import __version__

if TYPE_CHECKING:
    from hyperdryrun.config import JobConfig

_IRRELEVANT = ("device_memory_gib", "margin_gib", "margin_pct", "output_dir", "live_set_limit")
FORMAT = 2
"""What an entry holds; part of every key, raised when that changes (2: extrapolated figures carry no allocator
peaks), so that entries of an older format are never read."""


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/hyperdryrun``, else ``~/.cache/hyperdryrun``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hyperdryrun"


def versions() -> dict[str, str]:
    from hyperdryrun.compat.versions import torch_version

    return {"hyperdryrun": __version__, "torch": torch_version()}


def job_key(cfg: JobConfig | dict[str, Any], kind: str, **extra: Any) -> str:
    """The cache key of ``cfg`` (a config or its dict) for ``kind``."""
    data = cfg if isinstance(cfg, dict) else cfg.model_dump()
    data = {k: v for k, v in data.items() if k not in _IRRELEVANT}
    blob = json.dumps(
        {"kind": kind, "format": FORMAT, "job": data, "versions": versions(), **extra},
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


class ResultCache:
    """A directory of JSON entries (gzip-compressed) by key; ``None`` as the directory: a cache that keeps nothing."""

    def __init__(self, directory: str | os.PathLike | None) -> None:
        self.directory = None if directory is None else Path(directory)

    def _path(self, kind: str, key: str) -> Path:
        assert self.directory is not None
        return self.directory / kind / key[:2] / f"{key}.json.gz"

    def get(self, kind: str, key: str) -> dict[str, Any] | None:
        if self.directory is None:
            return None
        try:
            with gzip.open(self._path(kind, key), "rt") as f:
                return json.load(f)
        except (OSError, ValueError, EOFError):
            return None

    def put(self, kind: str, key: str, value: dict[str, Any]) -> None:
        """Store ``value`` (atomically); a cache that cannot be written is skipped, not an error."""
        if self.directory is None:
            return
        path = self._path(kind, key)
        try:
            replaceable(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            with gzip.open(tmp, "wt") as f:
                json.dump(value, f)
            os.replace(tmp, path)
        except OSError:
            return
