"""``hyperdryrun audit-kernels``: where CPU kernels differ from CUDA's and how the dry run follows CUDA.

Prints the audited ``DIFFERENCES`` table. ``--reference FILE`` re-runs the kernel audit (:mod:`hyperdryrun.audit`) on
this machine's simulation device against a reference and exits 1 if any layer's ops, new storages or saved tensors
differ; ``--record FILE`` makes such a reference, on the CUDA wheel of torch (fake "cuda" tensors, no GPU needed).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from hyperdryrun.commands import EXIT_OK, EXIT_VERDICT, fail

DESCRIPTION = (
    "Show where CPU kernels allocate or save for backward differently from CUDA's, and how the dry run follows "
    "CUDA there. With --reference FILE, re-run the kernel audit (ops, new storages and saved tensors of a "
    "catalogue of common layers) on this machine's simulation device against a reference recorded on fake 'cuda', "
    "and exit 1 if any layer differs. With --record FILE, record such a reference: this needs the CUDA wheel of "
    "torch (fake 'cuda' tensors; no GPU is needed)."
)


def register(subparsers: Any) -> None:
    """Add the ``audit-kernels`` parser to ``subparsers``."""
    parser = subparsers.add_parser(
        "audit-kernels",
        help="show the CPU-vs-CUDA kernel differences the dry run models; --reference re-checks them",
        description=DESCRIPTION,
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--reference", metavar="FILE", help="compare the simulation device against this reference (JSON)"
    )
    source.add_argument(
        "--record",
        metavar="FILE",
        help="record a reference on fake 'cuda' into FILE; needs the CUDA wheel of torch (no GPU)",
    )
    parser.add_argument(
        "--layers",
        nargs="+",
        metavar="NAME",
        help="only these layers of the audit catalogue (with --reference or --record)",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the table, compare against ``--reference`` or record ``--record``. 0 ok, 1 mismatch, 2 bad input."""
    if args.layers:
        problem = _check_layers(args)
        if problem:
            return fail(problem)
    if args.record:
        return _record(args)
    from rich.console import Console
    from rich.table import Table

    from hyperdryrun.world.cuda_target import DEFAULT_CUDA_TARGET, DIFFERENCES

    reference = None
    if args.reference:  # read and checked before anything is printed
        from hyperdryrun.audit import load_reference

        try:
            reference = load_reference(args.reference)
        except (OSError, ValueError) as err:
            return fail(f"--reference {args.reference}: {err}", err, args.debug)
    console = Console()
    simulated = _simulated()
    console.print(
        f"CPU vs CUDA kernels · CUDA target: {DEFAULT_CUDA_TARGET.describe()} · simulated: {simulated}",
        markup=False,
        highlight=False,
    )
    table = Table(show_lines=True)
    for column in ("layer", "CPU kernel", "CUDA kernel", "dry run"):
        table.add_column(column, overflow="fold")
    for d in DIFFERENCES:
        table.add_row(d.layer, d.cpu, d.cuda, d.handling)
    console.print(table)
    if reference is None:
        return EXIT_OK
    from hyperdryrun.audit import compare, describe_reference
    from hyperdryrun.audit.diff import KnownDifference

    try:
        result = compare(reference, args.layers)
    except (OSError, ValueError) as err:
        return fail(f"--reference {args.reference}: {type(err).__name__}: {err}", err, args.debug)
    console.print(
        f"audit against {args.reference} · CUDA reference: {describe_reference(reference)} · simulated: {simulated}",
        markup=False,
        highlight=False,
    )
    results = Table()
    for column in ("layer", "result", "differences"):
        results.add_column(column, overflow="fold")
    for name, problems in result.items():
        if problems is None:
            results.add_row(name, "skipped", f"reference not recorded: {reference['layers'][name]['error']}")
        elif isinstance(problems, KnownDifference):
            why = f"audited difference '{problems.difference.layer}' ({problems.difference.handling}); bytes agree"
            results.add_row(name, "known", "\n".join([why, *problems]))
        else:
            results.add_row(name, "DIFF" if problems else "ok", "\n".join(problems))
    console.print(results)
    bad = sorted(
        name for name, problems in result.items() if problems and not isinstance(problems, KnownDifference)
    )
    if bad:
        sys.stderr.write(f"hyperdryrun: audit-kernels: {len(bad)} layer(s) differ: {', '.join(bad)}\n")
        return EXIT_VERDICT
    return EXIT_OK


def _check_layers(args: argparse.Namespace) -> str | None:
    """Why ``--layers`` cannot be used as given, or None."""
    from hyperdryrun.audit import LAYERS

    unknown = [n for n in args.layers if n not in LAYERS]
    if unknown:
        return f"--layers: unknown layer {', '.join(map(repr, unknown))} (known: {', '.join(LAYERS)})"
    if not (args.reference or args.record):
        return "--layers picks the layers to audit: give --reference FILE or --record FILE with it"
    return None


def _simulated() -> str:
    from hyperdryrun.compat.versions import torch_version
    from hyperdryrun.world import default_simulation_device

    return f"torch {torch_version()} on {default_simulation_device()}"


def _record(args: argparse.Namespace) -> int:
    import torch

    from hyperdryrun.compat.versions import torch_version

    if not torch.backends.cuda.is_built():
        return fail(
            f"--record {args.record}: needs the CUDA wheel of torch (fake 'cuda' tensors, no GPU needed); "
            f"this is torch {torch_version()}"
        )
    from hyperdryrun.audit import record
    from hyperdryrun.report.writer import atomic_write

    try:
        data = record("cuda", "walk", args.layers)
        atomic_write(Path(args.record), json.dumps(data, indent=1, sort_keys=True) + "\n")
    except OSError as err:
        return fail(f"--record {args.record}: {type(err).__name__}: {err}", err, args.debug)
    print(f"recorded {len(data['layers'])} layers to {args.record}")
    return EXIT_OK
