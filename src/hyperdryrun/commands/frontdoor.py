"""The one runner of every front door's job (:class:`hyperdryrun.jobs.Job`: the built-in recipe, a script, a
torchtitan job): several ranks (``--ranks``, ``--all-ranks``: one per rank class and the one ``rank_classes.json``
writer) and ``--fit`` over the job's layouts, each rank through :func:`hyperdryrun.runner.run_ranks`, with the same
tables, verdicts and exit codes. The commands parse their flags into a job, a job config (the world, the device
target, the output) and call these."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from hyperdryrun.allocator.verdict import AT_RISK, FITS, OOM
from hyperdryrun.commands import EXIT_OK, EXIT_VERDICT, exit_code_of, one_line
from hyperdryrun.config import ConfigError
from hyperdryrun.jobs import Job, layout_name, representatives


def add_runner_flags(parser: Any) -> None:
    """The flags of how a front door's ranks run, the same on ``script`` and ``torchtitan``."""
    parser.add_argument(
        "--in-process", action="store_true", help="one rank in this process, not a child (no crash guard)"
    )
    parser.add_argument("--no-stacks", action="store_true", help="do not capture Python stacks (faster)")
    parser.add_argument("--quiet", action="store_true", help="print only the peak line")
    parser.add_argument("--debug", action="store_true", help="tracebacks on errors")


def run_outcomes(
    job: Job, cfg: Any, ranks: list[int], layout: dict[str, Any], args: Any, mode: str = "dry-run"
) -> list[Any]:
    """``ranks`` of ``job`` under ``layout`` in worker processes (:func:`hyperdryrun.runner.run_ranks`)."""
    from hyperdryrun.runner import run_ranks

    return run_ranks(
        cfg,
        ranks,
        args.jobs,
        capture_stacks=not args.no_stacks,
        execute=job.execute(layout),
        mode=mode,
        show_progress=False if args.quiet else None,
    )


def run_many(
    job: Job,
    cfg: Any,
    ranks: list[int],
    args: Any,
    classes: list[dict[str, Any]] | None = None,
    mode: str = "dry-run",
) -> int:
    """``--ranks`` (``ranks``) or ``--all-ranks`` (``classes``: one rank simulated per class, and
    ``rank_classes.json``): the rank table, the class table and file, the exit code of the worst rank."""
    from hyperdryrun.report.console import print_ranks

    if classes is not None:
        ranks = representatives(classes)
    outcomes = run_outcomes(job, cfg, ranks, {}, args, mode)
    rows = [(o.rank, o.report if not o.error else None, o.error) for o in outcomes]
    title = f"{job.title}: {len(rows)} of {cfg.world.world_size} ranks"
    print_ranks(cfg, rows, [p for o in outcomes for p in o.paths], quiet=args.quiet, title=title)
    if classes is not None:
        from hyperdryrun.search.classes import write_rank_classes

        write_rank_classes(job.describe(cfg.world.world_size), classes, cfg, outcomes, args.quiet)
    return exit_code_of(outcomes, args.debug)


def fit_layouts(
    job: Job,
    world_size: int,
    config_for: Callable[[str], Any],
    args: Any,
    order: str,
    title: str | None = None,
) -> int:
    """``--fit``: every layout of ``job`` (in its order), its rank classes dry-run into ``<output-dir>/layout_<i>/``
    (``config_for(output_dir)``: the runner's job config there), one table (:mod:`hyperdryrun.report.layouts`,
    the same as ``hyperdryrun fit``'s, the step time where the job gives its FLOPs); the first layout whose every
    class fits with margin is chosen (exit 0), none: exit 1, a failed rank: its exit code. A layout the job rejects
    (its classes raise a ConfigError) is a row saying why."""
    from hyperdryrun.report.console import output_console
    from hyperdryrun.report.layouts import LayoutRow, layout_table

    cfg = config_for(args.output_dir)
    target = cfg.target
    root = Path(cfg.output_dir)
    layouts = job.layouts(world_size)
    rows: list[LayoutRow] = []
    failed: list[Any] = []
    for i, layout in enumerate(layouts):
        name = layout_name(layout)
        try:
            classes = job.rank_classes(world_size, layout)
        except ConfigError as err:
            rows.append(LayoutRow(i, name, "invalid", reason=one_line(str(err))))
            continue
        outcomes = run_outcomes(
            job, config_for(str(root / f"layout_{i}")), representatives(classes), layout, args
        )
        errors = [o for o in outcomes if o.error]
        failed += errors
        ok = [o for o in outcomes if not o.error]
        facts = job.step(world_size, layout)
        time = facts.step_time(world_size, target.rates)
        row = LayoutRow(
            i, name, "error", batch=facts.batch, ac=facts.ac, classes=len(classes), method="full",
            step_s=None if time is None else time.total,
            tokens_per_s_per_gpu=None if time is None else time.tokens_per_s_per_gpu,
        )  # fmt: skip
        rows.append(row)
        if errors:
            row.reason = one_line(errors[0].error) if not ok else ""
        worst = min(ok, key=lambda o: o.report["summary"]["headroom_bytes"], default=None)
        if worst is None:
            continue
        summaries = [o.report["summary"] for o in ok]
        # "fits" only where no class is OOM or at risk (within the model's error of the capacity): an at-risk
        # layout fails run's verdict (exit 1), so it is shown as such and not chosen
        word = (
            OOM
            if any(s["oom"] for s in summaries)
            else (AT_RISK if any(s.get("at_risk") for s in summaries) else FITS)
        )
        s = worst.report["summary"]
        allocated = s.get("peak_allocated_bytes")
        row.allocated = s["peak_bytes"] if allocated is None else allocated
        row.reserved, row.device = s.get("peak_reserved_bytes"), s.get("peak_device_bytes")
        row.headroom, row.worst_rank = s["headroom_bytes"], worst.rank
        if not errors:
            row.verdict = {FITS: "fits", AT_RISK: "at_risk"}.get(word, "oom")
    chosen = next((r for r in rows if r.verdict == "fits"), None)
    if chosen is not None:
        chosen.chosen = True
    console = output_console(pipe_width=200)
    if not args.quiet:
        heading = title or f"{job.title}: {len(layouts)} layouts of {world_size} ranks"
        console.print(f"[bold]{heading}[/] · {world_size} x {target.label()}", soft_wrap=True)
        routing = job.routing_line()
        if routing:
            console.print(routing, soft_wrap=True)
        console.print(layout_table(rows, width=console.width if console.is_terminal else None))
        if all(r.step_s is None for r in rows):
            console.print("est. step: — (the job gives no FLOPs); layouts in the job's order", soft_wrap=True)
    if chosen is not None:
        console.print(f"chosen: layout {chosen.index} ({chosen.layout}), the first {order} that fits")
    else:
        console.print(f"no {order} layout fits")
    if failed:  # a failure wins over a verdict, as in run
        return exit_code_of(failed, args.debug)
    return EXIT_OK if chosen is not None else EXIT_VERDICT


