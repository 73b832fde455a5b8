"""The fit table (report/layouts.py) in a terminal: whole where it is wide enough; in a narrow one, without the
columns it can spare (named in its caption) rather than with every cell cut to a letter and an ellipsis."""

from __future__ import annotations

import io
import re
from dataclasses import replace

from rich.console import Console

from hyperdryrun.report.layouts import COLUMNS, NARROW_LEFT_OUT, LayoutRow, layout_table

GIB = 2**30


def _rows(**change) -> list[LayoutRow]:
    # figures of the 70B search's winner and a runner-up, as fit prints them
    rows = [
        LayoutRow(1, "dp4 tp2 pp8 1F1B", "fits", batch="2 x 64", ac="full", step_s=11.08,
                  tokens_per_s_per_gpu=1478.6, allocated=int(48.69 * GIB), reserved=int(57.53 * GIB),
                  device=int(59.21 * GIB), headroom=int(19.90 * GIB), worst_rank=0, classes=8,
                  method="extrapolated+full"),
        LayoutRow(2, "dp8 tp8 pp1", "at_risk", batch="1 x 16", ac="selective", step_s=12.5,
                  tokens_per_s_per_gpu=1310.0, allocated=int(70.1 * GIB), reserved=int(77.0 * GIB),
                  device=int(78.5 * GIB), headroom=int(0.61 * GIB), worst_rank=0, classes=1, method="full"),
    ]  # fmt: skip
    return [replace(r, **change) for r in rows]


def _printed(width: int, terminal_width: int | None, rows: list[LayoutRow] | None = None) -> str:
    out = io.StringIO()
    console = Console(file=out, width=width, color_system=None)
    console.print(layout_table(rows or _rows(), width=terminal_width))
    return out.getvalue()


def _left_out(text: str) -> list[str]:
    flat = " ".join(text.split())  # the caption wraps at the terminal's width
    found = re.search(r"left out for the terminal's width: (.*?) \(a wider terminal shows them\)", flat)
    return found.group(1).split(", ") if found else []


def _cells_shown(text: str, columns: list[str], rows: list[LayoutRow] | None = None) -> None:
    """Every cell of the shown columns is printed whole (the headers may wrap; the cells do not)."""
    rows = rows or _rows()
    whole = {
        "layout": [r.layout for r in rows],
        "mbs x n": [r.batch for r in rows],
        "device": ["59.21", "78.50"],
        "headroom": ["19.90", "0.61"],
        "allocated": ["48.69", "70.10"],
        "reserved": ["57.53", "77.00"],
        "tok/s/GPU": ["1,479", "1,310"],
        "method": ["extrapolated+full"],
    }
    for col in columns:
        for cell in whole.get(col, []):
            assert cell in text, (col, cell, text)


def test_a_wide_terminal_shows_every_column_whole():
    text = _printed(200, 200)
    assert "…" not in text and "left out" not in text
    _cells_shown(text, list(COLUMNS))


def test_a_narrow_terminal_leaves_out_the_columns_it_can_spare_and_says_which():
    text = _printed(80, 80)
    assert "…" not in text, text
    left_out = _left_out(text)
    # in their order; the device figure (what these rows are judged on), the headroom and the verdict stay
    assert left_out == ["method", "classes", "worst rank", "tok/s/GPU", "allocated", "reserved"]
    assert all(len(line) <= 80 for line in text.splitlines())
    _cells_shown(text, [c for c in COLUMNS if c not in left_out])
    # a terminal that fits the table without its column rules keeps every column
    assert "left out" not in _printed(150, 150) and "┃" not in _printed(150, 150)
    # and the same table, not fitted to a terminal (a pipe or a log), keeps them all, cut or not
    assert "left out" not in _printed(80, None)


def test_without_a_device_figure_the_empty_column_goes_first_and_the_judged_figure_stays():
    # a target without the allocator model's device figure: fit judges on the reserved bytes
    rows = _rows(device=None)
    text = _printed(80, 80, rows)
    assert "…" not in text, text
    left_out = _left_out(text)
    assert left_out[0] == "device" and "reserved" not in left_out, left_out
    assert (
        left_out[1:] == [c for c in NARROW_LEFT_OUT if c not in ("device", "reserved")][: len(left_out) - 1]
    )
    _cells_shown(text, ["layout", "reserved", "headroom"], rows)


def test_a_long_reason_wraps_in_the_verdict_and_leaves_the_figures_whole():
    rows = [
        *_rows(),
        LayoutRow(3, "dp16 tp4", "invalid", reason="world.world_size=64 is not divisible by " * 2),
    ]
    text = _printed(80, 80, rows)
    _cells_shown(text, ["layout", "device", "headroom"])
    assert "invalid" in text
