"""The terminal summary: what a person reads in five seconds (rich tables, built from the JSON report only)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from rich.columns import Columns
from rich.console import Console
from rich.table import Table

from hyperdryrun.report.schema import human_bytes

_g = human_bytes


def _short(path: str) -> str:
    return path.rsplit("/", 1)[-1]


def _table(
    title: str,
    *columns: str,
    right: tuple[str, ...] = (),
    widths: dict[str, int] | None = None,
    ruled: bool = True,
    wrap: tuple[str, ...] = (),
) -> Table:
    from rich import box

    t = Table(
        title=title,
        title_justify="left",
        show_edge=False,
        pad_edge=False,
        title_style="bold",
        box=box.HEAVY_HEAD if ruled else box.SIMPLE_HEAD,
        collapse_padding=not ruled,  # unruled: one space either side of a column's gap, not two
    )
    for col in columns:
        numeric = col in right
        # ``wrap``: a column whose cells may be long (an error's reason) wraps, and rich narrows it first
        t.add_column(
            col,
            justify="right" if numeric else "left",
            no_wrap=col not in wrap,
            overflow="fold" if numeric or col in wrap else "ellipsis",
            min_width=len(col) if not numeric or col == "%" else max(len(col), 9),
            max_width=(widths or {}).get(col),
        )
    return t


def _natural(name: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in name.split("."))


def by_unit(live: dict[str, Any]) -> list[tuple[str, int, int, str]]:
    """Bytes at the peak per model-level unit (``layers`` summed over its numbered children), largest first, with the
    number of children and the largest child."""
    units: dict[str, list] = {}
    for row in live["by_top_level_module"]:
        name, nbytes = row["module"], row["bytes"]
        head, _, tail = name.partition(".")
        key = head if tail.isdigit() else name
        u = units.setdefault(key, [0, 0, "", -1])
        u[0] += nbytes
        if tail.isdigit():
            u[1] += 1
            if nbytes > u[3] or (nbytes == u[3] and _natural(name) < _natural(u[2])):
                u[2], u[3] = name, nbytes
    return sorted(((k, v[0], v[1], v[2]) for k, v in units.items()), key=lambda r: (-r[1], r[0]))


def headline(report: dict[str, Any]) -> list[str]:
    """The lines above the tables: who was simulated on which torch, the peak and when, the verdict, what stays
    after the step."""
    md, s = report["metadata"], report["summary"]
    par = md.get("parallel") or {}
    layout = " ".join(f"{k}={v}" for k, v in par.items() if isinstance(v, int) and v > 1) or "single device"
    sim = md.get("simulation_device")
    device = md.get("target_device")
    where = f"{device} (simulated on {sim})" if sim and sim != device else f"{device}"
    # the torch release the step ran on: its kernels, FSDP2 and DTensor are what was modelled
    modelled = f" · torch {md['torch_version']}" if md.get("torch_version") else ""
    lines = [
        f"[bold]{md.get('model', 'model')}[/] · rank {md.get('rank')} of {md.get('world_size')} · {layout} · {where}"
        f"{modelled}",
        f"peak [bold]{_g(s['peak_bytes'])}[/] in {s['peak_phase']} (task {s['peak_task']}, {s['peak_op']})",
    ]
    lines.extend(device_lines(s))
    if "capacity_bytes" in s:
        judged = " on the device" if "peak_device_bytes" in s else ""
        margin = f"margin {_g(s['margin_bytes'])}" if "margin_bytes" in s else ""
        if s["oom"]:
            tips = f" ({s['verdict_line']} tips it)" if s.get("verdict_line") else ""
            lines.append(
                f"[bold red]OOM[/]: over {_g(s['capacity_bytes'])}{judged} by {_g(-s['headroom_bytes'])}{tips}"
            )
        elif s.get("at_risk"):
            lines.append(
                f"[bold yellow]at risk[/] in {_g(s['capacity_bytes'])}{judged}: {_g(s['headroom_bytes'])} "
                f"headroom, within the {margin} of the model's error (exit 1; --margin-gib 0 accepts it)"
            )
        else:
            lines.append(
                f"[bold green]fits[/] in {_g(s['capacity_bytes'])}{judged}: {_g(s['headroom_bytes'])} headroom"
                + (f" ({margin})" if margin else "")
            )
    lines.append(f"after the step: {_g(s['current_bytes'])}")
    return lines


def device_lines(s: dict[str, Any], top: int = 3) -> list[str]:
    """A CUDA target's three figures at a glance, and what lies between them (empty for other reports)."""
    if "peak_device_bytes" not in s:
        return []
    cached: dict[str, int] = {}
    for row in s["reserved_breakdown"]:
        if row["stream"] is not None:
            name = row.get("stream_name") or f"stream {row['stream']}"
            cached[name] = cached.get(name, 0) + row["bytes"]
    ranked = sorted(((n, name) for name, n in cached.items() if n), key=lambda r: (-r[0], r[1]))
    outside = [row for row in s["device_lines"] if not row["inside_allocator"]]
    lines = [
        f"allocated [bold]{_g(s['peak_allocated_bytes'])}[/] · reserved [bold]{_g(s['peak_reserved_bytes'])}[/] · "
        f"device [bold]{_g(s['peak_device_bytes'])}[/]"
    ]
    lines.append(
        f"  reserved peak in {s['peak_reserved_phase']} (task {s['peak_reserved_task']}): "
        f"{_g(s['allocated_at_reserved_peak_bytes'])} allocated + {_g(s['fragmentation_bytes'])} cached"
    )
    if ranked:
        lines.append("    cached: " + ", ".join(f"{name} {_g(n)}" for n, name in ranked[:top]))
    lines.append("  device adds " + " + ".join(f"{row['line']} {_g(row['bytes'])}" for row in outside))
    return lines


