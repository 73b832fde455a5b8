"""The one table of ``fit``, for every front door: the built-in recipe's layout search (``hyperdryrun fit``, Hugging
Face configs included), a script's declared layouts (``script --fit``) and torchtitan's degrees
(``torchtitan --fit``) print the same columns, the step-time estimate where the job gives its FLOPs."""

from __future__ import annotations

from dataclasses import dataclass
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


def layout_table(rows: list[LayoutRow], title: str | None = None) -> Any:
    """The rich table of ``rows`` (:data:`COLUMNS`)."""
    from rich.table import Table

    t = Table(
        title=title,
        title_justify="left",
        title_style="bold",
        show_edge=False,
        pad_edge=False,
        header_style="bold",
    )
    for col in COLUMNS:
        t.add_column(col, justify="left" if col in LEFT else "right", no_wrap=col == "layout")
    for r in rows:
        verdict = (
            VERDICTS[r.verdict] + (" (chosen)" if r.chosen else "") + (f": {r.reason}" if r.reason else "")
        )
        t.add_row(
            str(r.index), r.layout, r.batch or "—", r.ac or "—", seconds(r.step_s),
            "—" if r.tokens_per_s_per_gpu is None else f"{r.tokens_per_s_per_gpu:,.0f}",
            _gib(r.allocated), _gib(r.reserved), _gib(r.device), _gib(r.headroom), verdict,
            "—" if r.worst_rank is None else str(r.worst_rank), "—" if r.classes is None else str(r.classes),
            r.method or "—",
        )  # fmt: skip
    return t


__all__ = ["COLUMNS", "LayoutRow", "layout_table", "seconds"]
