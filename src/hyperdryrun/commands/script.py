"""``hyperdryrun script``: dry-run one training step of your own script (a Python file or ``module:function`` that
gives :func:`hyperdryrun.simulate`'s arguments, :mod:`hyperdryrun.integrations.script`) for one rank in a child
process, several ranks in worker processes (``--ranks``, ``--all-ranks``), or every layout the script declares
(``--fit``); the same reports, verdict and exit codes as ``run``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

from hyperdryrun.commands import (
    EXIT_OK,
    OneLineParser,
    fail,
    internal_error,
)
from hyperdryrun.commands.frontdoor import add_runner_flags
from hyperdryrun.commands.job import (
    ROUTING_FLAGS,
    RUN_FLAGS,
    TARGET_FLAGS,
    _dest,
    _set,
    add_flags,
    add_many_ranks_flags,
    add_skew_table_flag,
    merge_rank_identity,
    naming_flag,
    routing_from_args,
    target_from_args,
)
from hyperdryrun.commands.preflight import check_rank_outputs
from hyperdryrun.commands.run import finish_rank, parse_ranks
from hyperdryrun.config import ConfigError, JobConfig, build_config

SCRIPT_FLAGS = ("--world-size", "--rank", "--local-rank", *TARGET_FLAGS, "--output-dir", "--live-set-limit")
"""``run``'s flags that apply to a script's job (the rest describe the built-in recipe's model and layout)."""
IDENTITY = ("world_size", "rank", "local_rank")


class _ScriptParser(OneLineParser):
    """The command's flags; what follows ``--`` is the script's own arguments (``script_args``)."""

    def parse_known_args(
        self, args: Any = None, namespace: Any = None
    ) -> tuple[argparse.Namespace, list[str]]:
        namespace, extras = super().parse_known_args(args, namespace)
        if "--" in extras:
            cut = extras.index("--")
            namespace.script_args, extras = extras[cut + 1 :], extras[:cut]
        return namespace, extras


def register(subparsers: Any) -> None:
    p: OneLineParser = subparsers.add_parser(
        "script",
        help="dry-run one training step of your own script (a file or module:function giving simulate()'s "
        "arguments)",
        description="Dry-run one training step of your own model as rank r of N, in a child process: SCRIPT is a "
        "Python file or module[:function] whose function hyperdryrun_job(launch) returns hyperdryrun.simulate()'s "
        "arguments as a dict (model_fn, batch_fn, loss_fn or step_fn, parallelize_fn, optimizer_fn, mesh_shape, "
        "...), or a file that calls hyperdryrun.simulate(...) at its top level; arguments after -- are the "
        "script's own (its sys.argv[1:]). Writes "
        "<output-dir>/rank_<r>/rank_<r>_memory.{json,csv}. Exit 0: done (fits), 1: OOM against the capacity "
        "(--fit: no layout fits), 2: bad input, 3: internal error (a crash in the step: an error report naming "
        "the signal), 130/143: interrupted.",
    )
    p.add_argument("script", metavar="SCRIPT", help="train.py, train.py:function, package.module[:function]")
    p.__class__ = _ScriptParser
    p.set_defaults(script_args=[])
    add_flags(p, SCRIPT_FLAGS)
    add_flags(p, ROUTING_FLAGS)
    add_skew_table_flag(p)
    add_many_ranks_flags(p, "the job's rank_class; without one, every rank")
    p.add_argument(
        "--fit",
        action="store_true",
        help="dry-run every layout the script's hyperdryrun_layouts(world_size) declares (each rank class) "
        "against the capacity (--gpu or --device-memory-gib); the first that fits is chosen",
    )
    add_runner_flags(p)
    p.set_defaults(func=run)


# ------------------------------------------------------------------------------------------------- the job
def job_fields(args: argparse.Namespace, environ: Any = None) -> tuple[dict[str, int | None], dict[str, Any]]:
    """``(given, base)``: the rank identity the command line and torchrun's variables give (None: the script's),
    and the other job fields (target device, CUDA runtime, capacity, output), checked (one-line ConfigError)."""
    data: dict[str, Any] = {}
    merge_rank_identity(data, args, environ)
    world = data.get("world", {})
    given = {k: getattr(args, k) if getattr(args, k) is not None else world.get(k) for k in IDENTITY}
    base: dict[str, Any] = {}
    for flag in SCRIPT_FLAGS:
        path = RUN_FLAGS[flag][0]
        value = getattr(args, _dest(flag))
        if value is not None and not path.startswith("world."):
            _set(base, path, value)
    world = {k: v for k, v in given.items() if v is not None}
    if "world_size" not in world:  # the script's own, checked against it once known
        world["world_size"] = max([1, *(v + 1 for v in world.values() if isinstance(v, int) and v >= 0)])
    checked = {**base, "world": world}
    try:
        build_config(checked)
    except ConfigError as err:
        raise naming_flag(err) from None
    return given, base


def output_dir(base: dict[str, Any]) -> str:
    """The output directory of the job fields ``base`` (the default where none is given)."""
    return base.get("output_dir") or JobConfig.model_fields["output_dir"].default


def script_inputs(args: argparse.Namespace) -> dict[str, str | None]:
    """The file the script front door reads, by what names it (a run's outputs must not be it)."""
    from hyperdryrun.integrations.script import script_file

    return {"SCRIPT": script_file(args.script)}


def config_for(base: dict[str, Any], identity: dict[str, int | None]) -> Any:
    """The runner's job: ``base`` with the launched rank (the model and layout sections unused: the script's)."""
    return build_config({**base, "world": {k: v for k, v in identity.items() if v is not None}})


def run_script_rank(options: dict[str, Any]) -> Any:
    """One rank of a script in this process (the child's entry): resolve the rank (noted in ``identity_file`` for
    the parent, should this process die), simulate, write its reports; a :class:`~hyperdryrun.runner.RankOutcome`
    without its trace. Module level, so that a spawned child can run it."""
    from hyperdryrun.integrations.script import (
        ScriptError,
        ScriptExecute,
        load_script,
        resolve_identity,
        script_argv,
    )
    from hyperdryrun.runner import BAD_INPUT, RankOutcome, error_kind, run_rank

    rank = options["given"].get("rank") or 0
    try:
        with script_argv(options["spec"], options["argv"]):
            identity = resolve_identity(load_script(options["spec"]), options["given"])
        rank = identity["rank"] or 0
        cfg = config_for(options["base"], identity)
        if options.get("identity_file"):
            Path(options["identity_file"]).write_text(json.dumps(identity))
        execute = ScriptExecute(options["spec"], {}, tuple(options["argv"]), options.get("routing"))
        outcome = run_rank(cfg, capture_stacks=options["capture_stacks"], execute=execute)
    except (ScriptError, ConfigError) as err:
        return RankOutcome(rank, error=str(err), error_kind=BAD_INPUT)
    except BrokenPipeError:  # the script's own prints into a closed stdout (``| head``): 141, quietly
        raise
    except Exception as err:  # outside the step: in the script's loading or the reports
        tb = "".join(traceback.format_exception(err))  # for --debug
        return RankOutcome(
            rank, error=f"rank {rank}: {type(err).__name__}: {err}", error_kind=error_kind(err), traceback=tb
        )
    outcome.trace = None
    return outcome


def probe_script(
    spec: str, given: dict[str, int | None], layouts: bool, argv: tuple[str, ...] = ()
) -> dict[str, Any]:
    """What the parent needs before it starts workers: the launched world, and each layout's rank classes (the
    ranks of each class, a class per rank where the script declares no ``rank_class``). Runs in a child."""
    from hyperdryrun.integrations.script import ScriptError, load_script, script_argv

    try:
        with script_argv(spec, argv):
            return _probe_classes(load_script(spec), given, layouts)
    except (ScriptError, ConfigError) as err:
        return {"error": str(err)}


def _probe_classes(loaded: Any, given: dict[str, int | None], layouts: bool) -> dict[str, Any]:
    from hyperdryrun.integrations.script import (
        Launch,
        layouts_of,
        rank_class_of,
        resolve_identity,
        torchrun_environment,
    )

    identity = resolve_identity(loaded, given)
    size = identity["world_size"] or 1
    chosen = layouts_of(loaded, size) if layouts else [{}]
    classes = []
    for layout in chosen:
        groups: dict[str, list[int]] = {}
        keys: dict[str, Any] = {}
        for rank in range(size):
            local = rank if identity["local_rank"] is None else identity["local_rank"]
            with torchrun_environment(size, rank, local):
                key = rank_class_of(loaded, Launch(size, rank, local, layout))
            name = f"rank {rank}" if key is None else json.dumps(key, sort_keys=True, default=repr)
            groups.setdefault(name, []).append(rank)
            keys[name] = key
        classes.append([{"ranks": ranks, "key": keys[name]} for name, ranks in groups.items()])
    return {"identity": identity, "layouts": chosen, "classes": classes, "mode": loaded.mode}


# ------------------------------------------------------------------------------------------------- the command
def run(args: argparse.Namespace) -> int:
    """Parse, run the rank(s), print; the exit code of :mod:`hyperdryrun.commands`."""
    try:
        given, base = job_fields(args)
        args.routing_spec = routing_from_args(args)
        if args.jobs is not None and args.jobs < 1:
            raise ConfigError(f"--jobs: must be >= 1 (got {args.jobs})")
        many = args.ranks is not None or args.all_ranks
        if many and args.rank is not None:
            raise ConfigError("--rank and --ranks/--all-ranks: give one of them")
        if args.fit and (many or args.rank is not None):
            raise ConfigError(
                "--fit simulates every rank class of each layout: drop --rank/--ranks/--all-ranks"
            )
        if args.in_process and (many or args.fit):
            raise ConfigError("--in-process runs one rank: drop --ranks/--all-ranks/--fit")
        if args.fit and target_from_args(args).capacity_bytes is None:
            raise ConfigError("--fit needs a capacity: give --gpu or --device-memory-gib")
        if args.skew_table:
            from hyperdryrun.commands.run import check_skew_table

            check_skew_table(many or args.fit, None, "")
        # the outputs, before the script runs (its rank may be its own: the launched one's files, or rank 0's)
        check_rank_outputs(output_dir(base), [given.get("rank") or 0], inputs=script_inputs(args))
    except ConfigError as err:
        return fail(str(err), err, args.debug)
    if args.fit or many:
        return _many(args, given, base)
    return _one(args, given, base)


def _one(args: argparse.Namespace, given: dict[str, int | None], base: dict[str, Any]) -> int:

    from hyperdryrun.child import ChildDied, ChildFailed, run_in_child
    from hyperdryrun.runner import crashed_rank

    options = {
        "spec": args.script,
        "argv": list(args.script_args),
        "given": given,
        "base": base,
        "capture_stacks": not args.no_stacks,
        "routing": args.routing_spec,
    }
    if args.in_process:
        out = run_script_rank(options)
    else:
        with tempfile.TemporaryDirectory(prefix="hyperdryrun-script-") as tmp:
            options["identity_file"] = os.path.join(tmp, "identity.json")
            try:
                out = run_in_child(run_script_rank, options)
            except ChildDied as err:
                note = Path(options["identity_file"])
                identity = json.loads(note.read_text()) if note.exists() else given
                meta = {"script": {"spec": args.script}}
                out = crashed_rank(config_for(base, identity), err.exitcode, metadata=meta)
            except ChildFailed as err:
                if args.debug:
                    sys.stderr.write(err.traceback_text)
                return internal_error(str(err), None, args.debug)
    code = finish_rank(out, args)  # exit 1 for "at risk" as for OOM, as run does
    if not args.skew_table:
        return code
    from hyperdryrun.commands.frontdoor import skew_table
    from hyperdryrun.jobs import ScriptJob

    probed = _probe(args, given)
    if isinstance(probed, int):
        return probed
    identity = probed["identity"]
    job = ScriptJob(args.script, tuple(args.script_args), probed, args.routing_spec)
    spec = args.routing_spec
    try:
        table = skew_table(job, config_for(base, identity), identity["rank"] or 0, args, spec.hot_expert)
    except ConfigError as err:
        return fail(str(err), err, args.debug)
    return table if table != EXIT_OK else code


def _probe(args: argparse.Namespace, given: dict[str, int | None]) -> dict[str, Any] | int:
    """The probe's answer, or the exit code of its failure (printed)."""
    from hyperdryrun.child import ChildDied, ChildFailed, run_in_child

    try:
        probed = run_in_child(probe_script, args.script, given, args.fit, tuple(args.script_args))
    except ChildDied as err:
        return internal_error(f"loading {args.script!r}: {err}", None, args.debug, has_traceback=False)
    except ChildFailed as err:
        if args.debug:
            sys.stderr.write(err.traceback_text)
        return internal_error(str(err), None, args.debug)
    if "error" in probed:
        return fail(probed["error"])
    return probed


def _many(args: argparse.Namespace, given: dict[str, int | None], base: dict[str, Any]) -> int:
    """``--ranks``/``--all-ranks``/``--fit`` through the one runner of every front door
    (:mod:`hyperdryrun.commands.frontdoor`)."""
    from hyperdryrun.commands.frontdoor import fit_layouts, run_many
    from hyperdryrun.jobs import ScriptJob

    probed = _probe(args, given)
    if isinstance(probed, int):
        return probed
    identity = probed["identity"]
    size = identity["world_size"]
    job = ScriptJob(args.script, tuple(args.script_args), probed, args.routing_spec)
    if args.fit:
        root = base.get("output_dir") or config_for(base, identity).output_dir

        def config_at(out: str) -> Any:
            return config_for({**base, "output_dir": out}, {**identity, "rank": 0})

        title = f"{args.script}: {len(probed['layouts'])} layouts declared, {size} ranks"
        args.output_dir = root
        return fit_layouts(job, size, config_at, args, "declared", title)
    cfg = config_for(base, {**identity, "rank": 0})
    try:
        ranks = parse_ranks(args, size)
        assert ranks is not None
        check_rank_outputs(cfg.output_dir, ranks, inputs=script_inputs(args))
    except ConfigError as err:
        return fail(str(err), err, args.debug)
    return run_many(job, cfg, ranks, args, job.rank_classes(size, {}) if args.all_ranks else None)
