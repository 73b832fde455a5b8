"""PNG plots (matplotlib, the ``viz`` extra): the memory timeline of a rank and what its peak consists of.

Figures are drawn on matplotlib's object API with the Agg canvas, never through ``pyplot``: no global backend or
figure registry is touched.
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hyperdryrun.report.schema import human_bytes
from hyperdryrun.trace.blocks import CATEGORY_ORDER, Phase
from hyperdryrun.viz.data import Side, as_sides, category_timeline, phase_spans
from hyperdryrun.viz.files import write_atomic
from hyperdryrun.viz.style import (
    CATEGORY_COLORS,
    DEVICE_COLOR,
    PEAK_COLOR,
    PHASE_COLORS,
    RESERVED_COLOR,
    SIDE_COLORS,
    byte_unit,
)

EXTRA = "viz"
DPI = 110
SERIES_COLORS = {"reserved": RESERVED_COLOR, "device": DEVICE_COLOR}


class MissingExtra(ImportError):
    """An optional dependency that a picture needs is not installed; the message names the extra."""


def require_matplotlib() -> None:
    """Raise :class:`MissingExtra` (naming the extra) unless matplotlib can be imported."""
    try:
        import matplotlib.backends.backend_agg  # noqa: F401
        import matplotlib.figure  # noqa: F401
    except ImportError:
        raise MissingExtra(
            f"PNG plots need matplotlib, which is not installed: pip install 'hyperdryrun[{EXTRA}]'"
        ) from None


def _figure(width: float, height: float) -> Any:
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, metadata={"Software": None})
    return buf.getvalue()


def slug(label: str) -> str:
    """A file-name form of a side's label: ``rank 0`` -> ``rank_0``."""
    return re.sub(r"[^A-Za-z0-9]+", "_", label).strip("_") or "side"


def _title(side: Side) -> str:
    meta = side.report.get("metadata") or {}
    parts = [str(meta.get("model") or meta.get("source") or side.label)]
    if isinstance(meta.get("rank"), int) and isinstance(meta.get("world_size"), int):
        parts.append(f"rank {meta['rank']} of {meta['world_size']}")
    if meta.get("mode") and meta.get("mode") != "dry-run":
        parts.append(str(meta["mode"]))
    return " · ".join(parts)


def _style_axes(ax: Any, unit: str, xlabel: str) -> None:
    """Axes in ``unit`` (the data is already divided by it, so ticks land on round numbers of it)."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"memory ({unit})")
    ax.grid(axis="y", color="#dddddd", linewidth=0.6)
    ax.set_axisbelow(True)
    for spine in ("top", "right"):
        ax.spines[spine].set_visible(False)


def _phase_bands(ax: Any, trace: Any) -> list[Any]:
    """Pale bands per phase run, labelled where wide enough; returns one legend handle per phase present."""
    from matplotlib.patches import Patch

    n = trace.num_tasks
    seen: dict[str, Any] = {}
    for name, start, end in phase_spans(trace):
        color = PHASE_COLORS[Phase(name)]
        ax.axvspan(start, end, color=color, zorder=0, linewidth=0)
        seen.setdefault(
            name, Patch(facecolor=color, edgecolor="#bbbbbb", linewidth=0.5, label=f"{name} (phase)")
        )
        if (end - start) >= 0.06 * n:
            ax.text(
                (start + end) / 2, 1.0, name, transform=ax.get_xaxis_transform(), ha="center", va="bottom",
                fontsize=9, color="#555555",
            )  # fmt: skip
    return list(seen.values())


def timeline_png(side: Side) -> bytes:
    """The memory of one rank over the step's tasks, stacked by category, phases as bands, the peak marked."""
    trace = side.trace
    summary = side.report["summary"]
    series = category_timeline(trace)
    n = trace.num_tasks
    peak, peak_task = summary["peak_bytes"], summary["peak_task"]
    top = max([peak, *(max(v, default=0) for v in side.series.values())])
    unit, divisor = byte_unit(top)
    fig = _figure(11, 4.6)
    ax = fig.add_subplot()
    phases = _phase_bands(ax, trace)
    x = list(range(n + 1))
    shown = [c for c in CATEGORY_ORDER if any(series[str(c)])]
    ys = [[v / divisor for v in series[str(c)] + series[str(c)][-1:]] for c in shown]
    ax.stackplot(
        x, ys, labels=[str(c) for c in shown], colors=[CATEGORY_COLORS[c] for c in shown], step="post",
        linewidth=0, zorder=2,
    )  # fmt: skip
    for name, values in side.series.items():
        ax.step(
            x, [v / divisor for v in list(values) + list(values[-1:])], where="post", color=SERIES_COLORS.get(name, DEVICE_COLOR),
            linewidth=1.3, linestyle="--", label=name, zorder=3,
        )  # fmt: skip
    ax.plot(
        [peak_task + 0.5],
        [peak / divisor],
        marker="v",
        color=PEAK_COLOR,
        markersize=8,
        zorder=4,
        linestyle="none",
    )
    ax.axvline(peak_task + 0.5, color=PEAK_COLOR, linewidth=0.8, linestyle=":", zorder=3)
    label = f"peak {human_bytes(peak)}\ntask {peak_task} · {summary.get('peak_op') or ''}"
    right = peak_task > 0.6 * n
    ax.annotate(
        label, (peak_task + 0.5, peak / divisor), xytext=(-10 if right else 10, -4), textcoords="offset points",
        ha="right" if right else "left", va="top", fontsize=9, zorder=5,
        bbox={"boxstyle": "round,pad=0.3", "facecolor": "white", "edgecolor": "#999999", "alpha": 0.9},
    )  # fmt: skip
    ax.set_xlim(0, n)
    ax.set_ylim(0, top * 1.08 / divisor if top else 1)
    _style_axes(ax, unit, "task (operators of the step, in order)")
    handles, _ = ax.get_legend_handles_labels()
    ax.legend(
        handles=handles[::-1] + phases, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False, fontsize=9
    )
    fig.suptitle(f"{_title(side)}: memory over the step", x=0.01, ha="left", fontsize=12)
    return _png(fig)


