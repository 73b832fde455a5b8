"""``hyperdryrun torchtitan``: dry-run one training step of a torchtitan job as it is (torchtitan's own ``--module``,
``--config`` and overrides) for one rank, in a child process, and write the reports; ``--measure`` executes the
same step for real on the CPU instead (the ground truth, as ``hyperdryrun measure`` is for ``run``)."""

from __future__ import annotations

import argparse
import sys
import traceback
from typing import Any

from hyperdryrun.commands import EXIT_OK, EXIT_VERDICT, OneLineParser, fail, one_line
from hyperdryrun.commands.fit import _ints
from hyperdryrun.commands.frontdoor import add_runner_flags
from hyperdryrun.commands.job import (
    ROUTING_FLAGS,
    TARGET_FLAGS,
    add_flags,
    add_many_ranks_flags,
    add_skew_table_flag,
    flag_data,
    routing_from_args,
    target_from_args,
)
from hyperdryrun.commands.measure import CPU_ONLY_NOTE
from hyperdryrun.commands.preflight import check_cuda_environment, check_rank_outputs
from hyperdryrun.config import ConfigError, JobConfig, build_config, check_rank, rank_from_env
from hyperdryrun.search.space import SearchSpace

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
        "(fits), 1: OOM against --device-memory-gib (--all-ranks: on the worst rank; --fit: no layout fits), 2: "
        "error.",
        allow_abbrev=False,
    )
    p.__class__ = _PassThroughParser
    p.add_argument(
        "--world-size",
        type=int,
        help="ranks in the job (default: $WORLD_SIZE, else the product of torchtitan's parallelism degrees; one rank: "
        "else 1, a process started without torchrun)",
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
    add_flags(p, TARGET_FLAGS)
    add_flags(p, ROUTING_FLAGS)
    add_skew_table_flag(p)
    p.add_argument("--output-dir", default=_DEFAULTS["output_dir"].default, help="where rank_<r>/ goes")
    add_many_ranks_flags(
        p,
        "ranks of the same pipeline stage and context-parallel position whose parameter shards have the same "
        "shapes; writes rank_classes.json",
    )
    p.add_argument(
        "--fit",
        action="store_true",
        help="search torchtitan's parallelism degrees for the world size: every layout of --fit-tp x --fit-pp x "
        "--fit-cp x --fit-ep that fills it (dp_shard takes the rest; the job's other settings as given), each "
        "rank class dry-run against --device-memory-gib, in <output-dir>/layout_<i>/; the first that fits (least "
        "tp, then pp, cp, ep) is chosen",
    )
    for name, default in (
        ("tp", SearchSpace.tp),
        ("pp", SearchSpace.pp),
        ("cp", SearchSpace.cp),
        ("ep", (1,)),
    ):
        p.add_argument(
            f"--fit-{name}",
            type=_ints,
            default=default,
            metavar=",".join(map(str, default)),
            help=f"{name} degrees --fit tries ({','.join(map(str, default))})",
        )
    add_runner_flags(p)
    p.set_defaults(func=run)


def _identity(args: argparse.Namespace) -> dict[str, int | None]:
    env = rank_from_env()
    world_size = args.world_size if args.world_size is not None else env.get("world_size")
    rank = args.rank if args.rank is not None else env.get("rank", 0)
    local_rank = args.local_rank if args.local_rank is not None else env.get("local_rank")
    if world_size is not None and world_size < 1:
        raise ConfigError(f"--world-size: must be >= 1 (got {world_size})")
    check_rank(rank, world_size)
    if args.n_layers is not None and args.n_layers < 1:
        raise ConfigError(f"--n-layers: must be >= 1 (got {args.n_layers})")
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
    from hyperdryrun.integrations.torchtitan import TorchtitanError, simulate_torchtitan
    from hyperdryrun.integrations.torchtitan_ranks import infer_world_size
    from hyperdryrun.measure.step import MeasureError
    from hyperdryrun.measure.torchtitan import measure_torchtitan
    from hyperdryrun.report import blocks_csv, build_report, error_report, write_error_report, write_reports

    options = dict(options)
    rank, target = options["rank"], options["target"]
    try:
        if options["world_size"] is None:
            # a process started without torchrun is a world of one, as torchtitan's own launch has it
            options["world_size"] = infer_world_size(options["argv"]) or 1
            check_rank(rank, options["world_size"], TorchtitanError)
        job = {
            "world_size": options["world_size"],
            "rank": rank,
            "local_rank": options["local_rank"],
            "n_layers": options["n_layers"],
            "capture_stacks": options["capture_stacks"],
            "attention": options.get("attention"),
            "cuda": target.runtime,
        }
        if options.get("routing") is not None:
            job["routing_spec"] = options["routing"]
        if options.get("measure"):
            trace = measure_torchtitan(options["argv"], **job)
            if target.device != "cpu":
                trace.limitations.append(CPU_ONLY_NOTE.format(target=target.device))
        else:
            trace = simulate_torchtitan(options["argv"], target_device=target.device, **job)
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
    report = build_report(trace, target, _DEFAULTS["live_set_limit"].default)
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
    from hyperdryrun.report.console import print_summary, quiet_line

    try:
        identity = _identity(args)
        target = target_from_args(args)
        routing = forced_routing(args)
        check_cuda_environment(target.runtime, target.device)
        check_rank_outputs(args.output_dir, [identity["rank"] or 0])
        many = args.ranks is not None or args.all_ranks or args.fit
        if many:
            _check_many(args, target)
        if args.skew_table:
            from hyperdryrun.commands.run import check_skew_table

            check_skew_table(many or args.measure, None, "")
    except ConfigError as err:
        return fail(str(err), err, args.debug)
    if many:
        return _many(args, identity)
    options = {
        "argv": list(args.torchtitan_args),
        **identity,
        "n_layers": args.n_layers,
        "attention": args.attention,
        "routing": routing,
        "measure": args.measure,
        "target": target,
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
        Console().print(quiet_line(s, "measured peak" if args.measure else "peak"))
    else:
        print_summary(outcome["report"], outcome["paths"])
    code = EXIT_VERDICT if s.get("oom") or s.get("at_risk") else EXIT_OK
    if args.skew_table:
        return _skew_table(args, identity, routing) or code
    return code


def _skew_table(args: argparse.Namespace, identity: dict[str, int | None], routing: Any) -> int:
    """``--skew-table`` of one rank (:func:`hyperdryrun.commands.frontdoor.skew_table`)."""
    from hyperdryrun.commands.frontdoor import skew_table
    from hyperdryrun.integrations.torchtitan_ranks import TorchtitanError, infer_world_size
    from hyperdryrun.jobs import TorchtitanFrontJob

    job = TorchtitanFrontJob(tuple(args.torchtitan_args), args.n_layers, args.attention, False, None, routing)
    try:
        size = identity["world_size"] or infer_world_size(job.argv) or 1
        cfg = _config(args, identity, size, args.output_dir)
        return skew_table(job, cfg, identity["rank"] or 0, args, routing.hot_expert if routing else 0)
    except (ConfigError, TorchtitanError) as err:
        return fail(one_line(str(err)), err, args.debug)


def forced_routing(args: argparse.Namespace) -> Any:
    """The routing flags' :class:`~hyperdryrun.world.routing.RoutingSpec`, None where none is given (a dry run then
    routes balanced, a measured run as its router decides)."""
    given = any(getattr(args, f.lstrip("-").replace("-", "_")) is not None for f in ROUTING_FLAGS)
    return routing_from_args(args) if given else None


# ------------------------------------------------------------------------------------------------- many ranks
def _check_many(args: argparse.Namespace, target: Any) -> None:
    """The flags of --ranks/--all-ranks/--fit that go together (one-line ConfigError)."""
    if args.rank is not None:
        raise ConfigError("--rank and --ranks/--all-ranks/--fit: give one of them")
    if args.fit and (args.ranks is not None or args.all_ranks):
        raise ConfigError("--fit simulates every rank class of each layout: drop --ranks/--all-ranks")
    if args.in_process:
        raise ConfigError("--in-process runs one rank: drop --ranks/--all-ranks/--fit")
    if args.jobs is not None and args.jobs < 1:
        raise ConfigError(f"--jobs: must be >= 1 (got {args.jobs})")
    if args.fit and target.capacity_bytes is None:
        raise ConfigError("--fit needs a capacity: give --gpu or --device-memory-gib")
    if args.fit and args.measure:
        raise ConfigError("--fit dry-runs each layout: drop --measure")
    for name in ("tp", "pp", "cp", "ep"):
        values = getattr(args, f"fit_{name}")
        if any(v < 1 for v in values):
            raise ConfigError(f"--fit-{name}: degrees must be >= 1 (got {','.join(map(str, values))})")


def _many(args: argparse.Namespace, identity: dict[str, int | None]) -> int:
    """``--ranks``/``--all-ranks``/``--fit`` through the one runner of every front door
    (:mod:`hyperdryrun.commands.frontdoor`): the same tables, classes file and exit codes as ``script``'s."""
    from hyperdryrun.commands.frontdoor import fit_layouts, run_many
    from hyperdryrun.commands.run import parse_ranks
    from hyperdryrun.integrations.torchtitan_ranks import TorchtitanError, infer_world_size
    from hyperdryrun.jobs import TorchtitanFrontJob

    space = SearchSpace(tp=args.fit_tp, pp=args.fit_pp, cp=args.fit_cp, ep=args.fit_ep)
    job = TorchtitanFrontJob(
        tuple(args.torchtitan_args), args.n_layers, args.attention, args.measure, space, forced_routing(args)
    )
    try:
        size = identity["world_size"] or infer_world_size(job.argv)
        if size is None:
            raise ConfigError(
                "--world-size: torchtitan's parallelism degrees leave the world size open "
                "(parallelism.data_parallel_shard_degree -1); give --world-size or $WORLD_SIZE"
            )
        cfg = _config(args, identity, size, args.output_dir)
        if args.fit:
            return fit_layouts(job, size, lambda out: _config(args, identity, size, out), args, "searched")
        ranks = parse_ranks(args, size)
        assert ranks is not None
        classes = job.rank_classes(size, {}) if args.all_ranks else None
    except (ConfigError, TorchtitanError) as err:
        return fail(one_line(str(err)), err, args.debug)
    return run_many(job, cfg, ranks, args, classes, mode="measured" if args.measure else "dry-run")


def _config(
    args: argparse.Namespace, identity: dict[str, int | None], size: int, output_dir: str
) -> JobConfig:
    """The runner's job: the world, the device target (:data:`TARGET_FLAGS`) and output (the model is
    torchtitan's)."""
    world = {"world_size": size, "rank": 0}
    if identity["local_rank"] is not None:
        world["local_rank"] = identity["local_rank"]
    return build_config({**flag_data(args, TARGET_FLAGS), "world": world, "output_dir": output_dir})
