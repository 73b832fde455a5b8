"""Replay a real CUDA snapshot's own event stream through the allocator model and compare, event by event.

A ``torch.cuda.memory._dump_snapshot`` holds what the real caching allocator did over a recorded window
(``device_traces``: ``alloc``, ``free_requested``, ``free_completed``, ``segment_alloc``, ``segment_free`` with their
addresses and streams) and its segments at the end. :func:`replay_snapshot` rebuilds the cache as it was when
recording began (the segments at the end less those the window cudaMalloc'd, plus those it cudaFree'd; the blocks
alive then: those alive at the end that the window did not allocate, and those the window frees without having
allocated them), seeds :class:`CachingAllocatorModel` with it at the real addresses, and drives the model with the
window's requests: each ``alloc`` at its stream, each free when the real allocator made the block reusable
(``free_completed``: at once, or once its uses on other streams were done). The model's choices are checked against
the recorded ones: the address each request got, each new segment (``segment_alloc``), the segments of every pool
at the end, and the reserved peak. Recorded addresses also break best-fit ties as on the device, so a faithful
model reproduces the window exactly.

``cold=True`` answers another question: what the model reserves for the window's requests from an empty cache (the
blocks alive at the start allocated first, by address, then the window), which is what a dry run predicts; no
address is compared then. On the four shipped H200 snapshots the warm replay is exact (every allocation at its
recorded address, every segment the same) and the cold one is off by -2.6% to +8.5%: a warm step's reserved bytes
depend on the cache that initialization and the warm-up step left, which the recorded window does not contain.

Usage::

    result = replay_snapshot(load_snapshot("snap.pickle.gz"), "snap.pickle.gz")
    result.model_peak_reserved, result.recorded_peak_reserved, result.first_divergence
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hyperdryrun.allocator.model import K_SMALL_SIZE, CachingAllocatorModel, Segment, round_size
from hyperdryrun.allocator.options import AllocatorConfigError, AllocatorOptions
from hyperdryrun.ingest.files import GZIP_MAGIC, PICKLE_MAGIC, IngestError, gunzip, read_bytes, read_snapshot
from hyperdryrun.ingest.snapshot import _pick_device, check_snapshot

DEFAULT_REPLAY_TOLERANCE = 0.005
"""Largest relative error of the modelled reserved peak that passes: the issue's 0.5%."""
ACTIVE = frozenset({"active_allocated", "active_pending_free"})
_SEGMENT_ACTIONS = frozenset({"segment_alloc", "segment_free", "segment_map", "segment_unmap"})


def load_snapshot(path: str | Path) -> Any:
    """The snapshot dict in ``path`` (a ``_dump_snapshot`` pickle, gzipped or not), read with the ingest limits;
    anything else is an :class:`IngestError` naming the file."""
    p = Path(path)
    raw = read_bytes(p)
    if raw[:2] == GZIP_MAGIC:
        raw = gunzip(p, raw)
    if raw[:1] != PICKLE_MAGIC:
        raise IngestError(p, "not a CUDA memory snapshot pickle (gzipped or not)")
    return read_snapshot(p, raw)


def options_of(data: dict[str, Any], source: str) -> AllocatorOptions:
    """The allocator settings the snapshot records (``allocator_settings.PYTORCH_CUDA_ALLOC_CONF``), else defaults."""
    conf = (data.get("allocator_settings") or {}).get("PYTORCH_CUDA_ALLOC_CONF") or ""
    if not isinstance(conf, str):
        raise IngestError(source, f"allocator_settings.PYTORCH_CUDA_ALLOC_CONF is not a string ({conf!r})")
    try:
        return AllocatorOptions.parse(conf, source=f"{source}: allocator_settings")
    except AllocatorConfigError as err:
        raise IngestError(source, str(err)) from None


@dataclass(frozen=True)
class StartSegment:
    """A segment that existed when recording began, with the blocks allocated in it then."""

    address: int
    size: int
    stream: int
    small: bool
    blocks: tuple[tuple[int, int, int], ...]
    """(address, size, requested) of each block allocated at the start, by address."""


@dataclass(frozen=True)
class PoolRow:
    """One (stream, pool) at the end of the window: the recorded segments and the model's."""

    stream: int
    pool: str
    recorded_segments: int
    recorded_bytes: int
    model_segments: int
    model_bytes: int
    same_segments: int
    """Segments with the same address and size on both sides."""


