"""The terminal summary: what a person reads in five seconds (rich tables, built from the JSON report only)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from hyperdryrun.report.schema import human_bytes

_g = human_bytes


def _short(path: str) -> str:
    return path.rsplit("/", 1)[-1]


def print_summary(
    report: dict[str, Any], paths: list[str], console: Console | None = None, top: int = 8
) -> None:
    console = console or Console()
    md, s = report["metadata"], report["summary"]
    par = md.get("parallel") or {}
    layout = " ".join(f"{k}={v}" for k, v in par.items() if isinstance(v, int) and v > 1) or "single device"
    console.print(
        f"[bold]{md.get('model', 'model')}[/] rank {md.get('rank')}/{md.get('world_size')} "
        f"({layout}) on {md.get('target_device')} [dim](simulated on {md.get('simulation_device')})[/]"
    )
    head = (
        f"peak [bold]{_g(s['peak_bytes'])}[/] in {s['peak_phase']} at task {s['peak_task']} ({s['peak_op']})"
    )
    if "capacity_bytes" in s:
        colour = "red" if s["oom"] else "green"
    console.print(head)
    if "capacity_bytes" in s:
        console.print(f"[bold {colour}]{s['verdict']}[/]")
    console.print(f"after the step: {_g(s['current_bytes'])}")

    cats = Table(title="at the peak", title_justify="left", show_edge=False)
    cats.add_column("category")
    cats.add_column("bytes", justify="right")
    cats.add_column("%", justify="right")
    for cat, nbytes in s["breakdown_at_peak"].items():
        if nbytes:
            cats.add_row(cat, _g(nbytes), f"{100 * nbytes / max(s['peak_bytes'], 1):.1f}")

    ph = Table(title="phase peaks", title_justify="left", show_edge=False)
    ph.add_column("phase")
    ph.add_column("peak", justify="right")
    for name, p in report["phases"].items():
        ph.add_row(name, _g(p["peak_bytes"]))
    console.print(cats)
    console.print(ph)

    live = report["peak_live_set"]
    mods = Table(title="modules holding the peak", title_justify="left", show_edge=False)
    mods.add_column("module")
    mods.add_column("bytes", justify="right")
    for row in live["by_top_level_module"][:top]:
        mods.add_row(row["module"], _g(row["bytes"]))
    console.print(mods)

    blk = Table(
        title=f"largest of the {live['num_blocks']} blocks live at the peak",
        title_justify="left",
        show_edge=False,
    )
    for col in ("MiB", "category", "op", "module", "phase", "where"):
        blk.add_column(col, justify="right" if col == "MiB" else "left", overflow="fold")
    for b in live["blocks"][:top]:
        where = f"{_short(b['stack'][0]['file'])}:{b['stack'][0]['line']}" if b.get("stack") else ""
        phase = "init" if b["phase"] == "initialization" else b["phase"]
        blk.add_row(f"{b['size'] / (1 << 20):,.1f}", b["category"], b["op"], b["module"], phase, where)
    console.print(blk)
    for p in paths:
        console.print(f"[dim]wrote {p}[/]")
