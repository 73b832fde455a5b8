"""``hyperdryrun torchtitan``: dry-run one training step of a torchtitan job as it is (torchtitan's own ``--module``,
``--config`` and overrides) for one rank, in a child process, and write the reports; ``--measure`` executes the
same step for real on the CPU instead (the ground truth, as ``hyperdryrun measure`` is for ``run``)."""

from __future__ import annotations

import argparse
import sys
import traceback
from typing import Any

from hyperdryrun.allocator.verdict import DEVICE_ERROR_FRACTION, Margin
from hyperdryrun.commands import EXIT_OK, EXIT_VERDICT, OneLineParser, fail, one_line
from hyperdryrun.commands.measure import CPU_ONLY_NOTE
from hyperdryrun.commands.preflight import check_cuda_environment, check_rank_outputs
from hyperdryrun.config import ConfigError, JobConfig, rank_from_env

_DEFAULTS = JobConfig.model_fields


class _PassThroughParser(OneLineParser):
    """Parses the command's own flags; every other argument is torchtitan's and is kept, in order, in
    ``torchtitan_args`` (its ``--section.key`` flags, ``--module``/``--config`` and subcommands such as
    ``activation-checkpoint:none``)."""

    def parse_known_args(
        self, args: Any = None, namespace: Any = None
    ) -> tuple[argparse.Namespace, list[str]]:
        namespace, extras = super().parse_known_args(args, namespace)
        namespace.torchtitan_args = [*getattr(namespace, "torchtitan_args", []), *extras]
        return namespace, []


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "torchtitan",
        help="dry-run one training step of a torchtitan job (torchtitan's own --module, --config and overrides)",
        description="Dry-run one training step of a torchtitan job as rank r of N on fake tensors: torchtitan's "
        "model, parallelize function, activation checkpointing, optimizer container, loss and train step, without "
        "its data loader, tokenizer, checkpointer or metrics. Every argument not listed here is torchtitan's, e.g. "
        "--module llama3 --config llama3_8b --parallelism.data_parallel_shard_degree 8 --training.seq_len 8192 "
        "activation-checkpoint:none. Writes <output-dir>/rank_<r>/rank_<r>_memory.{json,csv}. Exit 0: done "
        "(fits), 1: OOM against --device-memory-gib, 2: error.",
        allow_abbrev=False,
    )
    p.__class__ = _PassThroughParser
    p.add_argument(
        "--world-size",
        type=int,
        help="ranks in the job (default: $WORLD_SIZE, else the product of torchtitan's parallelism degrees)",
    )
    p.add_argument("--rank", type=int, help="the rank to simulate (default: $RANK, else 0)")
    p.add_argument("--local-rank", type=int, help="local rank (default: $LOCAL_RANK, else the rank)")
    p.add_argument("--n-layers", type=int, help="keep only the model's first N layers (CPU time)")
    p.add_argument(
        "--attention",
        choices=("sdpa",),
        help="replace every layer's inner attention: sdpa (torchtitan's ScaledDotProductAttention, causal), which "
        "runs forward and backward on the CPU (default: the config's, FlexAttention for llama3)",
    )
    p.add_argument(
        "--measure",
        action="store_true",
        help="execute the step for real on the CPU (a warm-up step, then one under torch.profiler) instead of "
        "dry-running it; same report format, metadata.mode 'measured' (needs --attention sdpa for FlexAttention "
        "models; compare with a dry run of --attention sdpa --target-device cpu)",
    )
    p.add_argument(
        "--target-device",
        choices=("cuda", "cpu"),
        default=_DEFAULTS["target_device"].default,
        help="the device whose memory is estimated (cuda)",
    )
    p.add_argument(
        "--device-memory-gib", type=float, help="capacity: adds headroom and a verdict (fits, at risk, OOM)"
    )
    p.add_argument(
        "--margin-gib",
        type=float,
        help=f"verdict margin in GiB; 'at risk' exits 1 (default: {100 * DEVICE_ERROR_FRACTION:g}%% of the capacity)",
    )
    p.add_argument(
        "--margin-pct",
        type=float,
        help=f"verdict margin in percent of the capacity (default: {100 * DEVICE_ERROR_FRACTION:g})",
    )
    p.add_argument(
        "--routing-from",
        metavar="REPORT",
        help="MoE: route as the measured step of REPORT did (a --measure run's rank_<r>_memory.json: each "
        "routed-experts module's per-expert token counts, given to the expert-parallel dispatch; default: balanced)",
    )
    p.add_argument("--output-dir", default=_DEFAULTS["output_dir"].default, help="where rank_<r>/ goes")
    p.add_argument(
        "--in-process", action="store_true", help="run in this process, not a child (no crash guard)"
    )
    p.add_argument("--no-stacks", action="store_true", help="do not capture Python stacks (faster)")
    p.add_argument("--quiet", action="store_true", help="print only the peak line")
    p.add_argument("--debug", action="store_true", help="tracebacks on errors")
    p.set_defaults(func=run)