@dataclass(frozen=True)
class Divergence:
    """The first trace entry where the model did something else than the real allocator."""

    event: int
    action: str
    recorded: str
    modelled: str


@dataclass
class SnapshotReplay:
    """The model's replay of one device's recorded window, against what the real allocator recorded."""

    source: str
    device: str
    cold: bool
    options: AllocatorOptions
    entries: int
    """Trace entries of the window."""
    allocs: int
    same_address: int
    """Allocations (warm replay) that got the recorded address."""
    recorded_start_reserved: int
    recorded_peak_reserved: int
    model_peak_reserved: int
    recorded_segment_allocs: int
    model_segment_allocs: int
    first_divergence: Divergence | None
    pools: list[PoolRow] = field(default_factory=list)
    model_segments: list[Segment] = field(default_factory=list)

    @property
    def relative_error(self) -> float:
        """(model - recorded) / recorded of the reserved peak (0 when both are 0)."""
        rec = self.recorded_peak_reserved
        if rec == 0:
            return 0.0 if self.model_peak_reserved == 0 else float("inf")
        return (self.model_peak_reserved - rec) / rec

    def within(self, tolerance: float) -> bool:
        """Whether the reserved peak is within ``tolerance`` (relative) of the recorded one."""
        return abs(self.relative_error) <= tolerance

    def as_dict(self) -> dict[str, Any]:
        """Plain data for ``--json``."""
        div = self.first_divergence
        return {
            "source": self.source,
            "device": self.device,
            "mode": "cold" if self.cold else "warm",
            "entries": self.entries,
            "allocs": self.allocs,
            "same_address": self.same_address,
            "recorded_start_reserved_bytes": self.recorded_start_reserved,
            "recorded_peak_reserved_bytes": self.recorded_peak_reserved,
            "model_peak_reserved_bytes": self.model_peak_reserved,
            "relative_error": self.relative_error,
            "recorded_segment_allocs": self.recorded_segment_allocs,
            "model_segment_allocs": self.model_segment_allocs,
            "first_divergence": None
            if div is None
            else {
                "event": div.event,
                "action": div.action,
                "recorded": div.recorded,
                "modelled": div.modelled,
            },
            "pools": [vars(p).copy() for p in self.pools],
        }


def start_state(data: dict[str, Any], d: int, options: AllocatorOptions) -> list[StartSegment]:
    """The segments of device ``d`` when recording began, each with its blocks allocated then.

    Segments: those at the end, less those the window cudaMalloc'd, plus those it cudaFree'd (newest first).
    Blocks: those allocated at the end that the window did not allocate (their recorded size), and those the
    window frees without having allocated them (their request rounded as ``round_size`` does; in the large pool a
    block whose remainder up to the next allocated block is at most 1 MiB was handed out unsplit and owns it)."""
    trace = data["device_traces"][d]
    segs: dict[int, tuple[int, int, bool]] = {}
    known: dict[int, list[tuple[int, int, int]]] = {}
    for s in data["segments"]:
        if not isinstance(s, dict) or s.get("device", d) != d:
            continue
        addr = int(s["address"])
        segs[addr] = (int(s["total_size"]), int(s.get("stream", 0)), s.get("segment_type") == "small")
        known[addr] = [
            (int(b["address"]), int(b["size"]), int(b.get("requested_size", b["size"])))
            for b in s.get("blocks") or ()
            if isinstance(b, dict) and b.get("state") in ACTIVE
        ]
    for e in reversed(trace):
        if e["action"] in ("segment_alloc", "segment_map"):
            segs.pop(e["addr"], None)
            known.pop(e["addr"], None)
        elif e["action"] in ("segment_free", "segment_unmap"):
            size = int(e["size"])
            segs[e["addr"]] = (size, int(e.get("stream", 0)), size == 2 << 20)
            known[e["addr"]] = []
    # Blocks the window allocated and left allocated: not there at the start.
    alive: set[int] = set()
    seen: set[int] = set()
    freed_first: dict[int, int] = {}
    for e in trace:
        a, x = e["action"], e.get("addr")
        if a == "alloc":
            alive.add(x)
            seen.add(x)
        elif a in ("free_requested", "free_completed"):
            if x not in seen:
                freed_first[x] = int(e["size"])
            seen.add(x)
            alive.discard(x)
    order = sorted(segs)
    out = []
    for addr in order:
        size, stream, small = segs[addr]
        blocks = [b for b in known.get(addr, []) if b[0] not in alive]
        have = {b[0] for b in blocks}
        guessed = [
            (x, round_size(req, options), req)
            for x, req in freed_first.items()
            if addr <= x < addr + size and x not in have
        ]
        blocks = sorted(blocks + guessed)
        if not small and guessed:
            guessed_at = {g[0] for g in guessed}
            for k, (x, bsize, req) in enumerate(blocks):
                nxt = blocks[k + 1][0] if k + 1 < len(blocks) else addr + size
                if x in guessed_at and 0 < nxt - (x + bsize) <= K_SMALL_SIZE:
                    blocks[k] = (x, nxt - x, req)
        out.append(StartSegment(addr, size, stream, small, tuple(blocks)))
    return out


