"""Rank classes (``--all-ranks``) and the layout search (``--fit``) of ``hyperdryrun torchtitan``, on torchtitan's
llama3 debug model (dim 256, 16 heads of 16, SwiGLU hidden 768, vocab 2048) at world sizes 2 to 8.

torchtitan's mesh is ``pp, dp_replicate, dp_shard, cp, tp`` row-major (``ParallelDims.build_mesh``): under pp 2 x
dp_shard 2 ranks 0-1 hold stage 0 and ranks 2-3 stage 1; under dp_shard 2 x cp 2 the cp position is the inner
index, so ranks 0 and 2 are cp 0, ranks 1 and 3 cp 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "torchtitan", reason="torchtitan is not installed (pip install 'hyperdryrun[torchtitan]')"
)

from hyperdryrun.integrations.torchtitan import simulate_torchtitan  # noqa: E402
from hyperdryrun.integrations.torchtitan_ranks import rank_classes  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
DEBUG = ["--module", "llama3", "--config", "llama3_debugmodel", "--training.seq_len", "256"]
DEBUG += ["--training.disable_cuda_graphs"]


def degrees(**d: int) -> list[str]:
    names = {"dp_shard": "data_parallel_shard", "tp": "tensor_parallel", "pp": "pipeline_parallel"}
    names |= {"cp": "context_parallel"}
    return [x for k, v in d.items() for x in (f"--parallelism.{names[k]}_degree", str(v))]


def ranks_of(argv: list[str], world_size: int) -> list[list[int]]:
    return [c["ranks"] for c in rank_classes([*DEBUG, *argv], world_size)]


@pytest.mark.parametrize(
    "layout, world_size, expected",
    [
        ({"pp": 2, "dp_shard": 2}, 4, [[0, 1], [2, 3]]),  # one class per stage
        ({"dp_shard": 2, "cp": 2}, 4, [[0, 2], [1, 3]]),  # one per ring-attention position
        ({"tp": 2, "dp_shard": 4}, 8, [list(range(8))]),  # every dim 0 divides by tp x fsdp = 8: even shards
        ({"dp_shard": 3}, 3, [[0], [1], [2]]),  # 256 rows in chunks of 86: rank 2 holds 84, so all apart
    ],
    ids=["pp", "cp", "even-tp-fsdp", "uneven-fsdp"],
)
def test_rank_classes_follow_torchtitans_mesh(layout, world_size, expected):
    assert ranks_of(degrees(**layout), world_size) == expected


def cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hyperdryrun.cli", "torchtitan", *args, "--no-stacks", "--output-dir", "out"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(REPO / "src"), "COLUMNS": "200"},
    )


def test_all_ranks_simulates_one_rank_per_class_and_a_class_member_has_its_peak(tmp_path):
    argv = [*DEBUG, "--n-layers", "2", *degrees(pp=2, dp_shard=2)]
    done = cli(tmp_path, *argv, "--all-ranks", "--world-size", "4")
    assert done.returncode == 0, done.stderr
    out = tmp_path / "out"
    classes = json.loads((out / "rank_classes.json").read_text())
    assert classes["rank_class"] == [0, 0, 1, 1]
    assert [c["representative"] for c in classes["classes"]] == [0, 2]
    assert sorted(p.name for p in out.iterdir()) == ["rank_0", "rank_2", "rank_classes.json"]
    peaks = {c["representative"]: c["peak_bytes"] for c in classes["classes"]}
    report = json.loads((out / "rank_2" / "rank_2_memory.json").read_text())
    # torchtitan's default schedule, Interleaved1F1B, gives pp rank p stages p and p + 2 of 4
    assert report["metadata"]["pipeline"]["stage_indices"] == [1, 3]
    assert (
        f"max peak: {max(peaks.values()) / 2**20:.2f} MiB on rank {max(peaks, key=peaks.get)}" in done.stdout
    )
    # rank 1 is not simulated: its own dry run has the peak of its class's representative, rank 0
    rank1 = simulate_torchtitan([*DEBUG, *degrees(pp=2, dp_shard=2)], world_size=4,
                                rank=1, n_layers=2, capture_stacks=False)  # fmt: skip
    assert rank1.peak == peaks[0]


def test_fit_tries_each_layout_of_the_world_and_chooses_the_first_that_fits(tmp_path):
    argv = [*DEBUG, "--n-layers", "2", "--world-size", "2"]
    argv += [
        "--fit",
        "--fit-tp",
        "1,2",
        "--fit-pp",
        "1,2,4",
    ]  # tp 4, pp 4 and tp 2 x pp 2 do not fill 2 ranks
    done = cli(tmp_path, *argv, "--device-memory-gib", "64")
    assert done.returncode == 0, done.stderr
    assert "chosen: layout 0 (dp_shard=2 tp=1 pp=1 cp=1 ep=1), the first searched that fits" in done.stdout
    out = tmp_path / "out"
    # 3 layouts: FSDP 2 (one class), PP 2 (a class per stage), TP 2 (one class)
    assert sorted(p.name for p in out.iterdir()) == ["layout_0", "layout_1", "layout_2"]
    assert sorted(p.name for p in (out / "layout_1").iterdir()) == ["rank_0", "rank_1"]
    tp = json.loads((out / "layout_2" / "rank_0" / "rank_0_memory.json").read_text())
    assert tp["metadata"]["parallel"]["tp"] == 2 and tp["metadata"]["parallel"]["dp_shard"] == 1

    done = cli(tmp_path, *argv, "--device-memory-gib", "0.001")
    assert done.returncode == 1, done.stderr
    assert "no searched layout fits" in done.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--fit"], "--fit needs a capacity: give --gpu or --device-memory-gib"),
        (["--all-ranks", "--rank", "1"], "--rank and --ranks/--all-ranks/--fit: give one of them"),
        (["--fit", "--device-memory-gib", "8", "--fit-tp", "0"], "--fit-tp: degrees must be >= 1 (got 0)"),
    ],
)
def test_bad_many_rank_flags_are_one_line_errors(tmp_path, args, message):
    done = cli(tmp_path, *DEBUG, "--world-size", "2", *args)
    assert done.returncode == 2
    assert done.stderr == f"hyperdryrun: error: {message}\n"


@pytest.mark.parametrize(
    "layout, world_size, ranks, same",
    [
        ({"tp": 2, "dp_shard": 4}, 8, (0, 7), True),  # one class: the last rank's step is the first's
        ({"dp_shard": 3}, 3, (0, 2), False),  # uneven FSDP shards: rank 2 holds less, so a class of its own
    ],
    ids=["even-tp-fsdp", "uneven-fsdp"],
)
def test_ranks_of_one_class_have_one_peak_and_split_classes_do_not(layout, world_size, ranks, same):
    argv = [*DEBUG, *degrees(**layout)]
    peaks = [
        simulate_torchtitan(argv, world_size=world_size, rank=r, n_layers=1, capture_stacks=False).peak
        for r in ranks
    ]
    assert (peaks[0] == peaks[1]) is same, peaks