def output_console(pipe_width: int = 110) -> Console:
    """The console a command's tables print on: the terminal's, else (a log or a pipe) one ``pipe_width`` wide, so
    that the tables do not fold."""
    console = Console()
    return console if console.is_terminal else Console(width=pipe_width)


def quiet_line(summary: dict[str, Any], what: str = "peak") -> str:
    """The one line of ``--quiet`` (``run``, ``measure``, ``torchtitan``): ``what``, the peak in human bytes, its
    phase and the verdict where there is one."""
    return (
        f"{what} {_g(summary['peak_bytes'])} ({summary['peak_phase']}); {summary.get('verdict', '')}".rstrip(
            "; "
        )
    )


def print_summary(
    report: dict[str, Any], paths: list[str], console: Console | None = None, top: int = 8
) -> None:
    console = console or output_console()
    s = report["summary"]
    for line in headline(report):
        console.print(line)
    console.print()

    cats = _table("at the peak", "category", "bytes", "%", right=("bytes", "%"))
    for cat, nbytes in s["breakdown_at_peak"].items():
        if nbytes:
            cats.add_row(cat, _g(nbytes), f"{100 * nbytes / max(s['peak_bytes'], 1):.1f}")
    ph = _table("phase peaks", "phase", "peak", right=("peak",))
    for name, p in report["phases"].items():
        ph.add_row(name, _g(p["peak_bytes"]))
    live = report["peak_live_set"]
    mods = _table(
        "held at the peak by", "module", "bytes", "largest", right=("bytes",), widths={"module": 24}
    )
    for name, nbytes, children, largest in by_unit(live)[:top]:
        label = f"{name} ({children})" if children else name
        mods.add_row(label, _g(nbytes), largest if children > 1 else "")
    console.print(Columns([cats, ph, mods], padding=(0, 4)))
    console.print()
    console.print(blocks_table(live, top, console.width if console.is_terminal else None))
    compiled = [line for line in report.get("limitations", []) if line.startswith("torch.compile region")]
    if compiled:  # what compile did to each region (saved for backward, recomputed), or why it ran eagerly
        console.print()
        for line in compiled:
            console.print(line, markup=False, highlight=False)
    for p in paths:
        console.print(f"[dim]wrote {p}[/]", soft_wrap=True)  # a long path stays one line


BLOCK_COLUMNS = ("MiB", "category", "op", "module", "phase", "allocated at")
BLOCKS_LEFT_OUT = ("allocated at", "phase", "module")
"""The columns of the blocks table that a terminal too narrow for it goes without, first to last (size, category
and op stay): rich would otherwise cut every cell to a few letters and an ellipsis. The JSON and the block CSV have
them all."""


def blocks_table(live: dict[str, Any], top: int = 8, width: int | None = None) -> Table:
    """The ``top`` largest blocks live at the peak. With a ``width`` (a terminal's) narrower than the table: first
    without the column rules, then without the columns that it takes to fit, in :data:`BLOCKS_LEFT_OUT`'s order,
    named in the caption."""
    rows = []
    for b in live["blocks"][:top]:
        where = f"{_short(b['stack'][0]['file'])}:{b['stack'][0]['line']}" if b.get("stack") else ""
        phase = "init" if b["phase"] == "initialization" else b["phase"]
        cells = (f"{b['size'] / (1 << 20):,.1f}", b["category"], b["op"], b["module"], phase, where)
        rows.append(dict(zip(BLOCK_COLUMNS, cells, strict=True)))

    def build(columns: Sequence[str], ruled: bool) -> Table:
        t = _table(
            f"largest of the {live['num_blocks']} blocks live at the peak",
            *columns,
            right=("MiB",),
            widths={"op": 28, "module": 28, "allocated at": 24},
            ruled=ruled,
        )
        for row in rows:
            t.add_row(*(row[c] for c in columns))
        return t

    return fit_to_width(build, BLOCK_COLUMNS, BLOCKS_LEFT_OUT, width, "the block CSV has them")


