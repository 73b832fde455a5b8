"""The one table of ``fit``, for every front door: the built-in recipe's layout search (``hyperdryrun fit``, Hugging
Face configs included), a script's declared layouts (``script --fit``) and torchtitan's degrees
(``torchtitan --fit``) print the same columns, the step-time estimate where the job gives its FLOPs."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

COLUMNS = (
    "#", "layout", "mbs x n", "AC", "est. step", "tok/s/GPU", "allocated", "reserved", "device", "headroom",
    "verdict", "worst rank", "classes", "method",
)  # fmt: skip
"""The columns, in order (``—`` where a job does not say: a script's micro batches, a job without FLOPs)."""
LEFT = ("layout", "AC", "verdict", "method")
VERDICTS = {
    "fits": "[green]fits[/]",
    "at_risk": "[yellow]at risk[/]",
    "oom": "[red]OOM[/]",
    "invalid": "[yellow]invalid[/]",
    "error": "[red]error[/]",
}


@dataclass
class LayoutRow:
    """One layout of a fit table: its figures are the worst rank class's (``None``: not known, shown ``—``)."""

    index: int
    layout: str
    verdict: str
    """A key of :data:`VERDICTS`."""
    batch: str | None = None
    """``micro batch size x micro batches``."""
    ac: str | None = None
    step_s: float | None = None
    tokens_per_s_per_gpu: float | None = None
    allocated: int | None = None
    reserved: int | None = None
    device: int | None = None
    headroom: int | None = None
    worst_rank: int | None = None
    classes: int | None = None
    method: str = ""
    reason: str = ""
    """Why a layout is invalid or failed (shown after its verdict)."""
    chosen: bool = False


def _gib(n: int | None) -> str:
    return "—" if n is None else f"{n / 2**30:,.2f}"


def seconds(s: float | None) -> str:
    """``11 ms``, ``11.08 s``, ``—``."""
    if s is None:
        return "—"
    if s < 1e-3:
        return f"{s * 1e6:,.0f} µs"
    return f"{s * 1e3:,.0f} ms" if s < 1 else f"{s:,.2f} s"


NARROW_LEFT_OUT = ("method", "classes", "worst rank", "tok/s/GPU", "allocated", "reserved", "device")
"""The columns a terminal too narrow for the whole table goes without, first to last, after the columns with no
value in any row; never the figure the fit is judged on (:func:`judged_figure`), its headroom or verdict: rich
would otherwise cut every cell to a letter and an ellipsis."""
FIGURES = ("device", "reserved", "allocated")
"""The peak figures, most complete first: fit judges a layout on the most complete one its results have."""


def judged_figure(rows: list[LayoutRow]) -> str:
    """The column of :data:`FIGURES` the verdicts read: the most complete one that any row has."""
    return next((f for f in FIGURES if any(_cells(r)[f] != "—" for r in rows)), "device")


def layout_table(rows: list[LayoutRow], title: str | None = None, width: int | None = None) -> Any:
    """The rich table of ``rows`` (:data:`COLUMNS`). With a ``width`` (a terminal's) narrower than the table: first
    without the column rules, then without the columns that it takes to fit, in :data:`NARROW_LEFT_OUT`'s order
    after the empty ones, named in the caption."""
    from hyperdryrun.report.console import fit_to_width

    keep = {"#", "layout", "headroom", "verdict", judged_figure(rows)}
    empty = [c for c in COLUMNS if c not in keep and all(_cells(r)[c] == "—" for r in rows)]
    left_out_order = [*empty, *(c for c in NARROW_LEFT_OUT if c not in keep and c not in empty)]
    short = [replace(r, reason="") for r in rows]  # the verdicts' reasons may wrap: not counted in the width
    return fit_to_width(
        lambda columns, ruled: _table(rows, title, columns, ruled),
        COLUMNS,
        left_out_order,
        width,
        "a wider terminal shows them",
        measure=lambda columns, ruled: _table(short, None, columns, ruled),
    )


def _table(rows: list[LayoutRow], title: str | None, columns: Any, ruled: bool = True) -> Any:
    from rich import box
    from rich.table import Table

    t = Table(
        box=box.HEAVY_HEAD if ruled else box.SIMPLE_HEAD,
        collapse_padding=not ruled,  # unruled: one space either side of a column's gap, not two
        title=title,
        title_justify="left",
        title_style="bold",
        show_edge=False,
        pad_edge=False,
        header_style="bold",
    )
    for col in columns:
        t.add_column(col, justify="left" if col in LEFT else "right", no_wrap=col == "layout")
    for r in rows:
        cells = _cells(r)
        t.add_row(*(cells[c] for c in columns))
    return t


def _cells(r: LayoutRow) -> dict[str, str]:
    """Row ``r``'s text, by column."""
    verdict = VERDICTS[r.verdict] + (" (chosen)" if r.chosen else "") + (f": {r.reason}" if r.reason else "")
    return dict(zip(COLUMNS, (
        str(r.index), r.layout, r.batch or "—", r.ac or "—", seconds(r.step_s),
        "—" if r.tokens_per_s_per_gpu is None else f"{r.tokens_per_s_per_gpu:,.0f}",
        _gib(r.allocated), _gib(r.reserved), _gib(r.device), _gib(r.headroom), verdict,
        "—" if r.worst_rank is None else str(r.worst_rank), "—" if r.classes is None else str(r.classes),
        r.method or "—",
    ), strict=True))  # fmt: skip


__all__ = ["COLUMNS", "FIGURES", "NARROW_LEFT_OUT", "LayoutRow", "judged_figure", "layout_table", "seconds"]