def _completions(trace: list[dict[str, Any]]) -> dict[int, int]:
    """For each ``free_requested`` entry, the index of the ``free_completed`` of the same address after it."""
    waiting: dict[int, list[int]] = defaultdict(list)
    done: dict[int, int] = {}
    for i, e in enumerate(trace):
        if e["action"] == "free_requested":
            waiting[e["addr"]].append(i)
        elif e["action"] == "free_completed" and waiting.get(e["addr"]):
            done[waiting[e["addr"]].pop(0)] = i
    return done


def _fmt(n: int) -> str:
    return f"{n:,}"


def replay_snapshot(
    data: Any,
    source: str = "<snapshot>",
    device: str | None = None,
    options: AllocatorOptions | None = None,
    cold: bool = False,
) -> SnapshotReplay:
    """Replay one device's recorded window through the model (see the module's docstring) and compare.

    ``options``: the allocator settings (default: those the snapshot records). ``cold``: from an empty cache.
    Raises :class:`IngestError` for a file that is no snapshot."""
    check_snapshot(data, source)
    d = _pick_device(data["device_traces"], device, source)
    trace = data["device_traces"][d]
    options = options or options_of(data, source)
    start = start_state(data, d, options)
    start_reserved = sum(s.size for s in start)
    model = CachingAllocatorModel(options)
    start_ids: dict[int, int] = {}
    if cold:
        for seg in start:
            for addr, _, req in seg.blocks:
                start_ids[addr] = -(len(start_ids) + 1)
                model.malloc(start_ids[addr], req, seg.stream)
    else:
        for seg in start:
            owned = []
            for addr, size, req in seg.blocks:
                start_ids[addr] = -(len(start_ids) + 1)
                owned.append((addr, size, req, start_ids[addr]))
            model.add_segment(seg.address, seg.size, seg.stream, seg.small, owned)
    done = _completions(trace)
    reserved = recorded_peak = start_reserved
    divergence: Divergence | None = None
    allocs = same = recorded_segs = model_segs = 0
    n = len(trace)

    def diverge(i: int, action: str, recorded: str, modelled: str) -> None:
        nonlocal divergence
        if divergence is None:
            divergence = Divergence(i, action, recorded, modelled)

    paired = set(done.values())
    ids = dict(start_ids)
    pending_segment: int | None = None
    for i, e in enumerate(trace):
        action, addr = e["action"], e.get("addr")
        if action in _SEGMENT_ACTIONS:
            grows = action in ("segment_alloc", "segment_map")
            reserved += int(e["size"]) if grows else -int(e["size"])
            recorded_peak = max(recorded_peak, reserved)
            if grows:
                recorded_segs += 1
                pending_segment = addr
            elif not cold:
                diverge(i, action, f"{action} of {_fmt(int(e['size']))} B at {addr:#x}", "not modelled")
        elif action == "alloc":
            size, stream = int(e["size"]), int(e.get("stream", 0))
            before = model.device_allocs
            if not cold:
                model.next_segment_address = pending_segment
            model.malloc(i, size, stream, i)
            model.next_segment_address = None
            made = model.device_allocs - before
            model_segs += made
            allocs += 1
            ids[addr] = i
            if not cold:
                got = model.address_of(i)
                same += got == addr
                if made and pending_segment is None:
                    diverge(i, action, f"{_fmt(size)} B on stream {stream} from the cache", "a new segment")
                elif not made and pending_segment is not None:
                    diverge(
                        i, action, f"{_fmt(size)} B on stream {stream} in a new segment", "from the cache"
                    )
                elif got != addr:
                    diverge(i, action, f"{_fmt(size)} B on stream {stream} at {addr:#x}", f"at {got or 0:#x}")
            pending_segment = None
        elif action == "free_requested" and addr in ids:
            j = done.get(i, n + 1)  # never completed in the window: pending to its end
            if j == i + 1:
                model.free(ids.pop(addr), task=i)
            else:  # used on another stream: reusable at its free_completed (a stream of its own: no FIFO wait)
                model.free(ids.pop(addr), use_streams=(-(i + 1),), uses_done=j, task=i)
        elif action == "free_completed" and i not in paired and addr in ids:
            model.free(ids.pop(addr), task=i)  # its free was requested before the window
    pools = _pools(data, d, model.segments(), compare_addresses=not cold)
    return SnapshotReplay(
        source=source,
        device=f"cuda:{d}",
        cold=cold,
        options=options,
        entries=n,
        allocs=allocs,
        same_address=same,
        recorded_start_reserved=start_reserved,
        recorded_peak_reserved=recorded_peak,
        model_peak_reserved=model.peak_reserved,
        recorded_segment_allocs=recorded_segs,
        model_segment_allocs=model_segs,
        first_divergence=divergence,
        pools=pools,
        model_segments=model.segments(),
    )