def skew_table(job: Job, cfg: Any, rank: int, args: Any, hot_expert: int = 0) -> int:
    """``--skew-table``: ``rank`` of ``job`` dry-run again at every skew of
    :data:`~hyperdryrun.world.routing.SKEW_TABLE` (``--routing hotspot --skew S`` at ``hot_expert``: one full step
    each, so every row is that step's own peak, into ``<output-dir>/skew_<S>/``), a table of how the peak grows and
    ``<output-dir>/skew_table.json``; the exit code of a failed run (0 otherwise)."""
    import json

    from rich.console import Console
    from rich.table import Table

    from hyperdryrun.world.routing import SKEW_TABLE, skew_spec

    root = Path(cfg.output_dir)
    rows: list[dict[str, Any]] = []
    failed = []
    for skew in SKEW_TABLE:
        spec = skew_spec(skew, hot_expert)
        at_job, at_cfg = job.with_routing(
            spec, cfg.model_copy(update={"output_dir": str(root / f"skew_{skew:g}")})
        )
        [out] = run_outcomes(at_job, at_cfg, [rank], {}, args)
        if out.error:
            failed.append(out)
            rows.append({"skew": skew, "error": one_line(out.error)})
            continue
        s = out.report["summary"]
        rows.append(
            {
                "skew": skew,
                "routing": spec.describe(),
                "peak_allocated_bytes": s.get("peak_allocated_bytes", s["peak_bytes"]),
                "peak_reserved_bytes": s.get("peak_reserved_bytes"),
                "peak_device_bytes": s.get("peak_device_bytes"),
                "verdict": s.get("verdict"),
            }
        )
    base = next((r["peak_allocated_bytes"] for r in rows if r["skew"] == 1.0 and "error" not in r), None)
    table = Table(
        title=f"rank {rank}: peak by skew (expert {hot_expert} of every routed layer gets S x balanced)"
    )
    for name in ("skew", "allocated GiB", "reserved GiB", "vs skew 1", "verdict"):
        table.add_column(name, justify="left" if name == "verdict" else "right")
    for r in rows:
        if "error" in r:
            table.add_row(f"{r['skew']:g}", "error", "", "", r["error"])
            continue
        grow = "" if base is None else f"{r['peak_allocated_bytes'] - base:+,} B"
        reserved = r["peak_reserved_bytes"]
        table.add_row(
            f"{r['skew']:g}", f"{r['peak_allocated_bytes'] / 2**30:.3f}",
            "" if reserved is None else f"{reserved / 2**30:.3f}", grow, r.get("verdict") or "",
        )  # fmt: skip
    Console().print(table)
    path = root / "skew_table.json"
    try:
        path.write_text(json.dumps({"rank": rank, "hot_expert": hot_expert, "rows": rows}, indent=1) + "\n")
    except OSError as err:
        raise ConfigError(f"--output-dir {str(root)!r}: {err}") from None
    Console().print(f"skew table: {path}", soft_wrap=True)
    return exit_code_of(failed, args.debug) if failed else EXIT_OK


__all__ = ["add_runner_flags", "fit_layouts", "run_many", "run_outcomes", "skew_table"]
