"""``hyperdryrun audit-kernels``: where CPU kernels differ from CUDA's and how the dry run follows CUDA.

Prints the audited ``DIFFERENCES`` table; with ``--reference FILE`` (a record made on fake "cuda" by a CUDA build of
torch, ``python -m hyperdryrun.world.audit --record FILE``) it re-runs the audit on this machine's simulation device
and exits 1 if any layer's ops, new storages or saved tensors differ.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def register(subparsers: Any) -> None:
    """Add the ``audit-kernels`` parser to ``subparsers``."""
    parser = subparsers.add_parser(
        "audit-kernels",
        help="show the CPU-vs-CUDA kernel differences the dry run models; --reference re-checks them",
    )
    parser.add_argument("--reference", metavar="FILE", help="reference recorded on fake 'cuda' (JSON)")
    parser.add_argument(
        "--layers", nargs="+", metavar="NAME", help="only these layers of the audit catalogue"
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the table; compare against ``args.reference`` when given. 0 ok, 1 mismatch, 2 bad input."""
    from rich.console import Console
    from rich.table import Table

    from hyperdryrun.world.kernels import DEFAULT_CUDA_TARGET, DIFFERENCES

    console = Console()
    table = Table(title=f"CPU vs CUDA kernels (target {DEFAULT_CUDA_TARGET.as_dict()})", show_lines=True)
    for column in ("layer", "CPU kernel", "CUDA kernel", "dry run"):
        table.add_column(column, overflow="fold")
    for d in DIFFERENCES:
        table.add_row(d.layer, d.cpu, d.cuda, d.handling)
    console.print(table)
    if not args.reference:
        return 0
    from hyperdryrun.commands import fail as _fail
    from hyperdryrun.world.audit import compare, load_reference

    try:
        reference = load_reference(args.reference)
        result = compare(reference, args.layers)
    except (OSError, ValueError, KeyError) as err:
        return _fail(f"--reference {args.reference}: {type(err).__name__}: {err}", err, args.debug)
    results = Table(title=f"audit against {args.reference} ({reference.get('torch_version')})")
    for column in ("layer", "result", "differences"):
        results.add_column(column, overflow="fold")
    for name, problems in result.items():
        if problems is None:
            results.add_row(name, "skipped", f"reference not recorded: {reference['layers'][name]['error']}")
        else:
            results.add_row(name, "DIFF" if problems else "ok", "\n".join(problems))
    console.print(results)
    bad = sorted(name for name, problems in result.items() if problems)
    if bad:
        sys.stderr.write(f"hyperdryrun: audit-kernels: {len(bad)} layer(s) differ: {', '.join(bad)}\n")
        return 1
    return 0
