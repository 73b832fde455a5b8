"""The summary's table of the largest blocks live at the peak and the table of ranks (report/console.py) in a
terminal: whole where it is wide enough; in a narrow one, without the columns it can spare (named in its caption)
rather than with every cell cut to a few letters and an ellipsis, or (the ranks) the last columns, verdict
included, dropped unsaid. A pipe or a log gets the whole table, as before."""

from __future__ import annotations

import io
import re

from rich.console import Console

from hyperdryrun.report.console import (
    BLOCK_COLUMNS,
    BLOCKS_LEFT_OUT,
    RANK_COLUMNS,
    RANKS_LEFT_OUT,
    blocks_table,
    print_ranks,
)

MIB = 2**20
GIB = 2**30


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
    found = re.search(
        r"left out for the terminal's width: (.*?) \((the block CSV|each rank's JSON) has them\)", flat
    )
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


def _rank_report(peak: int, parts: dict[str, int], oom: bool) -> dict:
    return {
        "status": "ok",
        "summary": {"peak_bytes": peak, "peak_phase": "backward", "breakdown_at_peak": parts, "oom": oom},
    }


# two pipeline stages of a 70B rank's figures (GiB, two decimals: what the table prints), the second over its card
RANK_ROWS = [
    (0, _rank_report(int(70.25 * GIB), {"Parameter": int(4.5 * GIB), "Gradient": int(4.5 * GIB),
                                         "Optstate": 9 * GIB, "Activation": int(48.25 * GIB),
                                         "Temp": 4 * GIB}, False), None),
    (8, _rank_report(int(82.5 * GIB), {"Parameter": int(4.25 * GIB), "Gradient": int(4.25 * GIB),
                                        "Optstate": int(8.5 * GIB), "Activation": int(55.5 * GIB),
                                        "Temp": 10 * GIB}, True), None),
    (16, None, "the rank failed: a long reason, which wraps in its column rather than being cut"),
]  # fmt: skip
RANK_CELLS = {
    "rank": ["0", "8", "16"],
    "peak": ["70.25 GiB", "82.50 GiB"],
    "phase": ["backward"],
    "Parameter": ["4.50 GiB", "4.25 GiB"],
    "Gradient": ["4.50 GiB", "4.25 GiB"],
    "Optstate": ["9.00 GiB", "8.50 GiB"],
    "Activation": ["48.25 GiB", "55.50 GiB"],
    "Temp": ["4.00 GiB", "10.00 GiB"],
    "verdict": ["fits", "OOM", "error:"],
}


def _ranks_printed(width: int, terminal: bool) -> str:
    out = io.StringIO()
    console = Console(file=out, width=width, color_system=None, force_terminal=terminal)
    print_ranks(None, RANK_ROWS, title="llama3-70b: 3 of 64 ranks", console=console)
    return out.getvalue()


def _ranks_whole(text: str, columns: list[str]) -> None:
    header = " ".join(text.splitlines()[1].split())
    for col in columns:
        assert re.search(rf"(^|\s){col}(\s|$)", header), (col, text)
        for cell in RANK_CELLS[col]:
            assert re.search(rf"(^|\s){re.escape(cell)}(\s|$)", text, re.M), (col, cell, text)


def test_the_ranks_table_in_a_wide_terminal_is_whole_and_ruled():
    text = _ranks_printed(200, True)
    assert "left out" not in text and "┃" in text
    _ranks_whole(text, list(RANK_COLUMNS))
    assert "max peak: 82.50 GiB on rank 8" in text


def test_the_ranks_table_in_a_narrow_terminal_keeps_peak_phase_and_verdict():
    for width, left_out in ((80, ["Temp", "Gradient"]), (60, list(RANKS_LEFT_OUT[:4]))):
        text = _ranks_printed(width, True)
        assert "┃" not in text, text
        assert _left_out(text) == left_out == list(RANKS_LEFT_OUT[: len(left_out)])
        assert all(len(line) <= width for line in text.splitlines()), text
        # the error's reason wraps in the verdict column, whole
        assert "the rank failed: a long reason, which wraps in its column rather than being cut" in " ".join(
            text.split()
        )
        _ranks_whole(text, [c for c in RANK_COLUMNS if c not in left_out])


def test_the_ranks_table_in_a_pipe_keeps_every_column():
    text = _ranks_printed(110, False)  # print_ranks' own console for a pipe or a log is 110 wide
    assert "left out" not in text and "┃" in text
    _ranks_whole(text, list(RANK_COLUMNS))
