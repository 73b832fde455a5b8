"""One self-contained HTML page of a run's memory: opens from disk with no network (every script and style inlined).

The page shows, for each rank (or each side of a comparison): the timeline stacked by category with the phases as
bands and the peak marked (plus reserved / device lines when an allocator model supplies them), what the peak
consists of, the phase peaks, the live set at the peak or at any clicked task as a sortable, filterable table whose
rows open the allocating Python stack, and the per-module forward/backward peaks; for several sides, one line per
side on one axis and a table of their peaks. The data rides in the page as JSON; ``assets/report.js`` draws it with
uPlot (bundled, MIT).
"""

from __future__ import annotations

import html
import json
import os
import re
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from hyperdryrun.report.console import by_unit
from hyperdryrun.trace.blocks import CATEGORY_ORDER, PERSISTENT_END, Category, Phase
from hyperdryrun.version import __version__
from hyperdryrun.viz.data import Side, as_sides, category_timeline, phase_spans
from hyperdryrun.viz.files import write_atomic
from hyperdryrun.viz.style import (
    CATEGORY_COLORS,
    DEVICE_COLOR,
    PEAK_COLOR,
    PHASE_COLORS,
    RESERVED_COLOR,
    SIDE_COLORS,
)

UPLOT_VERSION = "1.6.32"
SELECT_COLOR = "#c0392b"
PHASE_ORDER = list(Phase)
_CAT_INDEX = {c: i for i, c in enumerate(CATEGORY_ORDER)}
_PHASE_INDEX = {p: i for i, p in enumerate(PHASE_ORDER)}


def _asset(name: str) -> str:
    return resources.files("hyperdryrun.viz").joinpath("assets", name).read_text(encoding="utf-8")


class _Strings:
    """Interned strings of one side: each op, module, file and function name is written once."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {}
        self.table: list[str] = []

    def __call__(self, s: str) -> int:
        i = self.index.get(s)
        if i is None:
            i = self.index[s] = len(self.table)
            self.table.append(s)
        return i


def _change_points(values: list[int]) -> list[list[int]]:
    """``[[task...], [value...]]`` where the value changes (task 0 always): the page holds each series as a step."""
    tasks, out = [], []
    last = None
    for t, v in enumerate(values):
        if v != last:
            tasks.append(t)
            out.append(v)
            last = v
    return [tasks, out]


def heading(report: dict[str, Any]) -> str:
    """Who the picture is of: model, rank of world, layout, device (what metadata there is)."""
    md = report.get("metadata") or {}
    parts = [str(md.get("model") or md.get("source") or "memory report")]
    if isinstance(md.get("rank"), int) and isinstance(md.get("world_size"), int):
        parts.append(f"rank {md['rank']} of {md['world_size']}")
    par = md.get("parallel") or {}
    layout = " ".join(f"{k}={v}" for k, v in par.items() if isinstance(v, int) and v > 1)
    if layout:
        parts.append(layout)
    if md.get("target_device"):
        parts.append(str(md["target_device"]))
    return " · ".join(parts)


def _blocks_from_trace(trace: Any, strings: _Strings) -> tuple[dict[str, list[int]], list[list[list[int]]]]:
    cols: dict[str, list[int]] = {
        k: [] for k in ("id", "size", "requested", "start", "end", "cat", "op", "module", "phase", "stack")
    }
    stack_ids: dict[int, int] = {}
    stacks: list[list[list[int]]] = []
    for b in trace.blocks:
        sid = stack_ids.get(b.stack_id)
        if sid is None:
            sid = stack_ids[b.stack_id] = len(stacks)
            stacks.append([[strings(f), ln, strings(fn)] for f, ln, fn in trace.stacks.frames(b.stack_id)])
        cols["id"].append(b.id)
        cols["size"].append(b.size)
        cols["requested"].append(b.requested)
        cols["start"].append(b.start)
        cols["end"].append(-1 if b.end >= PERSISTENT_END else b.end)
        cols["cat"].append(_CAT_INDEX[b.category or Category.OTHER])
        cols["op"].append(strings(b.op))
        cols["module"].append(strings(b.module))
        cols["phase"].append(_PHASE_INDEX[b.phase])
        cols["stack"].append(sid)
    return cols, stacks


def _blocks_from_report(report: dict[str, Any], strings: _Strings) -> tuple[dict[str, list[int]], list[Any]]:
    """The JSON's own peak live set (its largest blocks), for a report without its CSV."""
    cols: dict[str, list[int]] = {
        k: [] for k in ("id", "size", "requested", "start", "end", "cat", "op", "module", "phase", "stack")
    }
    stacks = []
    for rec in report["peak_live_set"]["blocks"]:
        stacks.append(
            [[strings(f["file"]), f["line"], strings(f["function"])] for f in rec.get("stack") or ()]
        )
        cols["id"].append(rec["id"])
        cols["size"].append(rec["size"])
        cols["requested"].append(rec.get("requested", rec["size"]))
        cols["start"].append(rec["start"])
        cols["end"].append(-1 if rec.get("end") is None else rec["end"])
        cols["cat"].append(_CAT_INDEX[Category(rec["category"])])
        cols["op"].append(strings(rec["op"]))
        cols["module"].append(strings(rec["module"]))
        cols["phase"].append(_PHASE_INDEX[Phase(rec["phase"])])
        cols["stack"].append(len(stacks) - 1)
    return cols, stacks


