"""``--margin-gib`` / ``--margin-pct`` on the command line: a job "at risk" exits 1 like an OOM, a zero margin
accepts it (exit 0), and bad margins are one-line errors (exit 2) that write nothing."""

from __future__ import annotations

import json

import pytest

from tests.conftest import cli

GIB = 2**30
TINY = ["--model", "llama-tiny", "--seq-len", "32", "--quiet"]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch, tmp_path):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)


def _summary(out_dir) -> dict:
    return json.loads((out_dir / "rank_0" / "rank_0_memory.json").read_text())["summary"]


def test_a_job_within_the_margin_exits_1_and_a_zero_margin_accepts_it(tmp_path, capsys):
    rc, _, err = cli(["run", *TINY, "--device-memory-gib", "80", "--output-dir", str(tmp_path / "a")], capsys)
    assert rc == 0, err
    peak = _summary(tmp_path / "a")["peak_device_bytes"]
    capacity_gib = peak * 1.005 / GIB  # 0.5% over the device figure: inside the default 1% margin
    rc, out, err = cli(
        ["run", *TINY, "--device-memory-gib", repr(capacity_gib), "--output-dir", str(tmp_path / "b")], capsys
    )
    s = _summary(tmp_path / "b")
    assert rc == 1, err
    assert (s["fit"], s["oom"], s["at_risk"]) == ("at risk", False, True)
    assert s["margin_bytes"] == round(0.01 * s["capacity_bytes"])
    assert 0 < s["headroom_bytes"] < s["margin_bytes"]
    rc, _, err = cli(
        [
            "run",
            *TINY,
            "--device-memory-gib",
            repr(capacity_gib),
            "--margin-gib",
            "0",
            "--output-dir",
            str(tmp_path / "c"),
        ],
        capsys,
    )
    assert rc == 0, err
    assert _summary(tmp_path / "c")["fit"] == "fits"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--margin-gib", "-1"],
            "margin_gib (--margin-gib): Input should be greater than or equal to 0 (got -1.0)",
        ),
        (["--margin-pct", "nan"], "margin_pct (--margin-pct): Input should be a finite number (got nan)"),
        (
            ["--margin-pct", "101"],
            "margin_pct (--margin-pct): Input should be less than or equal to 100 (got 101.0)",
        ),
        (
            ["--margin-gib", "1", "--margin-pct", "2"],
            "margin_gib=1 and margin_pct=2: give one margin (--margin-gib or --margin-pct), not both",
        ),
    ],
)
def test_bad_margins_are_one_line_errors_that_write_nothing(tmp_path, capsys, flags, message):
    out_dir = tmp_path / "out"
    rc, _, err = cli(["run", *TINY, "--gpu", "h100-80gb", *flags, "--output-dir", str(out_dir)], capsys)
    assert rc == 2
    assert err == f"hyperdryrun: error: {message}\n"
    assert not out_dir.exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--margin-gib", "-0.5"], "--margin-gib: must be a number from 0 to 1,048,576 (got -0.5)"),
        (["--margin-pct", "inf"], "--margin-pct: must be a number from 0 to 100 (got inf)"),
        (
            ["--margin-gib", "1", "--margin-pct", "2"],
            "margin: give --margin-gib (1) or --margin-pct (2), not both",
        ),
    ],
)
def test_fit_validates_its_margin_flags_in_one_line(tmp_path, capsys, flags, message):
    rc, _, err = cli(
        ["fit", "--model", "llama-tiny", "--world-size", "2", "--gpu", "h100-80gb", "--global-batch-seqs", "2",
         "--no-cache", *flags],
        capsys,
    )  # fmt: skip
    assert rc == 2
    assert err == f"hyperdryrun: error: {message}\n"
