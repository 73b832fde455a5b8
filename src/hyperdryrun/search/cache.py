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
FORMAT = 3
"""What an entry holds; part of every key, raised when that changes (2: extrapolated figures carry no allocator
peaks; 3: samples carry their blocks and extrapolated figures the allocator peaks of the blocks written from them),
so that entries of an older format are never read."""


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
    values = data.get("values")
    if isinstance(values, dict) and values.get("routing_from"):
        # the file's loads, not its name, decide the step: a file edited since is another job
        from hyperdryrun.world.routing import load_routing_file

        loads = load_routing_file(values["routing_from"])
        extra = {**extra, "routing_loads": {str(k): v for k, v in loads.items()}}
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
        """The entry, or None (a miss) when there is none or it is not one this code wrote: read within the input
        limits (size, gzip expansion, nesting: :mod:`hyperdryrun.ingest.files`) and checked field by field
        (:func:`valid_entry`) before it is trusted: a byte count edited to -5 is re-simulated, not a layout that
        "fits" at -0.00 GiB."""
        if self.directory is None:
            return None
        from hyperdryrun.ingest.files import IngestError, read_bytes, read_json

        path = self._path(kind, key)
        try:
            value = read_json(path, read_bytes(path))
        except (IngestError, OSError, ValueError, EOFError, RecursionError):
            return None
        return value if valid_entry(kind, value) else None

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


def _count(v: Any) -> bool:
    """A byte count (or an index): a non-negative int, not a bool."""
    return type(v) is int and v >= 0


def _opt(v: Any, check: Any) -> bool:
    return v is None or check(v)


def _text(v: Any) -> bool:
    return isinstance(v, str)


def _counts_by_name(v: Any) -> bool:
    return isinstance(v, dict) and all(_text(k) and _count(n) for k, n in v.items())


def _valid_figures(d: dict[str, Any]) -> bool:
    """:meth:`hyperdryrun.search.extrapolate.StepFigures.to_dict`'s fields, each of its type, byte counts >= 0."""
    phases = d.get("phases")
    return (
        all(_count(d.get(k)) for k in ("peak_bytes", "initial_bytes", "current_bytes"))
        and all(_opt(d.get(k), _count) for k in ("peak_reserved_bytes", "peak_device_bytes"))
        and all(_opt(d.get(k), _text) for k in ("peak_phase", "peak_op"))
        and _text(d.get("method", "")) and _text(d.get("detail", ""))
        and _counts_by_name(d.get("breakdown_at_peak")) and _counts_by_name(d.get("breakdown_after_step"))
        and isinstance(phases, dict)
        and all(
            isinstance(p, dict) and _count(p.get("peak_bytes")) and _opt(p.get("peak_op"), _text)
            and _counts_by_name(p.get("breakdown_at_peak"))
            for p in phases.values()
        )
    )  # fmt: skip


def _valid_samples(d: dict[str, Any]) -> bool:
    """:meth:`hyperdryrun.search.extrapolate.SampleTable.to_dict`'s rows, phases, scalars, blocks and device inputs."""
    rows, phases, scalars = d.get("rows"), d.get("phases"), d.get("scalars")
    return (
        isinstance(rows, list)
        and all(
            isinstance(r, list) and len(r) == 6 and _count(r[0]) and _text(r[1]) and _opt(r[2], _count)
            and _opt(r[3], _text) and _text(r[4]) and isinstance(r[5], list) and all(map(_count, r[5]))
            for r in rows
        )
        and isinstance(phases, list) and all(map(_text, phases))
        and isinstance(scalars, list) and all(map(_count, scalars))
        and _opt(d.get("blocks"), _valid_blocks) and _opt(d.get("device"), _valid_device)
    )  # fmt: skip


def _valid_blocks(blocks: Any) -> bool:
    """:func:`hyperdryrun.search.extrapolate.block_rows`: (id, start, end, requested, size, stream, other streams,
    category, phase, micro batch, module, op) each."""
    from hyperdryrun.trace.blocks import Category, Phase

    categories, phases = {str(c) for c in Category}, {str(p) for p in Phase}
    return isinstance(blocks, list) and all(
        isinstance(r, list) and len(r) == 12 and all(map(_count, r[:6]))
        and isinstance(r[6], list) and all(map(_count, r[6]))
        and r[7] in categories and r[8] in phases and _count(r[9]) and _text(r[10]) and _text(r[11])
        for r in blocks
    )  # fmt: skip


def _valid_device(d: Any) -> bool:
    """:func:`hyperdryrun.search.extrapolate.device_inputs`: the allocator's settings, the cuBLAS handles, the NCCL
    and CUDA-context bytes."""
    if not isinstance(d, dict):
        return False
    alloc, ws, nccl, ctx = d.get("allocator"), d.get("cublas_workspace"), d.get("nccl"), d.get("cuda_context")
    return (
        isinstance(alloc, dict) and _text(alloc.get("settings")) and _text(alloc.get("source"))
        and isinstance(ws, dict) and _count(ws.get("bytes_per_handle"))
        and isinstance(handles := ws.get("handles"), list)
        and all(
            isinstance(h, dict) and _text(h.get("thread")) and _count(h.get("stream")) and _count(h.get("first_task"))
            for h in handles
        )
        and isinstance(nccl, dict) and _count(nccl.get("bytes")) and _text(nccl.get("formula"))
        and isinstance(ctx, dict) and _count(ctx.get("bytes")) and _text(ctx.get("source"))
    )  # fmt: skip


def valid_entry(kind: str, value: Any) -> bool:
    """Whether ``value`` is an entry of ``kind`` as this code writes it (``figures`` or ``samples``); another
    kind is checked only for being an object."""
    if not isinstance(value, dict):
        return False
    if kind == "figures":
        return _valid_figures(value)
    if kind == "samples":
        return _valid_samples(value)
    return True