def side_data(side: Side) -> dict[str, Any]:
    """What the page needs of one side, as plain JSON-ready data (bytes stay integers)."""
    report, trace = side.report, side.trace
    strings = _Strings()
    timeline = None
    if trace is not None:
        cats = category_timeline(trace)
        total = [sum(v) for v in zip(*cats.values(), strict=True)] if trace.num_tasks else []
        timeline = {
            "n": trace.num_tasks,
            "cats": {name: _change_points(v) for name, v in cats.items()},
            "total": _change_points(total),
            "spans": [list(s) for s in phase_spans(trace)],
            "taskOp": [strings(op) for op in trace.task_op],
            "taskPhase": [_PHASE_INDEX[p or Phase.INITIALIZATION] for p in trace.task_phase],
            "series": {name: _change_points(list(v)) for name, v in side.series.items()},
        }
        blocks, stacks = _blocks_from_trace(trace, strings)
    else:
        blocks, stacks = _blocks_from_report(report, strings)
    md = report.get("metadata") or {}
    live = report.get("peak_live_set") or {}
    return {
        "label": side.label,
        "source": side.source,
        "heading": heading(report),
        "mode": str(md.get("mode") or "dry-run"),
        "summary": report["summary"],
        "phases": report.get("phases") or {},
        "modules": [
            [
                m["fqn"],
                m["param_bytes"],
                m["forward_peak_bytes"],
                m["backward_peak_bytes"],
                m["bytes_allocated_by_module_at_peak"],
                m["calls"],
            ]
            for m in report.get("modules") or ()
        ],
        "byModule": [
            {"module": name, "bytes": n, "children": kids, "largest": largest}
            for name, n, kids, largest in by_unit(live)
        ]
        if live.get("by_top_level_module")
        else [],
        "limitations": report.get("limitations") or [],
        "timeline": timeline,
        "blocksScope": "all" if trace is not None else "peak",
        "blocks": blocks,
        "stacks": stacks,
        "strings": strings.table,
    }


def page_data(sides: Sequence[Side], compare: bool = False, title: str | None = None) -> dict[str, Any]:
    """The JSON the page draws: every side, and the colours shared with the PNG plots."""
    if not sides:
        raise ValueError("sides: at least one report is needed (got none)")
    if title is None:
        title = " vs ".join(s.label for s in sides) if compare else heading(sides[0].report)
        if not compare and len(sides) > 1:
            title = f"{title.split(' · ')[0]} · {len(sides)} ranks"
    return {
        "title": title,
        "compare": compare,
        "version": __version__,
        "categories": [{"name": str(c), "color": CATEGORY_COLORS[c]} for c in CATEGORY_ORDER],
        "phases": [{"name": str(p), "color": PHASE_COLORS[p]} for p in PHASE_ORDER],
        "sideColors": SIDE_COLORS,
        "peakColor": PEAK_COLOR,
        "selectColor": SELECT_COLOR,
        "seriesColors": {"reserved": RESERVED_COLOR, "device": DEVICE_COLOR},
        "sides": [side_data(s) for s in sides],
    }


def _script_json(data: Any) -> str:
    # Inside <script>, "<" is the only character that can end the element early; \u003c reads the same in JSON.
    return json.dumps(data, separators=(",", ":"), allow_nan=False).replace("<", "\\u003c")


def render_html(
    sides: Sequence[Side | tuple[dict[str, Any], Any]], compare: bool = False, title: str | None = None
) -> str:
    """The page as one string: template, styles, uPlot, the page's code and the data, all inline."""
    data = page_data(as_sides(sides), compare, title)
    parts = {
        "/*HDR:TITLE*/": html.escape(data["title"]),
        "/*HDR:VERSION*/": html.escape(__version__),
        "/*HDR:UPLOT_VERSION*/": UPLOT_VERSION,
        "/*HDR:UPLOT_LICENSE*/": html.escape(_asset("LICENSE.uPlot")),
        "/*HDR:UPLOT_CSS*/": _asset("uPlot.min.css"),
        "/*HDR:CSS*/": _asset("report.css"),
        "/*HDR:UPLOT_JS*/": _asset("uPlot.iife.min.js"),
        "/*HDR:JS*/": _asset("report.js"),
        "/*HDR:DATA*/": _script_json(data),
    }
    return re.sub(r"/\*HDR:[A-Z_]+\*/", lambda m: parts[m[0]], _asset("report.html"))


def write_html(
    sides: Sequence[Side | tuple[dict[str, Any], Any]],
    path: str | os.PathLike,
    compare: bool = False,
    title: str | None = None,
) -> Path:
    """Write the page of ``sides`` (ranks of one run, or the two sides of a comparison) to ``path``.

    A side is a :class:`Side` or a ``(report, trace)`` pair (trace None for a JSON report alone)."""
    return write_atomic(path, render_html(sides, compare, title).encode("utf-8"))
