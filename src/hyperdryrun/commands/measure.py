"""``hyperdryrun measure``: the job of ``hyperdryrun run`` executed for real on the CPU, reported in the same schema.

Same flags and ``--config`` as ``run`` (one table, :data:`hyperdryrun.cli.RUN_FLAGS`); the report lands at the same
paths with ``metadata.mode = "measured"``.
"""

from __future__ import annotations

import argparse
from typing import Any

CPU_ONLY_NOTE = (
    "measured on the CPU with CPU allocator semantics; target_device={target} was not executed (compare with a "
    "dry run of --target-device cpu: a cuda dry run adds 512 B rounding and CUDA kernel choices)"
)


def register(subparsers: Any) -> None:
    """Add the ``measure`` subcommand (flags from :data:`hyperdryrun.cli.RUN_FLAGS`)."""
    from hyperdryrun.cli import _BOOL, RUN_FLAGS, _dest

    p = subparsers.add_parser(
        "measure", help="run the same training step for real on the CPU and report its measured memory"
    )
    p.add_argument("--config", metavar="job.yaml", help="YAML job description; flags override it")
    for flag, (path, typ, help_) in RUN_FLAGS.items():
        if typ is _BOOL:
            p.add_argument(
                flag, dest=_dest(flag), action=argparse.BooleanOptionalAction, default=None, help=help_
            )
        else:
            p.add_argument(
                flag, dest=_dest(flag), type=typ, default=None, help=help_, metavar=path.split(".")[-1]
            )
    p.add_argument("--no-stacks", action="store_true", help="do not record Python stacks in the blocks")
    p.add_argument("--quiet", action="store_true", help="print only the peak line")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.set_defaults(func=measure_command)


def measure_command(args: argparse.Namespace) -> int:
    """Exit 0 when measured (1 if over ``--device-memory-gib``), 2 on bad input or a failed run."""
    from rich.console import Console

    from hyperdryrun.cli import FLAG_OF, _fail, _safe_metadata, config_from_args
    from hyperdryrun.config import ConfigError
    from hyperdryrun.engine import SimulationError
    from hyperdryrun.measure import measure_job
    from hyperdryrun.recipe import job_metadata
    from hyperdryrun.report import blocks_csv, build_report, error_report, write_error_report, write_reports
    from hyperdryrun.report.console import print_summary

    try:
        cfg = config_from_args(args)
    except ConfigError as err:
        msg = str(err)
        field = msg.split(":", 1)[0]
        if field in FLAG_OF:
            msg = f"{field} ({FLAG_OF[field]}){msg[len(field) :]}"
        return _fail(msg, err, args.debug)
    try:
        trace = measure_job(cfg, capture_stacks=not args.no_stacks)
    except SimulationError as err:
        meta = {**_safe_metadata(cfg, job_metadata), "mode": "measured"}
        path = write_error_report(error_report(err.stage, err.error, meta), cfg.output_dir, cfg.world.rank)
        return _fail(
            f"{err.stage} failed: {type(err.error).__name__}: {err.error} (report: {path})", err, args.debug
        )
    if cfg.target_device != "cpu":
        trace.limitations.append(CPU_ONLY_NOTE.format(target=cfg.target_device))
    report = build_report(trace, cfg.device_memory_gib, cfg.live_set_limit)
    paths = write_reports(report, blocks_csv(trace), cfg.output_dir, cfg.world.rank)
    console = Console()
    s = report["summary"]
    if args.quiet:
        console.print(
            f"measured peak {s['peak_gib']:.4f} GiB ({s['peak_phase']}); {s.get('verdict', '')}".rstrip("; ")
        )
    else:
        print_summary(report, [str(p) for p in paths], console)
        scratch = trace.metadata["kernel_scratch"]
        console.print(
            f"without kernel scratch (what a dry run counts): {scratch['peak_bytes_excluding']:,} B "
            f"(measured peak {trace.peak:,} B)"
        )
    return 1 if s.get("oom") else 0
