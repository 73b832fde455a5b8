"""The result cache: keys by the whole job and the versions; atomic entries; a broken entry is a miss."""

from __future__ import annotations

import gzip

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


def test_entries_round_trip_and_a_broken_one_is_a_miss(tmp_path):
    cache = ResultCache(tmp_path)
    assert cache.get("figures", "ab" * 32) is None
    cache.put("figures", "ab" * 32, {"peak_bytes": 5})
    assert cache.get("figures", "ab" * 32) == {"peak_bytes": 5}
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
