"""``run --ranks/--all-ranks``: several ranks in worker processes, one table and the maximum."""

from __future__ import annotations

import argparse
import json

import pytest

from hyperdryrun.cli import main
from hyperdryrun.commands.run import parse_ranks
from hyperdryrun.search.classes import rank_ranges


@pytest.fixture(autouse=True)
def _no_torchrun_env(monkeypatch, tmp_path):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)


def test_all_ranks_simulates_one_rank_per_class_with_the_peaks_of_single_runs(tmp_path, capsys):
    common = ["run", "--model", "llama-tiny", "--seq-len", "32", "--world-size", "3"]
    assert main([*common, "--all-ranks", "--jobs", "2", "--output-dir", str(tmp_path / "many")]) == 0
    table = capsys.readouterr().out
    # Uneven FSDP shards (64 rows over 3 ranks: 22, 22, 20): ranks 0 and 1 hold the same shapes, rank 2 fewer rows,
    # so two rank classes, {0, 1} and {2}, each simulated once by its lowest rank.
    assert "2 of 3 ranks" in table and "max peak" in table and "2 rank classes cover all 3 ranks" in table
    wrote = [line.removeprefix("wrote ") for line in table.splitlines() if line.startswith("wrote ")]
    assert wrote == [
        str(tmp_path / "many" / f"rank_{r}" / f"rank_{r}_{name}")
        for r in (0, 2)
        for name in ("memory.json", "memory.csv", "segments.csv")
    ] + [str(tmp_path / "many" / "rank_classes.json")]
    classes = json.loads((tmp_path / "many" / "rank_classes.json").read_text())
    assert classes["rank_class"] == [0, 0, 1]
    # the class table gives each class's peak as the ranks table does: a small model's in MiB (bytes / 2**20, two
    # decimals), not "0.00" GiB
    class_rows = table.split("rank classes cover all 3 ranks")[1].splitlines()[3:5]
    for line, row in zip(class_rows, classes["classes"], strict=True):
        assert row["peak_bytes"] < 2**30 // 10
        assert f" {row['peak_bytes'] / 2**20:,.2f} MiB " in line, line
    # Each subprocess's report equals the same rank simulated alone in this process, and rank 1, not simulated,
    # has the peak of its class's representative.
    for rank, simulated in ((0, 0), (1, 0), (2, 2)):
        assert main([*common, "--rank", str(rank), "--quiet", "--output-dir", str(tmp_path / "one")]) == 0
        capsys.readouterr()
        many = json.loads(
            (tmp_path / "many" / f"rank_{simulated}" / f"rank_{simulated}_memory.json").read_text()
        )
        one = json.loads((tmp_path / "one" / f"rank_{rank}" / f"rank_{rank}_memory.json").read_text())
        assert many["metadata"]["rank"] == simulated
        assert many["summary"] == one["summary"]
        assert classes["classes"][classes["rank_class"][rank]]["peak_bytes"] == one["summary"]["peak_bytes"]


@pytest.mark.parametrize(
    ("given", "ranks"),
    [("3", [3]), ("0,7,63", [0, 7, 63]), ("0-3", [0, 1, 2, 3]), ("5-5", [5]), ("60-63,0-1", [60, 61, 62, 63, 0, 1]),
     (" 2 , 0-1 ,2", [2, 0, 1]), ("7,0-7", [7, 0, 1, 2, 3, 4, 5, 6])],
)  # fmt: skip
def test_rank_lists_take_ranges_as_rank_classes_write_them(given, ranks):
    """``rank_classes.json`` writes a class's ranks as ``0-7``; ``--ranks`` takes that back: inclusive ranges, in
    the order given, each rank once."""
    assert parse_ranks(argparse.Namespace(ranks=given, all_ranks=False), 64) == ranks


@pytest.mark.parametrize(
    "ranks", [[0], [0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 16, 17, 18, 19, 40], [5, 63], list(range(64))]
)
def test_rank_lists_read_back_what_rank_classes_json_writes(ranks):
    """A class's ``ranks`` string in ``rank_classes.json`` (:func:`~hyperdryrun.search.classes.rank_ranges`),
    given to ``--ranks``, asks for exactly that class's ranks."""
    written = rank_ranges(ranks)
    assert parse_ranks(argparse.Namespace(ranks=written, all_ranks=False), 64) == ranks


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--ranks", "0,x"], "--ranks: 'x' is not an integer"),
        (["--ranks", "1-0"], "--ranks: range '1-0' runs backwards"),
        (["--ranks", "0-2"], "--ranks: rank 2 must satisfy 0 <= rank < world_size=2"),
        (["--ranks", "0-"], "--ranks: '' is not an integer"),
        (["--ranks", "1_0"], "--ranks: '1_0' is not an integer"),
        (["--ranks", "\u0661"], "--ranks: '\u0661' is not an integer"),
        (["--ranks", "0,5"], "--ranks: rank 5 must satisfy 0 <= rank < world_size=2"),
        (["--ranks", "0", "--all-ranks"], "--ranks and --all-ranks"),
        (["--ranks", "1", "--rank", "0"], "--rank and --ranks/--all-ranks"),
        (["--all-ranks", "--jobs", "0"], "--jobs: must be >= 1 (got 0)"),
    ],
)
def test_bad_rank_lists_are_one_line_errors(argv, needle, tmp_path, capsys):
    rc = main(
        ["run", "--model", "llama-tiny", "--world-size", "2", *argv, "--output-dir", str(tmp_path / "o")]
    )
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and needle in err, err
    assert not (tmp_path / "o").exists()
