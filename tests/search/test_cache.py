"""The result cache: keys by the whole job and the versions; atomic entries; a broken entry is a miss."""

from __future__ import annotations

import gzip
import json

import pytest

from hyperdryrun.search.cache import ResultCache, job_key
from tests.conftest import job


def test_keys_change_with_any_job_field_but_not_with_the_capacity_or_outputs():
    a = job(world__world_size=2)
    assert job_key(a, "figures") == job_key(job(world__world_size=2), "figures")
    assert job_key(a, "figures") != job_key(job(world__world_size=2, world__rank=1), "figures")
    assert job_key(a, "figures") != job_key(job(world__world_size=2, training__ac="full"), "figures")
    assert job_key(a, "figures") != job_key(a, "samples")
    assert job_key(a, "figures", shortcut=True) != job_key(a, "figures", shortcut=False)
    assert job_key(a, "figures") == job_key(
        job(world__world_size=2, device_memory_gib=40, output_dir="x"), "figures"
    )


FIGURES = {
    "peak_bytes": 5, "peak_phase": "forward", "peak_op": "aten.mm", "breakdown_at_peak": {"Parameter": 5},
    "initial_bytes": 0, "current_bytes": 5, "breakdown_after_step": {"Parameter": 5},
    "phases": {"forward": {"peak_bytes": 5, "peak_op": "aten.mm", "breakdown_at_peak": {"Parameter": 5}}},
    "peak_reserved_bytes": None, "peak_device_bytes": None, "method": "full", "detail": "",
}  # fmt: skip


def test_entries_round_trip_and_a_broken_one_is_a_miss(tmp_path):
    cache = ResultCache(tmp_path)
    assert cache.get("figures", "ab" * 32) is None
    cache.put("figures", "ab" * 32, FIGURES)
    assert cache.get("figures", "ab" * 32) == FIGURES
    path = next(tmp_path.rglob("*.json.gz"))
    path.write_bytes(b"not gzip")
    assert cache.get("figures", "ab" * 32) is None
    with gzip.open(path, "wt") as f:
        f.write("{truncated")
    assert cache.get("figures", "ab" * 32) is None
    assert not list(tmp_path.rglob("*.tmp"))


def test_no_directory_keeps_nothing():
    cache = ResultCache(None)
    cache.put("figures", "k", {"a": 1})
    assert cache.get("figures", "k") is None


def test_the_figures_are_the_real_ones_to_dict():
    from hyperdryrun.search.extrapolate import StepFigures

    assert StepFigures.from_dict(FIGURES).to_dict() == FIGURES


@pytest.mark.parametrize(
    "change",
    [
        {"peak_bytes": -5},
        {"peak_bytes": True},
        {"peak_bytes": 5.0},
        {"peak_reserved_bytes": -1},
        {"breakdown_at_peak": {"Parameter": -5}},
        {"phases": {"forward": {"peak_bytes": -1, "peak_op": None, "breakdown_at_peak": {}}}},
        {"phases": []},
        {"initial_bytes": None},
        {"detail": ["x"]},
    ],
    ids=["negative", "bool", "float", "reserved", "breakdown", "phase", "phases-list", "missing", "detail"],
)
def test_an_edited_entry_is_a_miss_not_trusted(change, tmp_path):
    """Issue 30, item 11: an entry edited to peak_bytes -5 made a layout "fit" at -0.00 GiB."""
    cache = ResultCache(tmp_path)
    cache.put("figures", "cd" * 32, {**FIGURES, **change})
    assert cache.get("figures", "cd" * 32) is None


def test_a_deeply_nested_or_huge_entry_is_a_miss(tmp_path, monkeypatch):
    cache = ResultCache(tmp_path)
    cache.put("figures", "ef" * 32, FIGURES)
    path = next(tmp_path.rglob("*.json.gz"))
    with gzip.open(path, "wt") as f:
        f.write("[" * 100_000 + "]" * 100_000)  # a RecursionError (exit 3) before
    assert cache.get("figures", "ef" * 32) is None
    with gzip.open(path, "wt") as f:
        f.write(json.dumps(FIGURES) + " " * 5000)
    monkeypatch.setenv("HYPERDRYRUN_MAX_DECOMPRESSED_BYTES", "4096")
    assert cache.get("figures", "ef" * 32) is None


def test_sample_tables_are_checked_too(tmp_path):
    cache = ResultCache(tmp_path)
    good = {
        "rows": [[0, "forward", 0, "layers.0", "aten.mm", [10, 10, 0]]],
        "phases": ["forward"],
        "scalars": [0, 1],
    }
    cache.put("samples", "01" * 32, good)
    assert cache.get("samples", "01" * 32) == good
    cache.put("samples", "02" * 32, {**good, "scalars": [0, -1]})
    assert cache.get("samples", "02" * 32) is None