def breakdown_png(side: Side) -> bytes:
    """What the peak consists of: one bar per category, with bytes and share of the peak."""
    summary = side.report["summary"]
    breakdown = summary["breakdown_at_peak"]
    peak = summary["peak_bytes"]
    cats = [c for c in CATEGORY_ORDER if breakdown.get(str(c), 0)]
    values = [breakdown[str(c)] for c in cats]
    unit, divisor = byte_unit(max(values, default=0))
    fig = _figure(7, 0.45 * len(cats) + 1.5)
    ax = fig.add_subplot()
    ypos = list(range(len(cats)))[::-1]
    ax.barh(ypos, [v / divisor for v in values], color=[CATEGORY_COLORS[c] for c in cats], height=0.7)
    ax.set_yticks(ypos, [str(c) for c in cats])
    for y, v in zip(ypos, values, strict=True):
        share = 100 * v / peak if peak else 0.0
        ax.text(v / divisor, y, f"  {human_bytes(v)}  ({share:.1f}%)", va="center", ha="left", fontsize=9)
    ax.set_xlim(0, max(values, default=1) * 1.4 / divisor)
    ax.set_xlabel(f"memory ({unit})")
    for spine in ("top", "right"):
        ax.spines[spine].set_visible(False)
    where = f"task {summary['peak_task']} · {summary.get('peak_phase')} · {summary.get('peak_op')}"
    fig.suptitle(f"{_title(side)}: peak {human_bytes(peak)}\n{where}", x=0.01, ha="left", fontsize=11)
    return _png(fig)


def sides_png(sides: Sequence[Side], compare: bool = False) -> bytes:
    """Several ranks (x: task) or both sides of a comparison (x: share of the step) on one axis, peaks marked."""
    drawn = [s for s in sides if s.trace is not None]
    top = max((s.report["summary"]["peak_bytes"] for s in drawn), default=0)
    unit, divisor = byte_unit(top)
    fig = _figure(11, 4.6)
    ax = fig.add_subplot()
    from hyperdryrun.trace.blocks import live_bytes_by_task

    for i, s in enumerate(drawn):
        n = s.trace.num_tasks
        live = live_bytes_by_task(s.trace.blocks, n)
        scale = 100 / n if compare else 1
        x = [t * scale for t in range(n + 1)]
        color = SIDE_COLORS[i % len(SIDE_COLORS)]
        peak, task = s.report["summary"]["peak_bytes"], s.report["summary"]["peak_task"]
        ax.step(x, [v / divisor for v in live + live[-1:]], where="post", color=color, linewidth=1.2,
                label=f"{s.label}: peak {human_bytes(peak)}")  # fmt: skip
        ax.plot(
            [(task + 0.5) * scale], [peak / divisor], marker="v", color=color, markersize=7, linestyle="none"
        )
    ax.set_ylim(0, top * 1.08 / divisor if top else 1)
    ax.set_xlim(0, 100 if compare else max((s.trace.num_tasks for s in drawn), default=1))
    _style_axes(ax, unit, "share of the step (%)" if compare else "task (operators of the step, in order)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False, fontsize=9)
    title = " vs ".join(s.label for s in drawn) if compare else f"{_title(drawn[0]).split(' · ')[0]}: ranks"
    fig.suptitle(f"{title}: memory over the step", x=0.01, ha="left", fontsize=12)
    return _png(fig)


def render_plots(
    sides: Sequence[Side | tuple[dict[str, Any], Any]], out_dir: str | os.PathLike, compare: bool = False
) -> list[tuple[Path, bytes]]:
    """The PNGs of :func:`write_plots` as (path, bytes), drawn and not yet written (so that a command can check every
    path and write all its outputs together)."""
    sides = as_sides(sides)
    out = Path(out_dir)
    files = []
    for s in sides:
        if s.trace is not None:
            files.append((out / f"timeline_{slug(s.label)}.png", timeline_png(s)))
        files.append((out / f"breakdown_{slug(s.label)}.png", breakdown_png(s)))
    if len([s for s in sides if s.trace is not None]) > 1:
        name = "compare.png" if compare else "ranks.png"
        files.append((out / name, sides_png(sides, compare)))
    return files


def write_plots(
    sides: Sequence[Side | tuple[dict[str, Any], Any]], out_dir: str | os.PathLike, compare: bool = False
) -> list[Path]:
    """``timeline_<side>.png`` and ``breakdown_<side>.png`` for each side, and ``ranks.png`` (several ranks) or
    ``compare.png`` (a comparison) with all sides on one axis; returns the paths written.

    A side without a trace (a JSON report without its CSV) gets its breakdown only.
    """
    return [write_atomic(path, data) for path, data in render_plots(sides, out_dir, compare)]