def _identity(args: argparse.Namespace) -> dict[str, int | None]:
    env = rank_from_env()
    world_size = args.world_size if args.world_size is not None else env.get("world_size")
    rank = args.rank if args.rank is not None else env.get("rank", 0)
    local_rank = args.local_rank if args.local_rank is not None else env.get("local_rank")
    if world_size is not None and world_size < 1:
        raise ConfigError(f"--world-size: must be >= 1 (got {world_size})")
    if rank < 0 or (world_size is not None and rank >= world_size):
        raise ConfigError(f"--rank: must satisfy 0 <= rank < world_size={world_size} (got {rank})")
    if args.n_layers is not None and args.n_layers < 1:
        raise ConfigError(f"--n-layers: must be >= 1 (got {args.n_layers})")
    if args.device_memory_gib is not None and not args.device_memory_gib > 0:
        raise ConfigError(f"--device-memory-gib: must be > 0 (got {args.device_memory_gib})")
    try:
        Margin(args.margin_gib, args.margin_pct)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return {"world_size": world_size, "rank": rank, "local_rank": local_rank}


def _error_metadata(options: dict[str, Any]) -> dict[str, Any]:
    return {
        "mode": "measured" if options.get("measure") else "dry-run",
        "rank": options["rank"],
        "world_size": options["world_size"],
        "torchtitan": {"argv": list(options["argv"])},
    }


def run_torchtitan_rank(options: dict[str, Any]) -> dict[str, Any]:
    """One rank of a torchtitan job: simulate, write its reports (or its error report); returns ``report``,
    ``paths`` and a one-line ``error`` (None when it ran). Module level, so that a spawned child can run it."""
    from hyperdryrun.engine import SimulationError
    from hyperdryrun.integrations.torchtitan import (
        TorchtitanError,
        infer_world_size,
        routing_from_report,
        simulate_torchtitan,
    )
    from hyperdryrun.measure.step import MeasureError
    from hyperdryrun.measure.torchtitan import measure_torchtitan
    from hyperdryrun.report import blocks_csv, build_report, error_report, write_error_report, write_reports

    options = dict(options)
    rank = options["rank"]
    try:
        if options["world_size"] is None:
            options["world_size"] = infer_world_size(options["argv"])
            if options["world_size"] is None:
                raise TorchtitanError(
                    "--world-size: torchtitan's parallelism degrees leave the world size open "
                    "(parallelism.data_parallel_shard_degree -1); give --world-size or $WORLD_SIZE"
                )
            if rank >= options["world_size"]:
                raise TorchtitanError(
                    f"--rank: must satisfy 0 <= rank < world_size={options['world_size']} (got {rank})"
                )
        job = {
            "world_size": options["world_size"],
            "rank": rank,
            "local_rank": options["local_rank"],
            "n_layers": options["n_layers"],
            "capture_stacks": options["capture_stacks"],
            "attention": options.get("attention"),
        }
        if options.get("routing_from"):
            if options.get("measure"):
                raise TorchtitanError(
                    f"--routing-from: a measured step routes as its router decides (got {options['routing_from']!r} "
                    "with --measure)"
                )
            job["routing"] = routing_from_report(options["routing_from"])
        if options.get("measure"):
            trace = measure_torchtitan(options["argv"], **job)
            if options["target_device"] != "cpu":
                trace.limitations.append(CPU_ONLY_NOTE.format(target=options["target_device"]))
        else:
            trace = simulate_torchtitan(options["argv"], target_device=options["target_device"], **job)
    except (TorchtitanError, MeasureError) as err:
        return {"report": {}, "paths": [], "error": str(err)}
    except SimulationError as err:
        message = f"rank {rank}: {err.stage} failed: {type(err.error).__name__}: {err.error}"
        report = error_report(err.stage, err.error, _error_metadata(options))
        tb = "".join(traceback.format_exception(err.error))
        try:
            path = write_error_report(report, options["output_dir"], rank)
        except OSError as werr:
            message = f"{message} (and the error report: {werr})"
            return {"report": report, "paths": [], "error": message, "traceback": tb}
        return {
            "report": report,
            "paths": [str(path)],
            "error": f"{message} (report: {path})",
            "traceback": tb,
        }
    report = build_report(
        trace,
        options["device_memory_gib"],
        _DEFAULTS["live_set_limit"].default,
        margin=Margin(*options.get("margin", (None, None))),
    )
    try:
        paths = write_reports(report, blocks_csv(trace), options["output_dir"], rank)
    except OSError as err:
        return {"report": report, "paths": [], "error": f"--output-dir {options['output_dir']!r}: {err}"}
    return {"report": report, "paths": [str(p) for p in paths], "error": None}


