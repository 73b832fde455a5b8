"""``hyperdryrun run``: dry-run one training step of the built-in recipe for one rank (or several, each in its own
process) and write the reports."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hyperdryrun.commands import EXIT_ERROR, EXIT_OK, EXIT_VERDICT, fail, one_line
from hyperdryrun.commands.job import add_job_arguments, job_from_args
from hyperdryrun.config import ConfigError, JobConfig


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "run",
        help="dry-run one training step of the built-in Llama recipe for one rank",
        description="Dry-run one training step as rank r of N on fake tensors and write "
        "<output-dir>/rank_<r>/rank_<r>_memory.{json,csv}. Exit 0: done (fits), 1: OOM against "
        "--device-memory-gib, 2: error.",
    )
    add_job_arguments(p)
    p.add_argument("--ranks", metavar="0,7,63", help="simulate these ranks, each in its own process")
    p.add_argument("--all-ranks", action="store_true", help="simulate every rank of the world")
    p.add_argument(
        "--jobs", type=int, default=None, help="processes in parallel with --ranks (default: cores)"
    )
    p.add_argument("--no-stacks", action="store_true", help="do not capture Python stacks (faster)")
    p.add_argument("--quiet", action="store_true", help="print only the peak line")
    p.set_defaults(func=run)


@dataclass
class RankOutcome:
    """What one rank's run left: its report (or error), the files written, and a one-line error if it failed."""

    rank: int
    report: dict[str, Any] = field(default_factory=dict)
    paths: list[str] = field(default_factory=list)
    error: str | None = None


def run_rank(
    cfg: JobConfig,
    capture_stacks: bool = True,
    execute: Callable[..., Any] | None = None,
    mode: str = "dry-run",
) -> RankOutcome:
    """Run ``cfg``'s rank with ``execute`` (default: the dry run; ``measure`` passes the real run) and write its
    reports, or an error report if it fails."""
    from hyperdryrun.engine import SimulationError
    from hyperdryrun.recipe import job_metadata, run_job
    from hyperdryrun.report import (
        blocks_csv,
        build_report,
        device_memory_of,
        error_report,
        segments_csv,
        write_error_report,
        write_reports,
    )

    rank = cfg.world.rank
    try:
        trace = (execute or run_job)(cfg, capture_stacks=capture_stacks)
    except SimulationError as err:
        message = f"rank {rank}: {err.stage} failed: {type(err.error).__name__}: {err.error}"
        try:
            meta = {**job_metadata(cfg), "mode": mode}
        except Exception:
            meta = {"mode": mode}
        report = error_report(err.stage, err.error, meta)
        try:
            path = write_error_report(report, cfg.output_dir, rank)
        except OSError as werr:
            return RankOutcome(
                rank, report, [], f"{message} (and the error report could not be written: {werr})"
            )
        return RankOutcome(rank, report, [str(path)], f"{message} (report: {path})")
    device = device_memory_of(trace, cfg.device_memory_gib)
    report = build_report(trace, cfg.device_memory_gib, cfg.live_set_limit, device)
    segments = segments_csv(trace, device) if device is not None else None
    try:
        paths = write_reports(report, blocks_csv(trace), cfg.output_dir, rank, segments)
    except OSError as err:
        return RankOutcome(
            rank, report, [], f"--output-dir {cfg.output_dir!r}: cannot write the reports: {err}"
        )
    return RankOutcome(rank, report, [str(p) for p in paths])


def _run_rank_in_worker(data: dict[str, Any], capture_stacks: bool) -> RankOutcome:
    from hyperdryrun.config import build_config

    try:
        return run_rank(build_config(data), capture_stacks)
    except Exception as err:  # the parent prints it as the rank's row
        return RankOutcome(data["world"]["rank"], error=one_line(f"{type(err).__name__}: {err}"))


def parse_ranks(args: argparse.Namespace, world_size: int) -> list[int] | None:
    """The ranks asked for with ``--ranks``/``--all-ranks`` (None: just the one rank of the config)."""
    if args.all_ranks and args.ranks:
        raise ConfigError("--ranks and --all-ranks: give one of them")
    if args.all_ranks:
        return list(range(world_size))
    if args.ranks is None:
        return None
    ranks = []
    for part in args.ranks.split(","):
        try:
            r = int(part)
        except ValueError:
            raise ConfigError(f"--ranks: {part.strip()!r} is not an integer (in {args.ranks!r})") from None
        if not 0 <= r < world_size:
            raise ConfigError(f"--ranks: rank {r} must satisfy 0 <= rank < world_size={world_size}")
        if r not in ranks:
            ranks.append(r)
    return ranks


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from hyperdryrun.report.console import print_summary

    try:
        cfg = job_from_args(args)
        ranks = parse_ranks(args, cfg.world.world_size)
        if ranks is not None and args.rank is not None:
            raise ConfigError("--rank and --ranks/--all-ranks: give one of them")
        if args.jobs is not None and args.jobs < 1:
            raise ConfigError(f"--jobs: must be >= 1 (got {args.jobs})")
    except ConfigError as err:
        return fail(str(err), err, args.debug)
    if ranks is not None:
        return _run_many(cfg, ranks, args)
    out = run_rank(cfg, capture_stacks=not args.no_stacks)
    if out.error:
        return fail(out.error, None, args.debug)
    s = out.report["summary"]
    if args.quiet:
        Console().print(
            f"peak {s['peak_gib']:.2f} GiB ({s['peak_phase']}); {s.get('verdict', '')}".rstrip("; ")
        )
    else:
        print_summary(out.report, out.paths)
    return EXIT_VERDICT if s.get("oom") else EXIT_OK


def _run_many(cfg: JobConfig, ranks: list[int], args: argparse.Namespace) -> int:
    """Each rank in a fresh process (a simulation owns process-global state: the process group, patches)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from hyperdryrun.report.console import print_ranks

    jobs = min(args.jobs or os.cpu_count() or 1, len(ranks))
    data = cfg.model_dump()
    outcomes: list[RankOutcome] = []
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, max_tasks_per_child=1) as pool:
        futures = []
        for r in ranks:
            d = {**data, "world": {**data["world"], "rank": r}}
            futures.append(pool.submit(_run_rank_in_worker, d, not args.no_stacks))
        for fut in futures:
            outcomes.append(fut.result())
    print_ranks(cfg, [(o.rank, o.report if not o.error else None, o.error) for o in outcomes])
    if any(o.error for o in outcomes):
        return EXIT_ERROR
    return EXIT_VERDICT if any(o.report["summary"].get("oom") for o in outcomes) else EXIT_OK