def _pools(
    data: dict[str, Any], d: int, modelled: Iterable[Segment], compare_addresses: bool
) -> list[PoolRow]:
    rec: dict[tuple[int, str], set[tuple[int, int]]] = defaultdict(set)
    for s in data["segments"]:
        if isinstance(s, dict) and s.get("device", d) == d:
            pool = "small" if s.get("segment_type") == "small" else "large"
            rec[(int(s.get("stream", 0)), pool)].add((int(s["address"]), int(s["total_size"])))
    mod: dict[tuple[int, str], set[tuple[int, int]]] = defaultdict(set)
    for seg in modelled:
        mod[(seg.stream, seg.pool)].add((seg.address, seg.size))
    rows = []
    for key in sorted(set(rec) | set(mod)):
        r, m = rec.get(key, set()), mod.get(key, set())
        rows.append(
            PoolRow(
                stream=key[0],
                pool=key[1],
                recorded_segments=len(r),
                recorded_bytes=sum(s for _, s in r),
                model_segments=len(m),
                model_bytes=sum(s for _, s in m),
                same_segments=len(r & m) if compare_addresses else 0,
            )
        )
    return rows


def format_replay(result: SnapshotReplay, tolerance: float) -> str:
    """The short per-pool comparison ``hyperdryrun compare --replay`` prints."""
    mode = "cold: from an empty cache" if result.cold else "warm: the cache as recording began"
    lines = [
        f"replay of {result.source} ({result.device}, {result.entries:,} trace entries, {mode})",
        f"{'stream':>12} {'pool':<6} {'recorded segs':>13} {'recorded bytes':>16} "
        f"{'model segs':>10} {'model bytes':>16}" + ("" if result.cold else f" {'same':>5}"),
    ]
    for p in result.pools:
        lines.append(
            f"{p.stream:>12} {p.pool:<6} {p.recorded_segments:>13} {p.recorded_bytes:>16,} "
            f"{p.model_segments:>10} {p.model_bytes:>16,}" + ("" if result.cold else f" {p.same_segments:>5}")
        )
    lines.append(
        f"max reserved: recorded {result.recorded_peak_reserved:,}  model {result.model_peak_reserved:,}  "
        f"({result.relative_error * 100:+.3f}%, tolerance {tolerance * 100:g}%)"
    )
    lines.append(
        f"new segments: recorded {result.recorded_segment_allocs}  model {result.model_segment_allocs}"
        + (
            ""
            if result.cold
            else f"; allocations at the recorded address: {result.same_address}/{result.allocs}"
        )
    )
    if not result.cold:
        div = result.first_divergence
        lines.append(
            "first divergent event: none"
            if div is None
            else f"first divergent event: #{div.event} {div.action}: recorded {div.recorded}, model {div.modelled}"
        )
    lines.append("within tolerance" if result.within(tolerance) else "OUTSIDE tolerance")
    return "\n".join(lines)


__all__ = [
    "DEFAULT_REPLAY_TOLERANCE",
    "Divergence",
    "PoolRow",
    "SnapshotReplay",
    "StartSegment",
    "format_replay",
    "load_snapshot",
    "options_of",
    "replay_snapshot",
    "start_state",
]