def _crash_outcome(options: dict[str, Any], err: BaseException) -> dict[str, Any]:
    """The child died: an error report in the parent (stage ``simulation``) and the one-line error naming why."""
    from hyperdryrun.report import error_report, write_error_report

    message = f"rank {options['rank']}: {err}"
    report = error_report("simulation", err, _error_metadata(options))
    try:
        path = write_error_report(report, options["output_dir"], options["rank"])
    except OSError as werr:
        return {"report": report, "paths": [], "error": f"{message} (and the error report: {werr})"}
    return {"report": report, "paths": [str(path)], "error": f"{message} (report: {path})"}


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from hyperdryrun.child import ChildDied, ChildFailed, run_in_child
    from hyperdryrun.report.console import print_summary

    try:
        identity = _identity(args)
        check_cuda_environment(None, args.target_device)
        check_rank_outputs(args.output_dir, [identity["rank"] or 0])
    except ConfigError as err:
        return fail(str(err), err, args.debug)
    options = {
        "argv": list(args.torchtitan_args),
        **identity,
        "n_layers": args.n_layers,
        "attention": args.attention,
        "routing_from": args.routing_from,
        "measure": args.measure,
        "target_device": args.target_device,
        "device_memory_gib": args.device_memory_gib,
        "margin": (args.margin_gib, args.margin_pct),
        "output_dir": args.output_dir,
        "capture_stacks": not args.no_stacks,
    }
    if args.in_process:
        outcome = run_torchtitan_rank(options)
    else:
        try:
            outcome = run_in_child(run_torchtitan_rank, options)
        except ChildDied as err:
            outcome = _crash_outcome(options, err)
        except ChildFailed as err:
            if args.debug:
                sys.stderr.write(err.traceback_text)
            return fail(f"rank {options['rank']}: {err}", None, False)
    if outcome["error"]:
        if args.debug and outcome.get("traceback"):
            sys.stderr.write(outcome["traceback"])
        return fail(one_line(outcome["error"]), None, False)
    s = outcome["report"]["summary"]
    if args.quiet:
        what = "measured peak" if args.measure else "peak"
        Console().print(
            f"{what} {s['peak_gib']:.2f} GiB ({s['peak_phase']}); {s.get('verdict', '')}".rstrip("; ")
        )
    else:
        print_summary(outcome["report"], outcome["paths"])
    return EXIT_VERDICT if s.get("oom") or s.get("at_risk") else EXIT_OK
