"""``hyperdryrun snapshot REPORT -o OUT.pickle``: a report as a CUDA memory snapshot for PyTorch's memory viewer."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    """Add the ``snapshot`` parser and its handler."""
    p = subparsers.add_parser(
        "snapshot",
        help="write a report as a CUDA memory snapshot pickle (torch.cuda.memory._snapshot format)",
        description="Convert a report (JSON with its CSV beside it), a memory-block CSV or a profiler trace into "
        "the pickle that torch.cuda.memory._dump_snapshot writes, for pytorch.org/memory_viz and "
        "python -m torch.cuda._memory_viz (trace_plot, segment_plot, stats).",
    )
    p.add_argument("input", metavar="REPORT", help="report .json (its .csv beside it), block .csv or trace")
    p.add_argument(
        "-o", "--output", default=None, help="the pickle to write (default: REPORT with _snapshot.pickle)"
    )
    p.add_argument("--device", default=None, help="device of a multi-device trace or snapshot (e.g. cuda:1)")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.set_defaults(func=run)


def default_output(path: str) -> Path:
    p = Path(path)
    return p.with_name(f"{p.stem}_snapshot.pickle")


def run(args: argparse.Namespace) -> int:
    """Load, convert, write; 2 with a one-line error on bad input or an unwritable output."""
    from hyperdryrun.commands import EXIT_OK, fail
    from hyperdryrun.commands.preflight import check_output_file
    from hyperdryrun.config import ConfigError
    from hyperdryrun.viz import SnapshotError, VizInputError, load_side, write_snapshot

    out = Path(args.output) if args.output else default_output(args.input)
    try:
        check_output_file(
            out, "--output", make_parent=True, inputs=[args.input]
        )  # before the input is read and converted
        side = load_side(args.input, device=args.device)
        if side.trace is None:
            raise VizInputError(
                f"{args.input}: no memory-block CSV beside it ({Path(args.input).with_suffix('.csv').name}); "
                "a snapshot needs every block"
            )
        write_snapshot(side.trace, side.report, out)
    except (VizInputError, SnapshotError, ConfigError) as err:
        return fail(str(err), err, args.debug)
    except OSError as err:
        return fail(f"--output {out}: cannot write ({err.strerror or err})", err, args.debug)
    print(f"wrote {out}")
    return EXIT_OK
