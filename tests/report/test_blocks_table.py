"""The summary's table of the largest blocks live at the peak (report/console.py) in a terminal: whole where it is
wide enough; in a narrow one, without the columns it can spare (named in its caption) rather than with every cell
cut to a few letters and an ellipsis. A pipe or a log gets the whole table, as before."""

from __future__ import annotations

import io
import re

from rich.console import Console

from hyperdryrun.report.console import BLOCK_COLUMNS, BLOCKS_LEFT_OUT, blocks_table

MIB = 2**20


def _live() -> dict:
    # the README job's largest blocks at its peak, as its report gives them
    blocks = [
        (4008 * MIB, "Activation", "_log_softmax", "", "forward", "llama.py", 230),
        (4008 * MIB, "Temp", "_log_softmax_backward_data", "", "backward", "llama.py", 230),
        (1002 * MIB, "Parameter", "empty", "norm", "forward", "llama.py", 164),
        (int(250.5 * MIB), "Optstate", "initialization", "tok_embeddings", "initialization", "llama.py", 182),
    ]
    return {
        "num_blocks": 1301,
        "blocks": [
            {"size": size, "category": cat, "op": op, "module": mod, "phase": phase,
             "stack": [{"file": f"/src/hyperdryrun/models/{file}", "line": line}]}
            for size, cat, op, mod, phase, file, line in blocks
        ],
    }  # fmt: skip


# every cell as it must appear whole, by column (sizes in MiB with one decimal; "initialization" reads "init")
WHOLE = {
    "MiB": ["4,008.0", "1,002.0", "250.5"],
    "category": ["Activation", "Temp", "Parameter", "Optstate"],
    "op": ["_log_softmax", "_log_softmax_backward_data", "empty", "initialization"],
    "module": ["norm", "tok_embeddings"],
    "phase": ["forward", "backward", "init"],
    "allocated at": ["llama.py:230", "llama.py:164", "llama.py:182"],
}


def _printed(console_width: int, terminal_width: int | None) -> str:
    out = io.StringIO()
    Console(file=out, width=console_width, color_system=None).print(blocks_table(_live(), 8, terminal_width))
    return out.getvalue()


def _left_out(text: str) -> list[str]:
    flat = " ".join(text.split())
    found = re.search(r"left out for the terminal's width: (.*?) \(the block CSV has them\)", flat)
    return found.group(1).split(", ") if found else []


def _whole(text: str, columns: list[str]) -> None:
    header = " ".join(text.splitlines()[1].split())
    for col in columns:
        assert col in header, (col, text)
        for cell in WHOLE[col]:
            assert re.search(rf"(^|\s){re.escape(cell)}(\s|$)", text, re.M), (col, cell, text)


def test_a_wide_terminal_shows_every_column_whole_with_its_rules():
    text = _printed(200, 200)
    assert "…" not in text and "left out" not in text and "┃" in text
    _whole(text, list(BLOCK_COLUMNS))
    assert text == _printed(200, None)  # what a pipe or a log gets


def test_a_narrow_terminal_leaves_out_the_columns_it_can_spare_and_says_which():
    for width, left_out in ((80, ["allocated at"]), (60, ["allocated at", "phase", "module"])):
        text = _printed(width, width)
        assert "…" not in text and "┃" not in text, text
        assert _left_out(text) == left_out == list(BLOCKS_LEFT_OUT[: len(left_out)])
        assert all(len(line) <= width for line in text.splitlines())
        _whole(text, [c for c in BLOCK_COLUMNS if c not in left_out])
    # wide enough without the column rules: every column stays
    unruled = _printed(92, 92)
    assert "┃" not in unruled and "left out" not in unruled and "…" not in unruled
    _whole(unruled, list(BLOCK_COLUMNS))


def test_a_pipe_keeps_every_column_cut_or_not():
    text = _printed(80, None)
    assert "left out" not in text and "┃" in text
