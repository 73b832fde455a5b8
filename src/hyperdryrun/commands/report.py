"""``hyperdryrun report OUT_DIR``: pictures of a run's reports, a self-contained HTML page and PNG plots."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

HTML_NAME = "report.html"
COMPARE_NAME = "compare.html"


def register(subparsers: Any) -> None:
    """Add the ``report`` parser and its handler."""
    p = subparsers.add_parser(
        "report",
        help="draw a run's reports: one self-contained HTML page (--html) and PNG plots (--plot)",
        description="Read rank_<r>/rank_<r>_memory.{json,csv} under OUT_DIR (one rank or several), or one report "
        "JSON / memory-block CSV / profiler trace / CUDA snapshot, and write an HTML page that opens offline "
        f"(default: OUT_DIR/{HTML_NAME}) and, with --plot, PNG plots. --compare draws a second picture beside it.",
    )
    p.add_argument("input", metavar="OUT_DIR", help="a run's output directory, or one report or trace file")
    p.add_argument(
        "--compare",
        metavar="OTHER",
        default=None,
        help="a second output directory or file: draw both (A: OUT_DIR)",
    )
    p.add_argument(
        "--html", metavar="FILE", default=None, help=f"the HTML page to write (default: {HTML_NAME})"
    )
    p.add_argument("--plot", metavar="DIR", default=None, help="write PNG plots into DIR (needs matplotlib)")
    p.add_argument("--device", default=None, help="device of a multi-device trace or snapshot (e.g. cuda:1)")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.set_defaults(func=run)


def _sides(path: str, device: str | None, side: str | None = None) -> list[Any]:
    """The ranks under a directory, or the one picture in a file; ``side`` (A/B) prefixes the labels."""
    from hyperdryrun.viz import load_output_dir, load_side

    sides = load_output_dir(path) if Path(path).is_dir() else [load_side(path, device=device)]
    if side is not None:
        for s in sides:
            mode = (s.report.get("metadata") or {}).get("mode") or "dry-run"
            s.label = f"{side} · {mode}" + (f" · {s.label}" if len(sides) > 1 else "")
    return sides


def default_html(path: str, compare: bool = False) -> Path:
    """``OUT_DIR/report.html`` (``compare.html`` for a comparison), or ``<file stem>_report.html`` beside a file."""
    p = Path(path)
    name = COMPARE_NAME if compare else HTML_NAME
    return p / name if p.is_dir() else p.with_name(f"{p.stem}_{name}")


def run(args: argparse.Namespace) -> int:
    """Check every output, load the pictures, draw the page and the plots, write them together; 2 with a one-line
    error on bad input or output (nothing written then)."""
    from hyperdryrun.commands import EXIT_OK, fail
    from hyperdryrun.commands.preflight import check_output_dir, check_output_file
    from hyperdryrun.config import ConfigError
    from hyperdryrun.viz import VizInputError
    from hyperdryrun.viz.plots import MissingExtra

    compare = args.compare is not None
    html = Path(args.html) if args.html else default_html(args.input, compare)
    try:
        inputs = [args.input, args.compare]
        check_output_file(
            html, "--html" if args.html else f"the page ({html})", make_parent=True, inputs=inputs
        )
        if args.plot is not None:
            check_output_dir(args.plot, "--plot")
            from hyperdryrun.viz.plots import require_matplotlib

            require_matplotlib()  # before anything is written
        if compare:
            a, b = _sides(args.input, args.device, "A"), _sides(args.compare, args.device, "B")
            if len(a) != 1 or len(b) != 1:
                many = args.input if len(a) != 1 else args.compare
                raise VizInputError(f"{many}: --compare draws one rank on each side; name its rank_<r> file")
            sides = a + b
        else:
            sides = _sides(args.input, args.device)
        from hyperdryrun.report.writer import write_together
        from hyperdryrun.viz.html import render_html

        files: list[tuple[Path, str | bytes]] = [(html, render_html(sides, compare).encode("utf-8"))]
        if args.plot is not None:
            from hyperdryrun.viz.plots import render_plots

            plots = render_plots(sides, args.plot, compare=compare)
            for path, _ in plots:
                check_output_file(path, "--plot", make_parent=True, inputs=inputs)
            files += plots
        write_together(files)  # all or none: an earlier page and plots stay if one cannot be written
    except (VizInputError, MissingExtra, ConfigError) as err:
        return fail(str(err), err, args.debug)
    except OSError as err:
        return fail(f"cannot write {err.filename or ''} ({err.strerror or err})", err, args.debug)
    for p, _ in files:
        print(f"wrote {p}")
    return EXIT_OK
