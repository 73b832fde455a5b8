"""``hyperdryrun fit`` end to end on llama-tiny: the layouts that fit, their worst-rank peaks against every rank
simulated directly, the cache, ``--top``, pruning and bad input."""

from __future__ import annotations

import csv
import json

import pytest

from hyperdryrun.cli import main
from hyperdryrun.config import build_config
from hyperdryrun.recipe import run_job
from hyperdryrun.report.build import build_report

# 4 ranks, 8 sequences of 64 per step: dp4 (tp 1) or dp2 x tp2, micro batches of 1 or 2 -> 4 candidates.
COMMON = [
    "fit", "--model", "llama-tiny", "--world-size", "4", "--seq-len", "64", "--global-batch-seqs", "8",
    "--tp", "1,2", "--pp", "1", "--micro-batch-size", "1,2", "--ac", "none", "--jobs", "1",
]  # fmt: skip


def _direct_worst_peaks(layout: dict) -> tuple[int, int]:
    """The largest allocated and device peaks over every rank of the layout, each rank simulated on its own."""
    parallel = {k: layout[k] for k in ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep", "etp")}
    training = {k: layout[k] for k in ("micro_batch_size", "num_micro_batches", "ac")}
    peaks, devices = [], []
    for rank in range(4):
        cfg = build_config(
            {
                "model": {"name": "llama-tiny"},
                "world": {"world_size": 4, "rank": rank},
                "parallel": parallel,
                "training": {"seq_len": 64, **training},
            }
        )
        summary = build_report(run_job(cfg, capture_stacks=False))["summary"]
        peaks.append(summary["peak_bytes"])
        devices.append(summary["peak_device_bytes"])
    return max(peaks), max(devices)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fit")
    out = tmp / "fit.json"
    code = main([*COMMON, "--device-memory-gib", "4", "--top", "0", "--cache-dir", str(tmp / "cache"),
                 "--json", str(out), "--csv", str(tmp / "fit.csv")])  # fmt: skip
    return tmp, code, json.loads(out.read_text())


def test_every_layout_is_dry_run_and_its_worst_rank_peak_is_that_of_a_direct_run(first_run):
    tmp, code, data = first_run
    assert code == 0
    c = data["counts"]
    assert (c["enumerated"], c["invalid"], c["pruned"], c["simulated"], c["cached"]) == (4, 0, 0, 4, 0)
    assert c["fits"] == 4
    times = [row["est_step_s"] for row in data["candidates"]]
    assert times == sorted(times)
    for row in data["candidates"]:
        assert row["status"] == "fits"
        # Every class ran in full (llama-tiny is too small to save by sampling), so the verdict reads the
        # allocator model's device figure: 4 GiB less the worst rank's.
        assert (row["peak_allocated_bytes"], row["peak_device_bytes"]) == _direct_worst_peaks(row)
        assert row["headroom_bytes"] == 4 * 2**30 - row["peak_device_bytes"]
        # Every rank is in exactly one class.
        assert sorted(r for cl in row["classes"] for r in cl["ranks"]) == [0, 1, 2, 3]
    with open(tmp / "fit.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["peak_allocated_bytes"]) for r in rows] == [
        r["peak_allocated_bytes"] for r in data["candidates"]
    ]


def test_a_second_run_answers_from_the_cache_and_the_capacity_splits_fit_from_oom(first_run, capsys):
    tmp, _, data = first_run
    peaks = sorted(row["peak_device_bytes"] for row in data["candidates"])
    capacity = (peaks[1] + peaks[2]) / 2 / 2**30  # two layouts under it, two over
    out = tmp / "again.json"
    code = main([*COMMON, "--device-memory-gib", str(capacity), "--top", "0", "--cache-dir", str(tmp / "cache"),
                 "--json", str(out)])  # fmt: skip
    assert code == 0
    again = json.loads(out.read_text())
    assert again["counts"]["simulated"] == 0 and again["counts"]["cached"] == 4
    assert data["counts"]["cached_classes"] == 0  # the first run simulated every class
    assert (
        again["counts"]["cached_classes"] == again["counts"]["rank_classes"] == data["counts"]["rank_classes"]
    )
    status = {row["layout"] + f" {row['micro_batch_size']}": row["status"] for row in again["candidates"]}
    expected = {
        row["layout"] + f" {row['micro_batch_size']}": "fits" if row["peak_device_bytes"] <= capacity * 2**30
        else "oom"
        for row in data["candidates"]
    }  # fmt: skip
    assert status == expected and sorted(status.values()) == ["fits", "fits", "oom", "oom"]
    text = capsys.readouterr().out
    assert "4 enumerated · 0 invalid · 0 pruned · 0 simulated · 4 cached" in text
    n = data["counts"]["rank_classes"]
    assert f"rank classes: {n} for the 4 layouts dry-run, all answered from the cache" in text
    assert "simulations for" not in text


def test_top_stops_once_the_fastest_fitting_layout_is_known(first_run):
    tmp, _, data = first_run
    out = tmp / "top.json"
    assert main([*COMMON, "--device-memory-gib", "4", "--top", "1", "--no-cache", "--json", str(out)]) == 0
    top = json.loads(out.read_text())
    # All fit at 4 GiB: the fastest estimate is dry-run, the 3 slower ones are not needed.
    assert top["counts"]["fits"] == 1 and top["counts"]["skipped"] == 3 and top["counts"]["simulated"] == 1
    fastest = data["candidates"][0]
    assert top["candidates"][0]["peak_allocated_bytes"] == fastest["peak_allocated_bytes"]


def test_states_over_the_capacity_are_pruned_without_a_simulation(capsys):
    # 106,816 parameters x 16 bytes (fp32 parameter, gradient, two AdamW states) over at most 4 FSDP ranks is
    # 427,264 bytes a rank, more than 0.0003 GiB (322,123 bytes).
    assert main([*COMMON, "--device-memory-gib", "0.0003", "--no-cache"]) == 1
    text = capsys.readouterr().out
    assert "4 enumerated · 0 invalid · 4 pruned · 0 simulated" in text and "no layout fits" in text


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ([], "--gpu or --device-memory-gib"),
        (["--gpu", "h900"], "cuda.gpu (--gpu): gpu='h900'"),
        (["--device-memory-gib", "1", "--global-batch-tokens", "128"], "give exactly one"),
        (["--device-memory-gib", "1", "--ep", "2"], "--ep 2: expert parallel needs an MoE model"),
        (["--device-memory-gib", "1", "--tp", "0"], "--tp [0]: must be integers from 1 to 16,777,216"),
        (["--device-memory-gib", "1", "--top", "-1"], "--top: must be >= 0 (got -1)"),
        (["--device-memory-gib", "1", "--n-layers", "0"], "model.n_layers (--n-layers)"),
    ],
)
def test_bad_input_is_one_line_naming_the_flag(extra, needle, capsys):
    assert main([*COMMON, *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_global_batch_tokens_must_be_whole_sequences(capsys):
    argv = [a for a in COMMON if a not in ("--global-batch-seqs", "8")]
    assert main([*argv, "--global-batch-tokens", "100", "--device-memory-gib", "1"]) == 2
    assert "--global-batch-tokens: 100 is not a positive multiple of --seq-len 64" in capsys.readouterr().err
