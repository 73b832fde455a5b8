"""``hyperdryrun fit``: which layouts of a job fit the device, ranked by estimated step time
(:mod:`hyperdryrun.search.fit`)."""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from hyperdryrun.allocator.verdict import DEVICE_ERROR_FRACTION
from hyperdryrun.bounds import MAX_GIB, MAX_GLOBAL_SEQS, shown_number
from hyperdryrun.commands import EXIT_OK, EXIT_VERDICT, fail, plain_int
from hyperdryrun.commands.job import _BOOL, RUN_FLAGS, _dest, _set, naming_flag
from hyperdryrun.commands.preflight import check_output_dir, check_output_file, check_world_size
from hyperdryrun.config import ConfigError, build_config, load_yaml, rank_from_env
from hyperdryrun.search.space import DEFAULT_TOP

SEARCHED = {
    "parallel.dp_replicate", "parallel.dp_shard", "parallel.tp", "parallel.cp", "parallel.pp", "parallel.ep",
    "parallel.etp", "parallel.pp_schedule", "parallel.pp_virtual_stages", "parallel.pp_stage_layers",
    "training.micro_batch_size", "training.num_micro_batches", "training.ac",
}  # fmt: skip
"""Job fields the search sets: their flags take lists of values here."""
NOT_FOR_FIT = {
    "world.rank", "world.local_rank", "device_memory_gib", "margin_gib", "margin_pct", "output_dir", "live_set_limit",
}  # fmt: skip
JOB_FLAGS = {f: v for f, v in RUN_FLAGS.items() if v[0] not in SEARCHED | NOT_FOR_FIT}
"""The job flags of ``run`` that describe what every candidate shares (model, dtypes, sequence, optimizer, ...)."""


def _ints(text: str) -> tuple[int, ...]:
    return tuple(plain_int(x) for x in text.split(","))


_ints.__name__ = "comma-separated list of integers"


