"""``hyperdryrun compare A B``: how far B's memory picture is from A's; exit 0 within ``--tolerance``, else 1."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from hyperdryrun.allocator.snapshot_replay import DEFAULT_REPLAY_TOLERANCE
from hyperdryrun.commands import EXIT_OK, EXIT_VERDICT, fail
from hyperdryrun.compare import DEFAULT_TOLERANCE, TOP_BLOCKS, Side, as_report, compare, print_comparison


def register(subparsers: Any) -> None:
    """Add the ``compare`` parser (with the subparsers' own parser class) and its handler."""
    p = subparsers.add_parser(
        "compare",
        help="compare two reports, memory-block CSVs, profiler Chrome traces or CUDA snapshots (A: reference)",
        description="Peak error of B relative to A, per-category bytes at each side's peak, phase peaks, module "
        "local peaks and the largest blocks alive at one side's peak that the other lacks. Exit 0 when "
        "|relative peak error| <= --tolerance, 1 otherwise, 2 on bad input, 3 on an internal error.",
    )
    p.add_argument(
        "a",
        metavar="A",
        nargs="?",
        help="reference: report .json, block .csv, trace .json[.gz] or snapshot .pickle",
    )
    p.add_argument("b", metavar="B", nargs="?", help="the other side, any of the same kinds")
    p.add_argument(
        "--replay",
        metavar="SNAPSHOT",
        default=None,
        help="instead of A and B: replay a CUDA snapshot's own events (.pickle[.gz]) through the allocator model "
        "and compare its segments and max reserved with the recorded ones, event by event (exit 1 when the "
        f"reserved peak is off by more than --tolerance, default {DEFAULT_REPLAY_TOLERANCE} here)",
    )
    p.add_argument(
        "--cold",
        action="store_true",
        help="with --replay: start from an empty cache (the blocks alive at the start allocated first), as a "
        "dry run does, instead of the cache as recording began",
    )
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")
    p.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help=f"largest |relative peak error| that passes (default {DEFAULT_TOLERANCE}; "
        f"{DEFAULT_REPLAY_TOLERANCE} with --replay)",
    )
    p.add_argument(
        "--with-kernel-scratch",
        action="store_true",
        help="judge a measured side on its full peak, kernel workspaces included (default: without them)",
    )
    p.add_argument("--device", default=None, help="device of a multi-device trace or snapshot (e.g. cuda:1)")
    p.add_argument(
        "--top", type=int, default=TOP_BLOCKS, help=f"unmatched blocks listed per side ({TOP_BLOCKS})"
    )
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.set_defaults(func=run)


def _side(path: str, device: str | None) -> Side:
    """One side as read from ``path``, with its blocks over the step where it has them (a report's own CSV)."""
    from pathlib import Path

    from hyperdryrun.report.reader import load_any

    loaded = load_any(path, device)
    if isinstance(loaded, dict):
        kind = f"report ({(loaded.get('metadata') or {}).get('mode', 'dry-run')})"
        csv_path = Path(path).with_suffix(".csv")
        trace = load_any(csv_path) if csv_path.exists() else None  # load_any checked it is the report's own
    else:
        kind = str(loaded.metadata.get("source_kind", "trace"))
        trace = loaded
    return Side(path, kind, as_report(loaded), trace)


def run(args: argparse.Namespace) -> int:
    """Load both sides, compare, print; 0/1 by tolerance, 2 (one-line error) on bad input."""
    from hyperdryrun.ingest.files import IngestError

    debug = getattr(args, "debug", False)
    replaying = getattr(args, "replay", None) is not None
    if args.tolerance is None:
        args.tolerance = DEFAULT_REPLAY_TOLERANCE if replaying else DEFAULT_TOLERANCE
    if not math.isfinite(args.tolerance) or args.tolerance < 0:
        return fail(f"--tolerance {args.tolerance} must be a finite number >= 0", ValueError(), debug)
    if replaying:
        if args.a is not None or args.b is not None:
            return fail("--replay SNAPSHOT takes no A or B", ValueError(), debug)
        return run_replay(args)
    if args.a is None or args.b is None:
        return fail("compare needs A and B (or --replay SNAPSHOT)", ValueError(), debug)
    if getattr(args, "cold", False):
        return fail("--cold needs --replay SNAPSHOT", ValueError(), debug)
    if args.top < 0:
        return fail(f"--top {args.top} must be >= 0", ValueError(), debug)
    try:
        a, b = _side(args.a, args.device), _side(args.b, args.device)
    except IngestError as err:
        return fail(str(err), err, debug)
    result = compare(a, b, args.tolerance, args.top, with_kernel_scratch=args.with_kernel_scratch)
    if args.json:
        print(json.dumps(result, indent=2, allow_nan=False))
    else:
        print_comparison(result, top=args.top)
    return EXIT_OK if result["within_tolerance"] else EXIT_VERDICT


def run_replay(args: argparse.Namespace) -> int:
    """``--replay SNAPSHOT``: the snapshot's own events through the allocator model; 0/1 by tolerance, 2 bad file."""
    from hyperdryrun.allocator.snapshot_replay import format_replay, load_snapshot, replay_snapshot
    from hyperdryrun.ingest.files import IngestError

    debug = getattr(args, "debug", False)
    try:
        data = load_snapshot(args.replay)
        if isinstance(data, dict) and data.get("hyperdryrun_tensors_only"):
            raise IngestError(
                args.replay,
                "a snapshot HyperDryRun wrote from a report: it holds the report's tensors only, its segments made "
                "to hold them, not a caching allocator's events to replay (replay one torch recorded: "
                "torch.cuda.memory._dump_snapshot)",
            )
        result = replay_snapshot(data, str(args.replay), args.device, cold=args.cold)
    except IngestError as err:
        return fail(str(err), err, debug)
    except (ValueError, KeyError, TypeError) as err:  # an inconsistent trace (e.g. a block freed twice)
        return fail(f"{args.replay}: inconsistent allocator trace ({err})", err, debug)
    if args.json:
        out = result.as_dict()
        out["tolerance"] = args.tolerance
        out["within_tolerance"] = result.within(args.tolerance)
        print(json.dumps(out, indent=2, allow_nan=False))
    else:
        print(format_replay(result, args.tolerance))
    return EXIT_OK if result.within(args.tolerance) else EXIT_VERDICT
