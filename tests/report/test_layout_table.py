"""The fit table (report/layouts.py) in a terminal: whole where it is wide enough; in a narrow one, without the
columns it can spare (named in its caption) rather than with every cell cut to a letter and an ellipsis."""

from __future__ import annotations

import io
import re

from rich.console import Console

from hyperdryrun.report.layouts import COLUMNS, NARROW_LEFT_OUT, LayoutRow, layout_table

GIB = 2**30


def _rows() -> list[LayoutRow]:
    # figures of the 70B search's winner and a runner-up, as fit prints them
    return [
        LayoutRow(1, "dp4 tp2 pp8 1F1B", "fits", batch="2 x 64", ac="full", step_s=11.08,
                  tokens_per_s_per_gpu=1478.6, allocated=int(48.69 * GIB), reserved=int(57.53 * GIB),
                  device=int(59.21 * GIB), headroom=int(19.90 * GIB), worst_rank=0, classes=8,
                  method="full+extrapolated"),
        LayoutRow(2, "dp8 tp8 pp1", "at_risk", batch="1 x 16", ac="selective", step_s=12.5,
                  tokens_per_s_per_gpu=1310.0, allocated=int(70.1 * GIB), reserved=int(77.0 * GIB),
                  device=int(78.5 * GIB), headroom=int(0.61 * GIB), worst_rank=0, classes=1, method="full"),
    ]  # fmt: skip


def _printed(width: int, terminal_width: int | None) -> str:
    out = io.StringIO()
    console = Console(file=out, width=width, color_system=None)
    console.print(layout_table(_rows(), width=terminal_width))
    return out.getvalue()


def _cells_shown(text: str, columns: list[str]) -> None:
    """Every cell of the shown columns is printed whole (the headers may wrap; the cells do not)."""
    rows = _rows()
    whole = {
        "layout": [r.layout for r in rows],
        "mbs x n": [r.batch for r in rows],
        "device": ["59.21", "78.50"],
        "headroom": ["19.90", "0.61"],
        "allocated": ["48.69", "70.10"],
        "reserved": ["57.53", "77.00"],
        "tok/s/GPU": ["1,479", "1,310"],
        "method": ["full+extrapolated"],
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
    flat = " ".join(text.split())  # the caption wraps at the terminal's width
    left_out = re.search(r"left out for the terminal's width: (.*?) \(a wider terminal shows them\)", flat)
    left_out = left_out.group(1).split(", ")
    assert left_out == list(NARROW_LEFT_OUT[: len(left_out)])  # in their order, from the first
    assert all(len(line) <= 80 for line in text.splitlines())
    # what the fit is judged on stays: the layout, the device figure and the headroom, whole
    assert {"layout", "device", "headroom", "verdict"}.isdisjoint(left_out)
    _cells_shown(text, [c for c in COLUMNS if c not in left_out])
    # and the same table, not fitted to a terminal (a pipe or a log), keeps them all, cut or not
    assert "left out" not in _printed(80, None)