def _words(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


SPACE_FLAGS: dict[str, tuple[str, Any, str]] = {
    "--dp-replicate": ("dp_replicate", _ints, "HSDP replica counts to try (1)"),
    "--tp": ("tp", _ints, "tensor parallel degrees to try (1,2,4,8)"),
    "--pp": ("pp", _ints, "pipeline degrees to try (1,2,4,8)"),
    "--cp": ("cp", _ints, "context parallel degrees to try (1)"),
    "--ep": ("ep", _ints, "expert parallel degrees to try, MoE models (1,2,4,8)"),
    "--pp-schedule": (
        "pp_schedules",
        _words,
        "pipeline schedules to try (1F1B; multi-stage ones run every micro batch: slower)",
    ),
    "--pp-virtual-stages": ("pp_virtual_stages", _ints, "stages per rank of multi-stage schedules (2)"),
    "--micro-batch-size": ("micro_batch_sizes", _ints, "micro batch sizes to try (1,2)"),
    "--ac": ("ac", _words, "activation checkpointing modes to try (none,selective,full)"),
    "--max-micro-batches": (
        "max_micro_batches",
        int,
        "leave out layouts needing more micro batches per step (64)",
    ),
}


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "fit",
        help="search the layouts that fit a device, ranked by estimated step time",
        description="Enumerate the parallel layouts of a job over --world-size ranks, prune the invalid ones and "
        "those whose sharded states alone exceed the device, dry-run the rest by rank class and print the layouts "
        "that fit, fastest first (roofline estimate); layouts whose peak is within the margin under the capacity "
        "are 'at risk' and ranked after those that fit with margin. Exit 0: some layout fits with margin, 1: none "
        "does (none fits, or all that fit are at risk), 2: bad input, 3: internal error.",
    )
    p.add_argument("--config", metavar="job.yaml", help="YAML job description (its model, training, values)")
    for flag, (path, typ, help_) in JOB_FLAGS.items():
        if typ is _BOOL:
            p.add_argument(
                flag, dest=_dest(flag), action=argparse.BooleanOptionalAction, default=None, help=help_
            )
        else:
            p.add_argument(
                flag, dest=_dest(flag), type=typ, default=None, help=help_, metavar=path.split(".")[-1]
            )
    space = p.add_argument_group("search space")
    for flag, (field, typ, help_) in SPACE_FLAGS.items():
        space.add_argument(flag, dest=f"space_{field}", type=typ, default=None, help=help_, metavar=field)
    device = p.add_argument_group("device and batch")
    # --gpu is a job flag (cuda.gpu: the preset's kernels and allocator replay); fit also reads its capacity and
    # rates from it.
    device.add_argument("--device-memory-gib", type=float, help="capacity per device (default: the --gpu's)")
    device.add_argument(
        "--margin-gib",
        type=float,
        help="a peak within this many GiB under the capacity is 'at risk' (default: the model's measured error, "
        f"{100 * DEVICE_ERROR_FRACTION:g}%% of the capacity)",
    )
    device.add_argument("--margin-pct", type=float, help="the margin in percent of the capacity instead")
    device.add_argument("--global-batch-tokens", type=int, help="tokens per optimizer step (all ranks)")
    device.add_argument("--global-batch-seqs", type=int, help="sequences per optimizer step (all ranks)")
    for flag, help_ in (
        ("--peak-tflops", "dense bf16 TFLOP/s per GPU"),
        ("--hbm-gbps", "HBM GB/s per GPU"),
        ("--intra-node-gbps", "GB/s per GPU within a node, one direction"),
        ("--inter-node-gbps", "GB/s per GPU between nodes, one direction"),
    ):
        device.add_argument(flag, type=float, help=f"{help_} (default: the --gpu's)")
    device.add_argument("--gpus-per-node", type=int, help="GPUs per node (8)")
    run = p.add_argument_group("running")
    run.add_argument(
        "--top",
        type=int,
        default=DEFAULT_TOP,
        help=f"stop once the N fastest fitting layouts are known ({DEFAULT_TOP}; 0: all)",
    )
    run.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="simulations in parallel (default: the CPUs this process may use)",
    )
    run.add_argument("--executor", choices=("local", "ray"), default="local", help="local processes or Ray")
    run.add_argument("--ray-address", help="Ray cluster to connect to (default: $RAY_ADDRESS)")
    run.add_argument(
        "--cache-dir", help="result cache (default: $XDG_CACHE_HOME/hyperdryrun or ~/.cache/hyperdryrun)"
    )
    run.add_argument("--no-cache", action="store_true", help="neither read nor write the result cache")
    run.add_argument(
        "--no-shortcut", action="store_true", help="simulate every step in full (no extrapolation)"
    )
    run.add_argument("--json", metavar="PATH", help="write every candidate's result as JSON")
    run.add_argument("--csv", metavar="PATH", help="write every candidate's result as CSV")
    run.add_argument("--quiet", action="store_true", help="print only the counts and the best layout")
    run.add_argument("--debug", action="store_true", help="show tracebacks")
    p.set_defaults(func=run_fit)


# ------------------------------------------------------------------------------------------------ the request
def _base_job(args: argparse.Namespace) -> Any:
    """The job every candidate shares, validated (its errors name the flag)."""
    data: dict[str, Any] = load_yaml(args.config) if args.config else {}
    for section in ("parallel", "training"):
        node = data.get(section)
        if isinstance(node, dict):
            for path in SEARCHED:
                sec, leaf = path.split(".")
                if sec == section:
                    node.pop(leaf, None)
    world = data.get("world")
    if isinstance(world, dict):  # the search sets the rank of each class
        world.pop("rank", None)
        world.pop("local_rank", None)
    for flag, (path, _, _) in JOB_FLAGS.items():
        value = getattr(args, _dest(flag))
        if value is not None:
            _set(data, path, value)
    _world_size(data, args)
    try:
        cfg = build_config(data)
    except ConfigError as err:
        raise naming_flag(err) from None
    from hyperdryrun.commands.preflight import check_job_environment
    from hyperdryrun.search.space import base_job

    check_job_environment(cfg)  # every candidate's step reads it: a bad one is the user's, not a layout's
    return base_job(cfg)


