"""Compare two memory pictures of one step (reports, CSVs, profiler traces, snapshots): how far B is from A.

A is the reference (e.g. the measured run), B the estimate (e.g. the dry run): every difference is ``B - A`` and
every relative error is ``(B - A) / A``. Both sides are first turned into the same report dict
(:func:`hyperdryrun.report.build_report` with the whole peak live set), so each figure is computed by one code path.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from hyperdryrun.report.build import build_report
from hyperdryrun.trace.blocks import CATEGORY_ORDER, STEP_PHASES, Category, Phase, live_bytes_by_task
from hyperdryrun.trace.step import StepTrace

DEFAULT_TOLERANCE = 0.01
TOP_BLOCKS = 10
MATCHING = (
    "blocks alive at each side's peak are paired greedily, first by (size, op, module), then by (size, op), "
    "then by (size, phase), then by size alone; op names are compared without their 'aten::'/'aten.' prefix and overload. "
    "What stays unpaired is listed, largest first."
)


@dataclass(frozen=True)
class Side:
    """One side of a comparison: its report dict (full peak live set) and where it came from."""

    source: str
    kind: str
    report: dict[str, Any]
    trace: StepTrace | None = None
    """Its blocks over the whole step (a trace, a snapshot, a CSV, or a report's CSV): what the step-only
    comparison reads; None for a report without its CSV."""


STEP_ONLY = (
    "the blocks allocated during the step (not those alive when it began), without the input batch (category "
    "Other: a record begun after the data was loaded does not see it), each labelled by the phase that allocated it "
    "as a record without tensor roles does (forward, recompute: Activation; backward, optimizer: Temp), at the "
    "peak of their own live bytes"
)
PHASE_CATEGORY = {
    Phase.FORWARD: Category.ACTIVATION,
    Phase.RECOMPUTE: Category.ACTIVATION,
    Phase.BACKWARD: Category.TEMP,
    Phase.OPTIMIZER: Category.TEMP,
}


def step_allocations(trace: StepTrace) -> dict[str, Any]:
    """One side's figures of :data:`STEP_ONLY` (``peak``, ``task``, ``categories`` there, ``input_bytes``: the
    batch allocated during the step) and its baseline (``initial_bytes``, ``baseline_categories``: the blocks alive
    when the step began, by category)."""
    made, baseline = [], {str(c): 0 for c in CATEGORY_ORDER}
    input_bytes = 0
    for blk in trace.blocks:
        if blk.phase is Phase.INITIALIZATION:
            baseline[str(blk.category or Category.OTHER)] += blk.size
        elif blk.category is Category.OTHER:
            input_bytes += blk.size
        else:
            made.append(blk)
    live = live_bytes_by_task(made, trace.num_tasks)
    peak = max(live, default=0)
    task = live.index(peak) if live else -1
    categories = {str(c): 0 for c in (Category.ACTIVATION, Category.TEMP)}
    for blk in made:
        if blk.start <= task < blk.end:
            categories[str(PHASE_CATEGORY[blk.phase])] += blk.size
    return {
        "peak": peak,
        "task": task,
        "categories": categories,
        "input_bytes": input_bytes,
        "initial_bytes": sum(baseline.values()),
        "baseline_categories": baseline,
    }


def step_comparison(a: Side, b: Side) -> dict[str, Any] | None:
    """:data:`STEP_ONLY` for both sides (``peak``, ``categories_at_peak``, ``input_data``) and, apart, the baseline
    difference (``baseline``: bytes alive when each side's record began, in total and by category); None when a side
    has no blocks over the step (a report without its CSV)."""
    if a.trace is None or b.trace is None:
        return None
    x, y = step_allocations(a.trace), step_allocations(b.trace)
    return {
        "rule": STEP_ONLY,
        "peak": _pair(x["peak"], y["peak"]),
        "peak_task": {"a": x["task"], "b": y["task"]},
        "categories_at_peak": {c: _pair(x["categories"][c], y["categories"][c]) for c in x["categories"]},
        "input_data": _pair(x["input_bytes"], y["input_bytes"]),
        "baseline": {
            "bytes": _pair(x["initial_bytes"], y["initial_bytes"]),
            "categories": {
                c: _pair(x["baseline_categories"][c], y["baseline_categories"][c])
                for c in x["baseline_categories"]
                if x["baseline_categories"][c] or y["baseline_categories"][c]
            },
        },
    }


def as_report(loaded: Any) -> dict[str, Any]:
    """A report dict from what :func:`hyperdryrun.report.reader.load_any` returns (a report dict or a StepTrace)."""
    if isinstance(loaded, dict):
        return loaded
    return build_report(loaded, live_set_limit=len(loaded.blocks))


def norm_op(op: str) -> str:
    """``aten::mm`` / ``aten.mm.default`` / ``mm`` -> ``mm``: the dry run names ops by overload packet."""
    for prefix in ("aten::", "aten."):
        if op.startswith(prefix):
            op = op[len(prefix) :]
            break
    return op.split(".", 1)[0]


def relative(a: int, b: int) -> float | None:
    """``(b - a) / a``; 0.0 when both are zero; None when only ``a`` is zero (no finite relative error)."""
    if a == 0:
        return 0.0 if b == 0 else None
    return round((b - a) / a, 9)


def _pair(x: int | None, y: int | None) -> dict[str, Any]:
    diff = None if x is None or y is None else y - x
    rel = None if diff is None else relative(x, y)
    return {"a": x, "b": y, "diff": diff, "rel_error": rel}


def _modules(ra: dict[str, Any], rb: dict[str, Any]) -> list[dict[str, Any]]:
    """Forward and backward local peaks of the modules both sides know by the same name."""
    ma = {m["fqn"]: m for m in ra.get("modules") or []}
    mb = {m["fqn"]: m for m in rb.get("modules") or []}
    rows = []
    for fqn in sorted(ma.keys() & mb.keys()):
        rows.append(
            {
                "module": fqn,
                "forward_peak_bytes": _pair(
                    ma[fqn].get("forward_peak_bytes"), mb[fqn].get("forward_peak_bytes")
                ),
                "backward_peak_bytes": _pair(
                    ma[fqn].get("backward_peak_bytes"), mb[fqn].get("backward_peak_bytes")
                ),
            }
        )
    return rows


COMPUTE_STREAMS = "compute"
SIDE_STREAMS = "side streams"


def _pool_rows(summary: dict[str, Any]) -> dict[tuple[str, str], dict[str, int]]:
    """Segments by (pool, compute stream | side streams): stream 0 is the compute stream on both sides (a dry run's
    id, CUDA's default stream), other ids cannot be matched across sides and are summed."""
    out: dict[tuple[str, str], dict[str, int]] = {}
    for row in summary.get("segments_by_pool") or []:
        key = (str(row["pool"]), COMPUTE_STREAMS if row["stream"] == 0 else SIDE_STREAMS)
        acc = out.setdefault(key, {"segments": 0, "bytes": 0})
        acc["segments"] += int(row["segments"])
        acc["bytes"] += int(row["bytes"])
    return out


def reserved_comparison(sa: dict[str, Any], sb: dict[str, Any]) -> dict[str, Any] | None:
    """The caching allocator's side of two summaries that both have it (a CUDA dry run, a CUDA snapshot): reserved
    peak, fragmentation there, and segments by pool and stream; None when a side has no reserved figures."""
    if "peak_reserved_bytes" not in sa or "peak_reserved_bytes" not in sb:
        return None
    pa, pb = _pool_rows(sa), _pool_rows(sb)
    empty = {"segments": 0, "bytes": 0}
    return {
        "peak_reserved": _pair(sa["peak_reserved_bytes"], sb["peak_reserved_bytes"]),
        "fragmentation": _pair(sa.get("fragmentation_bytes"), sb.get("fragmentation_bytes")),
        "segments_by_pool": [
            {
                "pool": pool,
                "streams": streams,
                "segments": _pair(
                    pa.get((pool, streams), empty)["segments"], pb.get((pool, streams), empty)["segments"]
                ),
                "bytes": _pair(
                    pa.get((pool, streams), empty)["bytes"], pb.get((pool, streams), empty)["bytes"]
                ),
            }
            for pool, streams in sorted(pa.keys() | pb.keys())
        ],
    }


def _block_view(b: dict[str, Any]) -> dict[str, Any]:
    return {k: b.get(k) for k in ("size", "category", "op", "module", "phase", "id")}


def unmatched_blocks(
    blocks_a: list[dict[str, Any]], blocks_b: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The blocks of each live set left without a partner after the pairing in :data:`MATCHING`, largest first."""
    keys = (
        lambda b: (b["size"], norm_op(b.get("op") or ""), b.get("module") or ""),
        lambda b: (b["size"], norm_op(b.get("op") or "")),
        lambda b: (b["size"], b.get("phase") or ""),
        lambda b: (b["size"],),
    )
    left_a, left_b = list(blocks_a), list(blocks_b)
    for key in keys:
        counts_b = Counter(key(b) for b in left_b)
        counts_a = Counter(key(b) for b in left_a)
        paired = counts_a & counts_b
        take_a, take_b = Counter(paired), Counter(paired)
        next_a = []
        for b in left_a:
            k = key(b)
            if take_a[k] > 0:
                take_a[k] -= 1
            else:
                next_a.append(b)
        next_b = []
        for b in left_b:
            k = key(b)
            if take_b[k] > 0:
                take_b[k] -= 1
            else:
                next_b.append(b)
        left_a, left_b = next_a, next_b

    def order(bs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return sorted(bs, key=lambda b: (-b["size"], b.get("id") or 0))

    return order(left_a), order(left_b)


def compare(
    a: Side,
    b: Side,
    tolerance: float = DEFAULT_TOLERANCE,
    top: int = TOP_BLOCKS,
    with_kernel_scratch: bool = False,
) -> dict[str, Any]:
    """The comparison as plain data (the ``--json`` output); ``within_tolerance`` decides the exit code.

    Keys: ``a``/``b`` (source, kind, peak phase and op, initial bytes, ``tensors_only``: a snapshot HyperDryRun
    wrote from a report), ``peak`` and every figure as ``{a, b, diff, rel_error}``,
    ``peak_without_kernel_scratch`` (a measured side's peak without the workspaces its kernels freed before
    returning, which a dry run never counts; ``None`` when no side has any), ``judged_on`` (which of the two the
    verdict uses: without scratch unless ``with_kernel_scratch``), ``tolerance``, ``within_tolerance``,
    ``categories_at_peak``, ``phases``, ``modules`` (names both sides know),
    ``blocks`` (``matching`` rule, ``live_sets_complete``, ``only_in_a``/``only_in_b``: count, bytes, ``top``
    largest), ``reserved`` (:func:`reserved_comparison`; None unless both sides have the caching allocator's
    figures, which a tensors-only snapshot has not), ``step_only`` (:func:`step_comparison`: what both sides see,
    and the baseline difference apart; None unless both sides have their blocks). When one side has no baseline
    (:func:`no_baseline`), the verdict is the step-only peak's (``judged_on`` ``"step_only"``).
    """
    ra, rb = a.report, b.report
    sa, sb = ra["summary"], rb["summary"]
    peak = _pair(sa["peak_bytes"], sb["peak_bytes"])
    no_scratch = [_peak_without_scratch(r) for r in (ra, rb)]
    scratch_pair = _pair(*no_scratch) if no_scratch != [sa["peak_bytes"], sb["peak_bytes"]] else None
    judged = "peak" if with_kernel_scratch or scratch_pair is None else "peak_without_kernel_scratch"
    rel = (peak if judged == "peak" else scratch_pair)["rel_error"]
    allocated = None
    if SNAPSHOT in (a.kind, b.kind) and None not in (_allocated(a), _allocated(b)):
        # a CUDA snapshot's blocks are the allocator's (workspaces and unsplit remainders included): what a dry run
        # of a CUDA target calls allocated, not its tensor peak
        allocated = _pair(_allocated(a), _allocated(b))
        judged, rel = "allocated", allocated["rel_error"]
    cats_a, cats_b = sa["breakdown_at_peak"], sb["breakdown_at_peak"]
    categories = {
        str(c): _pair(int(cats_a.get(str(c), 0)), int(cats_b.get(str(c), 0))) for c in CATEGORY_ORDER
    }
    pa, pb = ra.get("phases") or {}, rb.get("phases") or {}
    phases = {
        str(p): _pair(pa.get(str(p), {}).get("peak_bytes"), pb.get(str(p), {}).get("peak_bytes"))
        for p in STEP_PHASES
        if str(p) in pa or str(p) in pb
    }
    tensors_only = _tensors_only(a), _tensors_only(b)
    la, lb = ra["peak_live_set"], rb["peak_live_set"]
    only_a, only_b = unmatched_blocks(la["blocks"], lb["blocks"])

    complete = la["shown"] == la["num_blocks"] and lb["shown"] == lb["num_blocks"]
    result = {
        "a": {
            "source": a.source,
            "kind": a.kind,
            "peak_phase": sa.get("peak_phase"),
            "peak_op": sa.get("peak_op"),
            "initial_bytes": sa.get("initial_bytes"),
            "tensors_only": tensors_only[0],
        },
        "b": {
            "source": b.source,
            "kind": b.kind,
            "peak_phase": sb.get("peak_phase"),
            "peak_op": sb.get("peak_op"),
            "initial_bytes": sb.get("initial_bytes"),
            "tensors_only": tensors_only[1],
        },
        "peak": peak,
        "allocated": allocated,
        "peak_without_kernel_scratch": scratch_pair,
        "judged_on": judged,
        "tolerance": tolerance,
        "within_tolerance": rel is not None and abs(rel) <= tolerance,
        "step_only": step_comparison(a, b),
        "categories_at_peak": categories,
        "phases": phases,
        "modules": _modules(ra, rb),
        # a tensors-only snapshot's segments are not an allocator's: nothing reserved to compare with
        "reserved": None if any(tensors_only) else reserved_comparison(sa, sb),
        "blocks": {
            "matching": MATCHING,
            "live_sets_complete": complete,
            "only_in_a": {
                "count": len(only_a),
                "bytes": sum(x["size"] for x in only_a),
                "largest": [_block_view(x) for x in only_a[:top]],
            },
            "only_in_b": {
                "count": len(only_b),
                "bytes": sum(x["size"] for x in only_b),
                "largest": [_block_view(x) for x in only_b[:top]],
            },
        },
    }
    step = result["step_only"]
    if no_baseline(result) and step is not None:  # whole-step figures leave out one side's residents
        result["judged_on"] = "step_only"
        rel = step["peak"]["rel_error"]
        result["within_tolerance"] = rel is not None and abs(rel) <= tolerance
    return result


SNAPSHOT = "cuda_snapshot"
"""The kind of a CUDA memory snapshot side: its blocks are the caching allocator's, without categories or phases."""


def _tensors_only(side: Side) -> bool:
    """A snapshot HyperDryRun wrote from a report: its blocks are that report's tensors, and its segments are made
    to hold them, not the caching allocator's (which only the report itself has)."""
    return side.kind == SNAPSHOT and not (side.report.get("metadata") or {}).get("allocator_blocks", True)


def _allocated(side: Side) -> int | None:
    """A side's ``max_memory_allocated``: a CUDA snapshot's peak (its blocks are the allocator's), a dry run's
    ``peak_allocated_bytes``; None where the side has no such figure."""
    summary = side.report["summary"]
    if side.kind == SNAPSHOT:
        return None if _tensors_only(side) else int(summary["peak_bytes"])
    value = summary.get("peak_allocated_bytes")
    return None if value is None else int(value)


def _peak_without_scratch(report: dict[str, Any]) -> int:
    scratch = (report.get("metadata") or {}).get("kernel_scratch") or {}
    return int(scratch.get("peak_bytes_excluding", report["summary"]["peak_bytes"]))


def no_baseline(result: dict[str, Any]) -> str | None:
    """``"a"`` or ``"b"``: the side that has no baseline (no bytes resident at its first task, e.g. a profiler trace
    started after the model was built) while the other has one; None when both or neither have one."""
    initial = {side: result[side].get("initial_bytes") for side in ("a", "b")}
    empty = [side for side, n in initial.items() if n == 0]
    return empty[0] if len(empty) == 1 and (initial["b" if empty[0] == "a" else "a"] or 0) > 0 else None


def print_comparison(result: dict[str, Any], console: Any = None, top: int = TOP_BLOCKS) -> None:
    """The human view of :func:`compare`'s result: rich tables, bytes in GiB/MiB, differences as B - A (module
    rows: the ``top`` largest differences; ``--json`` has them all)."""
    from rich.console import Console
    from rich.table import Table

    from hyperdryrun.report.schema import human_bytes

    console = console or Console()

    def fmt(n: int | None) -> str:
        return "-" if n is None else human_bytes(n)

    unbased = no_baseline(result)

    def pct(r: float | None) -> str:
        return "-" if r is None or unbased else f"{100 * r:+.3f}%"

    p = result["peak"]
    verdict = "[green]within[/]" if result["within_tolerance"] else "[red]outside[/]"
    console.print(f"A: {result['a']['source']} ({result['a']['kind']})")
    console.print(f"B: {result['b']['source']} ({result['b']['kind']})")
    console.print(
        f"peak A {fmt(p['a'])} ({p['a']:,} B), B {fmt(p['b'])} ({p['b']:,} B): "
        f"B - A = {p['diff']:+,} B" + ("" if unbased else f" ({pct(p['rel_error'])})")
    )

    al = result.get("allocated")
    if al:
        console.print(
            f"allocated A {al['a']:,} B, B {al['b']:,} B: B - A = {al['diff']:+,} B ({pct(al['rel_error'])}) <- judged "
            "(the snapshot's blocks are the caching allocator's: cuBLAS workspaces and blocks handed out whole "
            "included, as in the dry run's allocated figure)"
        )
    ns = result.get("peak_without_kernel_scratch")
    if ns:
        judged = result["judged_on"] == "peak_without_kernel_scratch"
        console.print(
            f"without measured kernel scratch: A {ns['a']:,} B, B {ns['b']:,} B: B - A = {ns['diff']:+,} B "
            f"({pct(ns['rel_error'])}){' <- judged' if judged else ''} (a dry run does not count kernel "
            "workspaces; --with-kernel-scratch judges the full peak)"
        )
    step = result.get("step_only")
    on_step = result["judged_on"] == "step_only"
    console.print(
        f"{verdict} tolerance {100 * result['tolerance']:g}%" + (" on the step only" if on_step else "")
    )
    if unbased:
        other = "b" if unbased == "a" else "a"
        console.print(
            f"no relative figures for the whole step: {unbased.upper()} has no baseline (nothing was resident when "
            f"its record began, against {fmt(result[other]['initial_bytes'])} on {other.upper()}), so its bytes "
            "leave out what existed before and a ratio to them means nothing; B - A shows the difference"
            + ("; the step only is compared below" if step else "")
        )

    def table(title: str, rows: list[tuple[str, dict[str, Any]]], relative: bool = False) -> None:
        t = Table(title=title, title_justify="left", show_edge=False)
        for col in ("", "A", "B", "B - A", "rel"):
            t.add_column(col, justify="left" if not col else "right")
        for name, row in rows:
            diff = "-" if row["diff"] is None else f"{row['diff']:+,} B"
            rel = "-" if row["rel_error"] is None else f"{100 * row['rel_error']:+.3f}%"
            t.add_row(name, fmt(row["a"]), fmt(row["b"]), diff, rel if relative else pct(row["rel_error"]))
        console.print(t)

    if unbased and step:
        sp = step["peak"]
        console.print(f"step only: {step['rule']}")
        table(
            "step only: its peak and the categories there" + (" <- judged" if on_step else ""),
            [
                ("peak", sp),
                *step["categories_at_peak"].items(),
                ("input batch (left out)", step["input_data"]),
            ],
            relative=True,
        )
        base = step["baseline"]
        table(
            "baseline, apart: bytes alive when each record began",
            [("total", base["bytes"]), *base["categories"].items()],
        )

    snapshot = [side.upper() for side in ("a", "b") if result[side]["kind"] == SNAPSHOT]
    if snapshot:
        console.print(
            f"no categories or phase peaks: {' and '.join(snapshot)} is a CUDA snapshot, whose blocks carry neither "
            "(--json has the guesses)"
        )
    else:
        table(
            "categories at each side's peak",
            [(c, r) for c, r in result["categories_at_peak"].items() if r["a"] or r["b"]],
        )
        table("phase peaks", list(result["phases"].items()))
    res = result.get("reserved")
    written = [side.upper() for side in ("a", "b") if result[side]["tensors_only"]]
    if written:
        console.print(
            f"no caching-allocator comparison: {' and '.join(written)} is a snapshot HyperDryRun wrote from a "
            "report, which holds its tensors only (the report has the reserved figures)"
        )
    if res:
        rows = [("peak reserved", res["peak_reserved"]), ("fragmentation at it", res["fragmentation"])]
        for row in res["segments_by_pool"]:
            segs = row["segments"]
            rows.append((f"{row['pool']}/{row['streams']} ({segs['a']}/{segs['b']} segments)", row["bytes"]))
        table("caching allocator (reserved)", rows)
    if result["modules"]:
        rows = []
        for m in result["modules"]:
            rows.append((f"{m['module']} fw", m["forward_peak_bytes"]))
            rows.append((f"{m['module']} bw", m["backward_peak_bytes"]))
        ranked = sorted(rows, key=lambda r: -abs(r[1]["diff"] or 0))[:top]
        table(f"module local peaks ({len(ranked)} of {len(rows)}, largest |B - A| first)", ranked)
    for side in ("a", "b"):
        info = result["blocks"][f"only_in_{side}"]
        if not info["count"]:
            console.print(f"every block alive at {side.upper()}'s peak has a partner in the other live set")
            continue
        t = Table(
            title=f"only in {side.upper()}'s peak live set: {info['count']} blocks, {fmt(info['bytes'])}",
            title_justify="left",
            show_edge=False,
        )
        for col in ("MiB", "category", "op", "module", "phase"):
            t.add_column(col, justify="right" if col == "MiB" else "left", overflow="fold")
        for b in info["largest"]:
            t.add_row(f"{b['size'] / (1 << 20):,.3f}", b["category"], b["op"], b["module"], b["phase"])
        console.print(t)
    if not result["blocks"]["live_sets_complete"]:
        console.print(
            "[yellow]a side's peak live set is truncated (JSON without its CSV): block lists partial[/]"
        )
