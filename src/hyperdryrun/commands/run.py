"""``hyperdryrun run``: dry-run one training step of the built-in recipe for one rank (or several, each in its own
process) and write the reports."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from hyperdryrun.commands import EXIT_OK, EXIT_VERDICT, exit_code_of, fail, plain_int
from hyperdryrun.commands.job import (
    add_job_arguments,
    add_many_ranks_flags,
    add_skew_table_flag,
    job_from_args,
    print_warnings,
)
from hyperdryrun.commands.preflight import check_output_file, check_rank_outputs, job_inputs
from hyperdryrun.config import ConfigError


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "run",
        help="dry-run one training step of the built-in Llama recipe for one rank",
        description="Dry-run one training step as rank r of N on fake tensors and write "
        "<output-dir>/rank_<r>/rank_<r>_memory.{json,csv}. Exit 0: done (fits), 1: OOM against "
        "--device-memory-gib, 2: bad input, 3: internal error, 130/143: interrupted (SIGINT/SIGTERM).",
    )
    add_job_arguments(p)
    add_many_ranks_flags(p, "ranks with provably the same memory")
    p.add_argument("--no-stacks", action="store_true", help="do not capture Python stacks (faster)")
    p.add_argument("--quiet", action="store_true", help="print only the peak line")
    add_skew_table_flag(p)
    p.set_defaults(func=run)


def parse_ranks(args: argparse.Namespace, world_size: int) -> list[int] | None:
    """The ranks asked for with ``--ranks``/``--all-ranks`` (None: just the one rank of the config). ``--ranks``
    takes ranks and inclusive ranges, comma-separated (``0,7,63``, ``0-7,56-63``: how ``rank_classes.json`` writes a
    class's ranks), in the order given, each rank once."""
    if args.all_ranks and args.ranks:
        raise ConfigError("--ranks and --all-ranks: give one of them")
    if args.all_ranks:
        return list(range(world_size))
    if args.ranks is None:
        return None
    ranks: dict[int, None] = {}
    for part in args.ranks.split(","):
        first, dash, last = part.partition("-")
        lo = _one_rank(first if dash else part, args.ranks, world_size)
        hi = _one_rank(last, args.ranks, world_size) if dash else lo
        if hi < lo:
            raise ConfigError(f"--ranks: range {part.strip()!r} runs backwards (in {args.ranks!r})")
        ranks.update(dict.fromkeys(range(lo, hi + 1)))
    return list(ranks)


def _one_rank(text: str, given: str, world_size: int) -> int:
    try:
        r = plain_int(text.strip())
    except ValueError:
        raise ConfigError(f"--ranks: {text.strip()!r} is not an integer (in {given!r})") from None
    if not 0 <= r < world_size:
        raise ConfigError(f"--ranks: rank {r} must satisfy 0 <= rank < world_size={world_size}")
    return r


def run(args: argparse.Namespace) -> int:
    """Parse, run the rank(s) through :mod:`hyperdryrun.runner`, print; the exit code of
    :mod:`hyperdryrun.commands`."""

    from hyperdryrun.runner import run_rank

    warnings: list[str] = []
    try:
        cfg = job_from_args(args, warnings=warnings)
        ranks = parse_ranks(args, cfg.world.world_size)
        if ranks is not None and args.rank is not None:
            raise ConfigError("--rank and --ranks/--all-ranks: give one of them")
        if args.jobs is not None and args.jobs < 1:
            raise ConfigError(f"--jobs: must be >= 1 (got {args.jobs})")
        classes = None
        if args.all_ranks:
            from hyperdryrun.search.classes import rank_classes

            classes = rank_classes(cfg)
            ranks = [c.representative for c in classes]
            classes_file = Path(cfg.output_dir) / "rank_classes.json"
            check_output_file(classes_file, "--output-dir", True, job_inputs(args, cfg).values())
        inputs = job_inputs(args, cfg)
        check_rank_outputs(cfg.output_dir, [cfg.world.rank] if ranks is None else ranks, inputs=inputs)
        if args.skew_table:
            check_skew_table(ranks is not None, cfg.model.is_moe, cfg.model.name)
    except ConfigError as err:
        return fail(str(err), err, args.debug)
    print_warnings(warnings)
    if ranks is not None:
        from hyperdryrun.commands.frontdoor import run_many
        from hyperdryrun.jobs import RecipeJob

        job = RecipeJob(cfg)
        return run_many(job, cfg, ranks, args, None if classes is None else job.class_dicts(classes))
    code = finish_rank(run_rank(cfg, capture_stacks=not args.no_stacks), args)
    if args.skew_table:
        from hyperdryrun.commands.frontdoor import skew_table
        from hyperdryrun.jobs import RecipeJob

        try:
            table = skew_table(RecipeJob(cfg), cfg, cfg.world.rank, args, cfg.values.hot_expert)
        except ConfigError as err:
            return fail(str(err), err, args.debug)
        return table if table != EXIT_OK else code
    return code


def check_skew_table(many: bool, is_moe: bool | None, name: str) -> None:
    """``--skew-table`` runs one rank of a MoE job (one-line ConfigError otherwise; ``is_moe`` None: not known)."""
    if many:
        raise ConfigError("--skew-table runs the one rank again at each skew: drop --ranks/--all-ranks/--fit")
    if is_moe is False:
        raise ConfigError(f"--skew-table: {name!r} is a dense model (no experts to skew)")


def finish_rank(out: Any, args: argparse.Namespace) -> int:
    """Print one rank's outcome (its summary, or one line with ``--quiet``) and give the command's exit code: the
    error's, else 1 when the capacity verdict failed ("OOM" or "at risk"), else 0."""
    from rich.console import Console

    from hyperdryrun.report.console import print_summary, quiet_line

    if out.error:
        return exit_code_of([out], args.debug)
    s = out.report["summary"]
    if args.quiet:
        Console().print(quiet_line(s))
    else:
        print_summary(out.report, out.paths)
    return EXIT_VERDICT if out.verdict_failed else EXIT_OK