def _world_size(data: dict[str, Any], args: argparse.Namespace) -> None:
    """The world to lay out, as ``run`` takes it: ``--world-size``, else ``$WORLD_SIZE``, else ``world.world_size``
    of ``--config``; a flag that contradicts the variable is an error, as in ``run``."""
    env = rank_from_env().get("world_size")
    if args.world_size is not None and env is not None and env != args.world_size:
        raise ConfigError(
            f"--world-size {args.world_size} conflicts with WORLD_SIZE={env} in the environment: drop one, or "
            "give the same value"
        )
    size = args.world_size if args.world_size is not None else env
    if size is not None:
        check_world_size(size, "--world-size" if args.world_size is not None else "WORLD_SIZE")
        _set(data, "world.world_size", size)
    elif (data.get("world") or {}).get("world_size") is None:
        raise ConfigError(
            "--world-size: required (the ranks of the job to lay out; or $WORLD_SIZE, or world.world_size in "
            "--config)"
        )


def _space(args: argparse.Namespace, is_moe: bool) -> Any:
    from hyperdryrun.search.space import SearchSpace

    given = {field: getattr(args, f"space_{field}") for _, (field, _, _) in SPACE_FLAGS.items()}
    given = {k: v for k, v in given.items() if v is not None}
    if not is_moe and given.get("ep", (1,)) != (1,):
        raise ConfigError(f"--ep {','.join(map(str, given['ep']))}: expert parallel needs an MoE model")
    try:
        return SearchSpace(**given)
    except ValueError as err:
        msg = str(err)
        for flag, (field, _, _) in SPACE_FLAGS.items():
            msg = msg.replace(f"search.{field}=", f"{flag} ")
        raise ConfigError(msg) from None


def _target(args: argparse.Namespace) -> Any:
    """The device target (:class:`~hyperdryrun.world.target.DeviceTarget`) of ``--gpu``, ``--device-memory-gib``
    and the margins, as every front door resolves it; the search needs its capacity."""
    from hyperdryrun.commands.job import target_from_args

    if args.gpu is None and args.device_memory_gib is None:
        raise ConfigError(
            "--gpu or --device-memory-gib: give the device (a GPU preset or its capacity in GiB)"
        )
    if args.device_memory_gib is not None and not 0 < args.device_memory_gib <= MAX_GIB:  # NaN fails too
        raise ConfigError(
            f"--device-memory-gib: must be a number > 0 and at most {MAX_GIB:,.0f} (got {args.device_memory_gib})"
        )
    return target_from_args(args)


def _global_seqs(args: argparse.Namespace, seq_len: int) -> int:
    tokens, seqs = args.global_batch_tokens, args.global_batch_seqs
    if (tokens is None) == (seqs is None):
        raise ConfigError("--global-batch-tokens or --global-batch-seqs: give exactly one")
    if seqs is not None:
        if seqs < 1:
            raise ConfigError(f"--global-batch-seqs: must be >= 1 (got {seqs})")
        _at_most("--global-batch-seqs", seqs, MAX_GLOBAL_SEQS)
        return seqs
    _at_most("--global-batch-tokens", tokens, MAX_GLOBAL_SEQS * seq_len)
    if tokens < 1 or tokens % seq_len:
        raise ConfigError(
            f"--global-batch-tokens: {tokens} is not a positive multiple of --seq-len {seq_len}"
        )
    return tokens // seq_len


def _at_most(flag: str, value: int, top: int) -> None:
    if value > top:
        raise ConfigError(f"{flag}: must be at most {top:,} (got {shown_number(value)})")