def fit_to_width(
    build: Callable[[Sequence[str], bool], Table],
    columns: Sequence[str],
    left_out_order: Sequence[str],
    width: int | None,
    where_else: str,
    measure: Callable[[Sequence[str], bool], Table] | None = None,
) -> Table:
    """``build(columns, ruled)``'s table as it is where it fits in ``width`` (a terminal's; ``None``: a pipe or a
    log, the whole table); else without the column rules, then without the columns of ``left_out_order`` (first to
    last) that it takes to fit, named in the caption (``where_else``: where the reader finds them).
    ``measure(columns, ruled)``: the table whose width counts, where cells that may wrap or be cut (an error's
    text) are left out of it (default ``build``)."""
    measure = measure or build

    def fits(cols: Sequence[str], ruled: bool) -> bool:
        return _natural_width(measure(cols, ruled)) <= width

    if width is None or fits(columns, True):
        return build(columns, True)
    left_out: list[str] = []
    for col in left_out_order:
        if fits([c for c in columns if c not in left_out], False):
            break
        left_out.append(col)
    table = build([c for c in columns if c not in left_out], False)
    if left_out:
        table.caption = f"left out for the terminal's width: {', '.join(left_out)} ({where_else})"
        table.caption_justify = "left"
    return table


def _natural_width(table: Table) -> int:
    """The width ``table`` takes with no cell cut (beyond its columns' own maximum widths); its title may wrap."""
    import io

    from rich.measure import Measurement

    console = Console(width=10_000, file=io.StringIO())
    table.title = None
    return Measurement.get(console, console.options, table).maximum


RANK_CATEGORIES = ("Parameter", "Gradient", "Optstate", "Activation", "Temp")
RANK_COLUMNS = ("rank", "peak", "phase", *RANK_CATEGORIES, "verdict")
RANKS_LEFT_OUT = ("Temp", "Gradient", "Optstate", "Parameter", "Activation")
"""The columns of the ranks table that a terminal too narrow for it goes without, first to last: rank, peak, phase
and verdict stay (without the rules, rich would drop the last columns, the verdict among them)."""


def print_ranks(
    cfg: Any,
    rows: list[tuple[int, dict[str, Any] | None, str | None]],
    paths: Sequence[str] = (),
    quiet: bool = False,
    title: str | None = None,
    console: Console | None = None,
) -> None:
    """One row per simulated rank (peak, phase, what it consists of, verdict), the maximum over them and the files
    written; ``quiet``: the maximum alone. ``title``: the table's (default: the model and the ranks). In a terminal
    narrower than the table, without the column rules, then without the categories of :data:`RANKS_LEFT_OUT`."""
    console = console or output_console()
    best: tuple[int, int] | None = None
    cells: list[dict[str, str]] = []
    for rank, report, error in rows:
        if report is None or report.get("status") != "ok":
            cells.append({"rank": str(rank), "verdict": f"[red]error[/]: {error}"})
            continue
        s = report["summary"]
        b = s["breakdown_at_peak"]
        verdict = (
            ""
            if "oom" not in s
            else "[red]OOM[/]"
            if s["oom"]
            else "[yellow]at risk[/]"
            if s.get("at_risk")
            else "[green]fits[/]"
        )
        row = {"rank": str(rank), "peak": _g(s["peak_bytes"]), "phase": s["peak_phase"], "verdict": verdict}
        cells.append(row | {c: _g(b[c]) for c in RANK_CATEGORIES})
        if best is None or s["peak_bytes"] > best[1]:
            best = (rank, s["peak_bytes"])

    def build(columns: Sequence[str], ruled: bool, errors: bool = True) -> Table:
        t = _table(
            title or f"{cfg.model.name}: {len(rows)} of {cfg.world.world_size} ranks",
            *columns,
            right=("rank", "peak", *RANK_CATEGORIES),
            ruled=ruled,
            wrap=("verdict",),
        )
        for row in cells:
            verdict = row["verdict"] if errors else row["verdict"].split(":", 1)[0]
            t.add_row(*(verdict if c == "verdict" else row.get(c, "") for c in columns))
        return t

    t = fit_to_width(
        build,
        RANK_COLUMNS,
        RANKS_LEFT_OUT,
        console.width if console.is_terminal else None,
        "each rank's JSON has them",
        measure=lambda columns, ruled: build(columns, ruled, errors=False),
    )
    if not quiet:
        console.print(t)
    if best is not None:
        console.print(f"max peak: [bold]{_g(best[1])}[/] on rank {best[0]}")
    if not quiet:
        for p in paths:
            console.print(f"[dim]wrote {p}[/]", soft_wrap=True)  # a long path stays one line


@contextlib.contextmanager
def rank_progress(total: int) -> Iterator[Callable[[Any, int, int], None]]:
    """A live "ranks done/total" line on stderr while the ranks run (gone when they are done); yields the
    ``on_rank_done(outcome, done, total)`` callback that advances it."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(
        TextColumn("ranks"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    )
    with progress:
        task = progress.add_task("ranks", total=total)
        yield lambda _outcome, done, _total: progress.update(task, completed=done)
