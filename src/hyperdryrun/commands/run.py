"""``hyperdryrun run``: dry-run one training step of the built-in recipe for one rank and write its reports."""

from __future__ import annotations

import argparse
from typing import Any

from hyperdryrun.commands import EXIT_OK, EXIT_VERDICT, fail
from hyperdryrun.commands.job import add_job_arguments, job_from_args


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "run",
        help="dry-run one training step of the built-in Llama recipe for one rank",
        description="Dry-run one training step as rank r of N on fake tensors and write "
        "<output-dir>/rank_<r>/rank_<r>_memory.{json,csv}. Exit 0: done (fits), 1: OOM against "
        "--device-memory-gib, 2: error.",
    )
    add_job_arguments(p)
    p.add_argument("--no-stacks", action="store_true", help="do not capture Python stacks (faster)")
    p.add_argument("--quiet", action="store_true", help="print only the peak line")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from hyperdryrun.config import ConfigError
    from hyperdryrun.engine import SimulationError
    from hyperdryrun.recipe import job_metadata, run_job
    from hyperdryrun.report import blocks_csv, build_report, error_report, write_error_report, write_reports
    from hyperdryrun.report.console import print_summary

    try:
        cfg = job_from_args(args)
    except ConfigError as err:
        return fail(str(err), err, args.debug)
    try:
        trace = run_job(cfg, capture_stacks=not args.no_stacks)
    except SimulationError as err:
        message = f"{err.stage} failed: {type(err.error).__name__}: {err.error}"
        try:
            path = write_error_report(
                error_report(err.stage, err.error, _safe_metadata(cfg, job_metadata)),
                cfg.output_dir,
                cfg.world.rank,
            )
        except OSError as werr:
            return fail(f"{message} (and the error report could not be written: {werr})", err, args.debug)
        return fail(f"{message} (report: {path})", err, args.debug)
    report = build_report(trace, cfg.device_memory_gib, cfg.live_set_limit)
    try:
        paths = write_reports(report, blocks_csv(trace), cfg.output_dir, cfg.world.rank)
    except OSError as err:
        return fail(f"--output-dir {cfg.output_dir!r}: cannot write the reports: {err}", err, args.debug)
    if args.quiet:
        console = Console()
        s = report["summary"]
        console.print(
            f"peak {s['peak_gib']:.2f} GiB ({s['peak_phase']}); {s.get('verdict', '')}".rstrip("; ")
        )
    else:
        print_summary(report, [str(p) for p in paths])
    return EXIT_VERDICT if report["summary"].get("oom") else EXIT_OK


def _safe_metadata(cfg: Any, job_metadata: Any) -> dict[str, Any]:
    try:
        return job_metadata(cfg)
    except Exception:
        return {}