def _rates(args: argparse.Namespace, target: Any) -> Any:
    from hyperdryrun.world.gpus import GB

    given = {  # field: (its flag, the value given, the factor to the field's unit)
        "peak_flops": ("--peak-tflops", args.peak_tflops, 1e12),
        "hbm_bytes_per_s": ("--hbm-gbps", args.hbm_gbps, GB),
        "intra_node_bytes_per_s": ("--intra-node-gbps", args.intra_node_gbps, GB),
        "inter_node_bytes_per_s": ("--inter-node-gbps", args.inter_node_gbps, GB),
        "gpus_per_node": ("--gpus-per-node", args.gpus_per_node, 1),
    }
    over = {}
    for name, (flag, value, factor) in given.items():
        if value is not None and not (value > 0 and math.isfinite(value * factor)):
            raise ConfigError(f"{flag}: must be a finite number > 0 (got {value})")
        over[name] = None if value is None else value * factor
    return target.rates.with_overrides(**over)


def fit_job_from_args(args: argparse.Namespace) -> Any:
    """The :class:`~hyperdryrun.search.fit.FitJob` the flags ask for (one-line ConfigError otherwise)."""
    from hyperdryrun.search.fit import FitJob

    base = _base_job(args)
    is_moe = base.model.is_moe
    target = _target(args)
    capacity = target.capacity_bytes
    if args.top < 0:
        raise ConfigError(f"--top: must be >= 0 (got {args.top})")
    if args.jobs is not None and args.jobs < 1:
        raise ConfigError(f"--jobs: must be >= 1 (got {args.jobs})")
    return FitJob(
        base=base,
        capacity_bytes=capacity,
        global_batch_seqs=_global_seqs(args, base.training.seq_len),
        space=_space(args, is_moe),
        rates=_rates(args, target),
        gpu=target.gpu,
        top=args.top,
        shortcut=not args.no_shortcut,
        margin_bytes=target.margin_bytes,
        margin_source=target.margin.source(),
    )


# ------------------------------------------------------------------------------------------------ running
def run_fit(args: argparse.Namespace) -> int:
    """Parse, search, print, write; the exit code of :mod:`hyperdryrun.commands`."""
    from hyperdryrun.search.cache import ResultCache, default_cache_dir
    from hyperdryrun.search.executors import executor_for
    from hyperdryrun.search.fit import fit

    try:
        job = fit_job_from_args(args)
        if args.cache_dir is not None and not args.no_cache:
            check_output_dir(args.cache_dir, "--cache-dir")
        cache = ResultCache(None if args.no_cache else (args.cache_dir or default_cache_dir()))
        for flag, path in (("--json", args.json), ("--csv", args.csv)):
            if path:
                check_output_file(path, flag, inputs=(args.config, getattr(args, "hf_config", None)))
        if args.json and args.csv and os.path.abspath(args.json) == os.path.abspath(args.csv):
            raise ConfigError(f"--json and --csv: both name {args.json!r}; give two files")
        executor = executor_for(args.executor, args.jobs, args.ray_address)
    except (ConfigError, ValueError) as err:
        return fail(str(err), err, args.debug)
    try:
        with _progress(not args.quiet and sys.stderr.isatty(), getattr(executor, "jobs", 1)) as on_progress:
            outcome = fit(job, executor, cache, on_progress)
    except ConfigError as err:  # a candidate failed for a reason that is not its layout's
        return fail(str(err), err, args.debug)
    files: list[tuple[Path, str | bytes]] = []
    if args.json:
        files.append((Path(args.json), json.dumps(outcome_dict(outcome), indent=1) + "\n"))
    if args.csv:
        files.append((Path(args.csv), outcome_csv(outcome)))
    if files:
        from hyperdryrun.report.writer import write_together

        try:
            write_together(files)  # both or neither
        except OSError as err:
            return fail(f"cannot write {err.filename or ''} ({err.strerror or err})", err, args.debug)
    print_outcome(outcome, quiet=args.quiet, written=[p for p in (args.json, args.csv) if p])
    return EXIT_OK if outcome.fits_with_margin() else EXIT_VERDICT


