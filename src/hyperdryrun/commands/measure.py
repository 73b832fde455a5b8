"""``hyperdryrun measure``: the job of ``hyperdryrun run`` executed for real on the CPU, reported in the same schema.

Same flags and ``--config`` as ``run`` (one table, :data:`hyperdryrun.commands.job.RUN_FLAGS`); the report lands at
the same paths with ``metadata.mode = "measured"``.
"""

from __future__ import annotations

import argparse
from typing import Any

from hyperdryrun.commands import EXIT_OK, EXIT_VERDICT, exit_code_of, fail
from hyperdryrun.commands.job import add_job_arguments, job_from_args
from hyperdryrun.config import ConfigError

CPU_ONLY_NOTE = (
    "measured on the CPU with CPU allocator semantics; target_device={target} was not executed (compare with a "
    "dry run of --target-device cpu: a cuda dry run adds 512 B rounding and CUDA kernel choices)"
)


def register(subparsers: Any) -> None:
    """Add the ``measure`` subcommand (the job flags of ``run``)."""
    p = subparsers.add_parser(
        "measure",
        help="run the same training step for real on the CPU and report its measured memory",
        description="Execute the job's step with real tensors on the CPU (a warm-up step, then one step under "
        "torch.profiler) and write the report in the dry run's schema. Only small models fit: use the small "
        "presets or --n-layers/--dim overrides. Compare with 'hyperdryrun run --target-device cpu'.",
    )
    add_job_arguments(p)
    p.add_argument("--no-stacks", action="store_true", help="do not record Python stacks in the blocks")
    p.add_argument("--quiet", action="store_true", help="print only the peak line")
    p.set_defaults(func=measure_command)


def _measure(cfg: Any, capture_stacks: bool = True) -> Any:
    from hyperdryrun.measure import measure_job

    trace = measure_job(cfg, capture_stacks=capture_stacks)
    if cfg.target_device != "cpu":
        trace.limitations.append(CPU_ONLY_NOTE.format(target=cfg.target_device))
    return trace


def measure_command(args: argparse.Namespace) -> int:
    """Exit 0 when measured (1 if over ``--device-memory-gib``), 2 on bad input, 3 if the run failed inside."""
    from rich.console import Console

    from hyperdryrun.report.console import print_summary
    from hyperdryrun.runner import run_rank

    try:
        cfg = job_from_args(args)
    except ConfigError as err:
        return fail(str(err), err, args.debug)
    from hyperdryrun.measure.step import unsupported

    why = unsupported(cfg)
    if why:
        return fail(why, None, args.debug)
    out = run_rank(cfg, capture_stacks=not args.no_stacks, execute=_measure, mode="measured")
    if out.error:
        return exit_code_of([out], args.debug)
    s = out.report["summary"]
    scratch = out.report["metadata"].get("kernel_scratch") or {}
    if args.quiet:
        Console().print(f"measured peak {s['peak_gib']:.4f} GiB ({s['peak_phase']})")
    else:
        print_summary(out.report, out.paths)
        if "peak_bytes_excluding" in scratch:
            Console().print(
                f"without kernel scratch (what a dry run counts): {scratch['peak_bytes_excluding']:,} B "
                f"(measured peak {s['peak_bytes']:,} B)"
            )
    return EXIT_VERDICT if out.oom else EXIT_OK
