"""``fit`` for every front door: the built-in recipe (``hyperdryrun fit``), a Hugging Face config (``fit --model
hf:...``), a script (``script --fit``) and a torchtitan job (``torchtitan --fit``) print the same table with the
same columns, the step-time estimate where the job gives its FLOPs (the built-in recipe's and HF configs' shapes,
torchtitan's ``get_nparams_and_flops``) and ``—`` where it does not (a script)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hyperdryrun.cli import main
from hyperdryrun.report.layouts import COLUMNS
from hyperdryrun.search.roofline import flops_step_time
from hyperdryrun.world.gpus import Rates

HERE = Path(__file__).resolve().parent
FIT = ["--world-size", "1", "--seq-len", "64", "--global-batch-seqs", "1", "--tp", "1", "--pp", "1"]
FIT += ["--micro-batch-size", "1", "--ac", "none", "--jobs", "1", "--no-cache", "--gpu", "h100-80gb"]
TITAN = ["--module", "llama3", "--config", "llama3_debugmodel", "--training.seq_len", "256"]
TITAN += ["--training.disable_cuda_graphs", "--n-layers", "1", "--no-stacks", "--jobs", "1"]


@pytest.fixture(autouse=True)
def _no_torchrun_env(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(var, raising=False)


def table(out: str) -> tuple[list[str], list[list[str]]]:
    """The fit table's column names and its rows' cells."""
    lines = out.splitlines()
    (head,) = [i for i, line in enumerate(lines) if line.startswith("#") and "┃" in line]
    rows = [
        [c.strip() for c in line.split("│")]
        for line in lines[head + 2 :]
        if line[:1].isdigit() and "│" in line
    ]
    return [c.strip() for c in lines[head].split("┃")], rows


def fit_of(argv: list[str], capsys) -> tuple[int, list[str], list[list[str]]]:
    code = main(argv)
    return code, *table(capsys.readouterr().out)


def test_every_front_door_prints_the_same_fit_table(tmp_path, capsys):
    step, tok = COLUMNS.index("est. step"), COLUMNS.index("tok/s/GPU")
    code, cols, rows = fit_of(["fit", "--model", "llama-tiny", *FIT], capsys)
    assert (code, cols) == (0, list(COLUMNS))
    assert rows[0][step] != "—" and rows[0][tok] != "—" and rows[0][COLUMNS.index("verdict")] == "fits"

    code, cols, rows = fit_of(["fit", "--model", "hf:llama-3.1-8b", "--n-layers", "1", *FIT], capsys)
    assert (code, cols) == (0, list(COLUMNS))  # an HF config's shapes give its FLOPs
    assert rows[0][step].endswith("ms") and rows[0][COLUMNS.index("layout")] == "dp1"

    script = [
        "script",
        str(HERE / "_script_job.py"),
        "--fit",
        "--world-size",
        "2",
        "--device-memory-gib",
        "2",
    ]
    code, cols, rows = fit_of([*script, "--no-stacks", "--output-dir", str(tmp_path / "s")], capsys)
    assert (code, cols) == (0, list(COLUMNS))
    assert [r[COLUMNS.index("verdict")] for r in rows] == ["OOM", "fits (chosen)"]
    assert {r[step] for r in rows} == {"—"}  # a script gives no FLOPs

    pytest.importorskip("torchtitan", reason="torchtitan is not installed")
    argv = ["torchtitan", *TITAN, "--world-size", "2", "--fit", "--fit-tp", "1,2", "--fit-pp", "1"]
    code, cols, rows = fit_of([*argv, "--gpu", "h100-80gb", "--output-dir", str(tmp_path / "t")], capsys)
    assert (code, cols) == (0, list(COLUMNS))
    assert [r[COLUMNS.index("layout")] for r in rows] == ["dp_shard=2 tp=1 pp=1 cp=1 ep=1",
                                                          "dp_shard=1 tp=2 pp=1 cp=1 ep=1"]  # fmt: skip
    # compute only: tok/s/GPU is the peak rate over torchtitan's FLOPs per token, the same for both layouts; the
    # tp layout's step has half the tokens (torchtitan's global batch is its local batch x the dp degree)
    assert rows[0][tok] == rows[1][tok] != "—" and rows[0][step] != "—" != rows[1][step]
    assert rows[0][COLUMNS.index("verdict")] == "fits (chosen)"
    assert rows[0][COLUMNS.index("mbs x n")] == "8 x 1"  # torchtitan's local batch 8, no accumulation


def test_the_flops_estimate_is_the_compute_at_the_peak_rate_plus_the_bubble():
    rates = Rates(1e12, 1e12, 1e11, 1e10)
    # 1e9 FLOPs per token x 1e6 tokens = 1e15 FLOPs over 4 GPUs at 1e12 FLOP/s: 250 s; pp 2 over 4 micro
    # batches: (2 - 1) / 4 of it more
    t = flops_step_time(1e9, 10**6, 4, rates, pp=2, micro_batches=4)
    assert (t.compute, t.bubble, t.total) == (250.0, 62.5, 312.5)
    assert t.tokens_per_s_per_gpu == 10**6 / 312.5 / 4