class _progress:
    """A live "candidates done/total · fit (and at risk, oom, pruned, invalid, failed once any) · time left for the
    layouts in flight (:func:`~hyperdryrun.search.fit.eta_in_flight`) · the layout and rank being simulated ·
    elapsed" line on stderr (a terminal only). A search's total is not known ahead: it stops once ``--top`` layouts fit."""

    def __init__(self, show: bool, workers: int = 1) -> None:
        self.show = show
        self.workers = workers
        self._progress: Any = None
        self._task: Any = None

    def __enter__(self) -> Any:
        if not self.show:
            return None
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._progress = Progress(
            TextColumn("candidates"),
            BarColumn(bar_width=12),  # rich's 40 would leave an 80-column terminal little room for the state
            MofNCompleteColumn(),
            TextColumn("{task.fields[state]}"),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            transient=True,
        )
        self._progress.__enter__()
        self._task = self._progress.add_task("fit", total=None, state="")
        return self.update

    def update(self, outcome: Any) -> None:
        done = sum(bool(r.status) for r in outcome.results)
        state = progress_state(outcome, self.workers)
        self._progress.update(self._task, total=len(outcome.results), completed=done, state=state)

    def __exit__(self, *exc: Any) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)


def progress_state(outcome: Any, workers: int) -> str:
    """The live line's text after the count: the statuses so far, the layouts waiting because a stage is within
    the margin (they run only if too few layouts fit with margin), the time left for the layouts in flight and
    what the workers are simulating."""
    from hyperdryrun.search.fit import eta_in_flight

    c = outcome.counts()
    # the fits always, the other statuses once they occur (an 80-column terminal cuts the line's end)
    state = f"fit {c['fits']}" + "".join(
        f" · {name} {c[key]}"
        for name, key in (("at risk", "at_risk"), ("oom", "oom"), ("pruned", "pruned"), ("invalid", "invalid"),
                          ("failed", "failed"))
        if c[key]
    )  # fmt: skip
    waiting = sum(1 for r in outcome.results if r.deferred and not r.status)
    if waiting:
        state += f" · {waiting} within the margin (waiting)"
    running = list(outcome.running.values())
    if (
        running
    ):  # how long the layouts in flight will take, then what the workers are simulating now (the time
        # first: a terminal too narrow for the whole line cuts its end)
        left = eta_in_flight(outcome, workers)
        if left is not None:
            state += f" · ~{_duration(left)} left for the layouts in flight"
        state += f" · {running[0]}" + (f" (+{len(running) - 1})" if len(running) > 1 else "")
    return state


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


# ------------------------------------------------------------------------------------------------ outputs
CSV_COLUMNS = (
    "order", "status", "layout", "dp_replicate", "dp_shard", "tp", "pp", "cp", "ep", "etp", "pp_schedule",
    "pp_virtual_stages", "micro_batch_size", "num_micro_batches", "ac", "est_step_s", "tokens_per_s_per_gpu",
    "state_bound_bytes", "peak_allocated_bytes", "peak_reserved_bytes", "peak_device_bytes", "headroom_bytes",
    "worst_rank", "rank_classes", "methods", "reason",
)  # fmt: skip


def _row(outcome: Any, order: int, r: Any) -> dict[str, Any]:
    from hyperdryrun.search.fit import verdict_bytes

    worst = r.worst
    headroom = None
    if worst is not None and worst.figures is not None:
        headroom = outcome.job.capacity_bytes - verdict_bytes(worst.figures, r.basis)
    return {
        "order": order,
        "status": r.status,
        "layout": r.candidate.layout.label(),
        **r.candidate.layout.to_dict(),
        "est_step_s": None if r.time is None else round(r.time.total, 6),
        "tokens_per_s_per_gpu": None if r.time is None else round(r.time.tokens_per_s_per_gpu, 3),
        "state_bound_bytes": None if r.bound is None else r.bound.bytes,
        "peak_allocated_bytes": r.peak("peak_bytes"),
        "peak_reserved_bytes": r.peak("peak_reserved_bytes"),
        "peak_device_bytes": r.peak("peak_device_bytes"),
        "headroom_bytes": headroom,
        "worst_rank": None if worst is None else worst.rank_class.representative,
        "rank_classes": len(r.classes),
        "methods": "+".join(sorted(set(r.methods))),
        "reason": r.reason,
    }


def _ordered(outcome: Any) -> list[Any]:
    from hyperdryrun.search.fit import _order

    return sorted(outcome.results, key=lambda r: (r.time is None, *_order(r)))


def outcome_dict(outcome: Any) -> dict[str, Any]:
    """Every candidate, fastest estimate first, with its classes and their figures."""
    from hyperdryrun.search.cache import versions

    job = outcome.job
    rates = job.rates
    out = []
    for i, r in enumerate(_ordered(outcome)):
        row = _row(outcome, i, r)
        row["step_time"] = None if r.time is None else r.time.to_dict()
        row["classes"] = [
            {
                "representative": c.rank_class.representative,
                "ranks": list(c.rank_class.ranks),
                "what": c.rank_class.describe(),
                "cached": c.cached,
                "seconds": round(c.seconds, 3),
                "figures": None if c.figures is None else c.figures.to_dict(),
                "confirmed": c.confirmed,
                "error": c.error,
            }
            for c in r.classes
        ]
        out.append(row)
    return {
        "kind": "hyperdryrun-fit",
        "schema_version": "1.0",
        "model": job.base.model.model_dump(),
        "world_size": job.base.world.world_size,
        "gpu": job.gpu,
        "capacity_bytes": job.capacity_bytes,
        "margin_bytes": job.margin_bytes,
        "margin_source": job.margin_source,
        "global_batch_seqs": job.global_batch_seqs,
        "seq_len": job.base.training.seq_len,
        "top": job.top,
        "shortcut": job.shortcut,
        "rates": None if rates is None else {k: getattr(rates, k) for k in rates.__dataclass_fields__},
        "versions": versions(),
        "counts": outcome.counts(),
        "seconds": round(outcome.seconds, 3),
        "candidates": out,
    }


def outcome_csv(outcome: Any) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, CSV_COLUMNS, lineterminator="\n", extrasaction="ignore")
    w.writeheader()
    for i, r in enumerate(_ordered(outcome)):
        w.writerow(_row(outcome, i, r))
    return buf.getvalue()


def _gib(n: int | None) -> str:
    return "—" if n is None else f"{n / 2**30:,.2f}"


def print_outcome(outcome: Any, quiet: bool = False, written: list[str] | None = None) -> None:
    """The counts, the table of the layouts that fit (fastest first) and what was used to get them."""
    from hyperdryrun.report.console import output_console
    from hyperdryrun.report.layouts import seconds
    from hyperdryrun.search.fit import verdict_bytes

    console = output_console(pipe_width=160)
    job, c = outcome.job, outcome.counts()
    seq = job.base.training.seq_len
    device = f"{job.gpu} " if job.gpu else ""
    console.print(
        f"[bold]{job.base.model.name}[/] · {job.base.world.world_size} x {device}"
        f"({job.capacity_bytes / 2**30:.2f} GiB each) · global batch {job.global_batch_seqs * seq:,} tokens "
        f"({job.global_batch_seqs} x {seq})"
    )
    if job.base.model.is_moe:
        from hyperdryrun.jobs import routing_title

        console.print(routing_title(job.base.values), soft_wrap=True)
    skipped = f" · {c['skipped']} not needed (--top {job.top})" if c["skipped"] else ""
    console.print(
        f"candidates: {c['enumerated']} enumerated · {c['invalid']} invalid · {c['pruned']} pruned · "
        f"{c['simulated']} simulated · {c['cached']} cached · {c['failed']} failed{skipped} · "
        f"[bold]{c['fits']} fit[/]"
        + (f", [yellow]{c['at_risk']} at risk[/]" if c["at_risk"] else "")
        + f", {c['oom']} do not"
    )
    ranked = outcome.ranked()
    bases = {r.basis for r in ranked}
    basis = bases.pop() if len(bases) == 1 else "allocated"
    note = {
        "allocated": "allocated bytes (the allocator's reserved/device figures are not in these results)",
        "reserved": "the allocator model's reserved bytes",
        "device": "the allocator model's device bytes (reserved + context and workspaces)",
    }[basis]
    if not quiet:
        console.print(
            f"fits = worst rank's peak within capacity, on {note}, more than the {job.margin_bytes / 2**30:.2f} "
            "GiB margin under it; at risk = within the margin, ranked after; peaks and headroom in GiB; "
            "step time: roofline estimate",
            soft_wrap=True,
        )
    if ranked and not quiet:
        from hyperdryrun.report.layouts import LayoutRow, layout_table

        rows = []
        for i, r in enumerate(ranked, 1):
            lay, w = r.candidate.layout, r.worst
            # "confirmed": extrapolated, then run in full for the device figure
            methods = sorted({"confirmed" if c.confirmed else c.figures.method for c in r.simulated_classes})
            rows.append(
                LayoutRow(
                    i, lay.label(), "at_risk" if r.status == "at_risk" else "fits",
                    batch=f"{lay.micro_batch_size} x {lay.num_micro_batches}", ac=lay.ac, step_s=r.time.total,
                    tokens_per_s_per_gpu=r.time.tokens_per_s_per_gpu, allocated=r.peak("peak_bytes"),
                    reserved=r.peak("peak_reserved_bytes"), device=r.peak("peak_device_bytes"),
                    headroom=job.capacity_bytes - verdict_bytes(w.figures, r.basis),
                    worst_rank=w.rank_class.representative, classes=len(r.classes),
                    method="+".join(methods) + (" (cached)" if r.cached else ""),
                )
            )  # fmt: skip
        console.print(layout_table(rows, width=console.width if console.is_terminal else None))
    elif ranked:
        r = ranked[0]
        console.print(f"best: {r.candidate.layout.label()} mbs {r.candidate.layout.micro_batch_size} "
                      f"ac {r.candidate.layout.ac}, est. step {seconds(r.time.total)}")  # fmt: skip
    else:
        console.print("[red]no layout fits[/]")
    if ranked and not outcome.fits_with_margin():
        console.print("[yellow]no layout fits with margin[/]: every one that fits is at risk (exit 1)")
    failed = [r for r in outcome.results if r.status == "failed"]
    if failed and not quiet:
        reasons: dict[str, int] = {}
        for r in failed:
            reasons[r.reason.split(": ", 1)[-1]] = reasons.get(r.reason.split(": ", 1)[-1], 0) + 1
        for reason, n in reasons.items():
            console.print(f"[red]failed[/] ({n}): {reason}", soft_wrap=True)
    if not quiet:
        classes, from_cache, layouts = c["rank_classes"], c["cached_classes"], c["simulated"] + c["cached"]
        console.print(
            (
                f"rank classes: {classes} simulations for the {layouts} layouts dry-run; "
                if not from_cache
                else f"rank classes: {classes} for the {layouts} layouts dry-run, "
                f"{'all' if from_cache == classes else from_cache} answered from the cache (simulated by an earlier "
                "run); "
            )
            + f"{c['extrapolated']} extrapolated from samples (exact), the rest in full"
            + (
                f"; {c['confirmed']} of those run again in full for the device figure"
                if c["confirmed"]
                else ""
            )
            + (
                f"; {c['stopped_classes']} more for layouts stopped part-way (not needed)"
                if c["stopped_classes"]
                else ""
            )
            + f" · {outcome.seconds:,.1f} s"
        )
        for p in written or []:
            console.print(f"[dim]wrote {p}[/]", soft_wrap=True)
