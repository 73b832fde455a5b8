"""PYTORCH_CUDA_ALLOC_CONF parsing: torch's keys, syntax, defaults and checks."""

from __future__ import annotations

import pytest
import torch

from hyperdryrun.allocator import AllocatorConfigError, AllocatorOptions

MiB = 1 << 20
SIZE_MAX = (1 << 64) - 1


def test_empty_settings_are_torchs_defaults():
    # AcceleratorAllocatorConfig: max_split_size = SIZE_MAX, max_non_split_rounding = large_segment_size =
    # kLargeBuffer 20 MiB, no garbage collection, no roundup, no expandable segments, fraction 1.
    opts = AllocatorOptions.parse("")
    assert opts.max_split_size == SIZE_MAX
    assert opts.max_non_split_rounding_size == opts.large_segment_size == 20 * MiB
    assert opts.garbage_collection_threshold == 0.0
    assert opts.roundup_power2_divisions == (0,) * 16
    assert opts.expandable_segments is False
    assert opts.per_process_memory_fraction == 1.0
    assert opts == AllocatorOptions(settings="")


def test_sizes_are_given_in_mib_and_held_in_bytes():
    opts = AllocatorOptions.parse(
        "max_split_size_mb:200, max_non_split_rounding_mb:64,garbage_collection_threshold:0.6,"
        "expandable_segments:True,per_process_memory_fraction:0.9,"
    )  # spaces are dropped and a trailing comma is allowed, as torch's ConfigTokenizer does
    assert opts.max_split_size == 200 * MiB
    assert opts.max_non_split_rounding_size == 64 * MiB
    assert opts.garbage_collection_threshold == 0.6
    assert opts.expandable_segments is True
    assert opts.per_process_memory_fraction == 0.9


def test_large_segment_size_sets_the_default_rounding_and_the_lower_bound_of_max_split_size():
    # parseArgs reads large_segment_size_mb first wherever it stands; max_non_split_rounding defaults to it and
    # max_split_size_mb must be >= it (torch's AllocatorConfig_test: "max_split_size_mb:20,large_segment_size_mb:25"
    # throws).
    opts = AllocatorOptions.parse("max_split_size_mb:32,large_segment_size_mb:32")
    assert opts.large_segment_size == opts.max_non_split_rounding_size == opts.max_split_size == 32 * MiB
    with pytest.raises(
        AllocatorConfigError, match=r"max_split_size_mb: must be >= large_segment_size_mb \(25\) \(got 20\)"
    ):
        AllocatorOptions.parse("max_split_size_mb:20,large_segment_size_mb:25")


def test_roundup_power2_divisions_list_form_fills_the_intervals_as_torch_does():
    # [256:1,512:2,>:8]: the first bound fills every interval below it; 256 MiB is interval 8, 512 MiB interval 9;
    # ">" fills the intervals after the last bound.
    opts = AllocatorOptions.parse("roundup_power2_divisions:[256:1,512:2,>:8]")
    assert opts.roundup_power2_divisions == (1,) * 9 + (2,) + (8,) * 6
    # torch's own expectations (c10/test/core/AllocatorConfig_test.cpp), by size:
    opts = AllocatorOptions.parse("roundup_power2_divisions:[64:8,128:2,256:4,512:2,1024:4,>:1]")
    sizes = [32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
    assert [opts.divisions(mb * MiB) for mb in sizes] == [8, 8, 2, 4, 2, 4, 1, 1, 1]
    opts = AllocatorOptions.parse("roundup_power2_divisions:[128:8,256:16,512:1,2048:8,>:2]")
    sizes = [64, 128, 256, 512, 1024, 2048, 4096]
    assert [opts.divisions(mb * MiB) for mb in sizes] == [8, 8, 16, 1, 0, 8, 2]
    assert AllocatorOptions.parse("roundup_power2_divisions:4").roundup_power2_divisions == (4,) * 16


def test_keys_without_effect_on_device_memory_are_accepted_and_listed():
    opts = AllocatorOptions.parse(
        "pinned_use_background_threads:True,release_lock_on_cudamalloc:True,backend:native"
    )
    assert opts.no_effect == ("pinned_use_background_threads", "release_lock_on_cudamalloc")
    assert (
        opts.settings == "pinned_use_background_threads:True,release_lock_on_cudamalloc:True,backend:native"
    )


BAD = {
    "bogus_key:1": "unrecognized key 'bogus_key'",
    "max_split_size_mb:10": r"max_split_size_mb: must be >= large_segment_size_mb \(20\) \(got 10\)",
    "max_non_split_rounding_mb:10": r"max_non_split_rounding_mb: must be >= large_segment_size_mb \(20\) \(got 10\)",
    "large_segment_size_mb:5": r"large_segment_size_mb: must be > 10 \(got 5\)",
    "max_split_size_mb:abc": r"max_split_size_mb: expected a non-negative integer \(got 'abc'\)",
    "max_split_size_mb": "max_split_size_mb: missing value",
    "max_split_size_mb:": "max_split_size_mb: missing value",
    "max_split_size_mb:100;expandable_segments:True": (
        r"max_split_size_mb: expected ',' after the value \(got '100;expandable_segments:True'\)"
    ),
    "max_split_size_mb:100 expandable_segments:True": (
        r"max_split_size_mb: expected ',' after the value \(got '100expandable_segments:True'\)"
    ),
    "garbage_collection_threshold:1.5": r"garbage_collection_threshold: must be in \(0.0, 1.0\) \(got 1.5\)",
    "garbage_collection_threshold:0": r"garbage_collection_threshold: must be in \(0.0, 1.0\) \(got 0.0\)",
    "garbage_collection_threshold:abc": r"garbage_collection_threshold: expected a number \(got 'abc'\)",
    "expandable_segments:true": r"expandable_segments: expected True or False \(got 'true'\)",
    "roundup_power2_divisions:3": r"roundup_power2_divisions: divisions must be a power of 2 \(got 3\)",
    "roundup_power2_divisions:0": r"roundup_power2_divisions: divisions must be a power of 2 \(got 0\)",
    "roundup_power2_divisions:[256:1,512:3]": r"divisions must be a power of 2 or 0 \(got 3\)",
    "roundup_power2_divisions:[300:1]": r"interval bounds must be powers of 2 \(MiB\) or > \(got '300'\)",
    "roundup_power2_divisions:[256:1,>:8": "roundup_power2_divisions: missing value",
    "per_process_memory_fraction:2": r"per_process_memory_fraction: must be in \[0.0, 1.0\] \(got 2.0\)",
    "backend:cudaMallocAsync": "backend: cudaMallocAsync is not the caching allocator this models",
    "max_split_size_mb:100,,expandable_segments:True": "unrecognized key ','",
}


@pytest.mark.parametrize("settings", sorted(BAD))
def test_a_bad_setting_is_a_one_line_error_naming_the_key_and_value(settings):
    with pytest.raises(AllocatorConfigError, match=BAD[settings]) as err:
        AllocatorOptions.parse(settings)
    assert str(err.value).startswith("PYTORCH_CUDA_ALLOC_CONF: ")
    assert "\n" not in str(err.value)


# Strings for the generic keys both parsers see; the pinned CPU wheel has no CUDA key parser (it skips those).
AGREE = [
    "max_split_size_mb:100",
    "max_split_size_mb: 100,",
    "max_split_size_mb:10",
    "max_split_size_mb:abc",
    "max_split_size_mb",
    "large_segment_size_mb:5",
    "large_segment_size_mb:11,max_split_size_mb:11",
    "max_split_size_mb:20,large_segment_size_mb:25",
    "max_non_split_rounding_mb:10",
    "garbage_collection_threshold:0.5",
    "garbage_collection_threshold:1.5",
    "garbage_collection_threshold:0",
    "expandable_segments:True,expandable_segments:False",
    "expandable_segments:true",
    "roundup_power2_divisions:4",
    "roundup_power2_divisions:3",
    "roundup_power2_divisions:[256:1,512:2,>:8]",
    "roundup_power2_divisions:[256:1,512:3]",
    "roundup_power2_divisions:[300:1]",
    "roundup_power2_divisions:[256:1,>:8",
    "roundup_power2_divisions:[]",
    "roundup_power2_divisions:[>:4]",
    "pinned_max_cached_size_mb:64,pinned_use_background_threads:False",
]


def _torch_accepts(settings: str) -> bool:
    try:
        torch._C._accelerator_setAllocatorSettings(settings)
    except (ValueError, RuntimeError):
        return False
    return True


def test_the_pinned_torch_parser_accepts_and_rejects_the_same_strings():
    before = torch._C._accelerator_getAllocatorSettings()
    try:
        for settings in AGREE:
            # torch keeps large_segment_size across parses; start each from its default.
            torch._C._accelerator_setAllocatorSettings("large_segment_size_mb:20")
            try:
                AllocatorOptions.parse(settings)
                ours = True
            except AllocatorConfigError:
                ours = False
            assert ours == _torch_accepts(settings), settings
    finally:
        torch._C._accelerator_setAllocatorSettings("large_segment_size_mb:20")
        torch._C._accelerator_setAllocatorSettings(before)
    assert torch._C._accelerator_getAllocatorSettings() == before


def test_from_env_reads_the_variable_torch_reads_first():
    assert AllocatorOptions.from_env({}) == AllocatorOptions()
    env = {
        "PYTORCH_ALLOC_CONF": "max_split_size_mb:64",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    }
    opts = AllocatorOptions.from_env(env)
    assert opts.expandable_segments is True and opts.max_split_size == SIZE_MAX
    assert (
        AllocatorOptions.from_env({"PYTORCH_ALLOC_CONF": "max_split_size_mb:64"}).max_split_size == 64 * MiB
    )
    with pytest.raises(AllocatorConfigError, match=r"^PYTORCH_ALLOC_CONF: max_split_size_mb: must be >= "):
        AllocatorOptions.from_env({"PYTORCH_ALLOC_CONF": "max_split_size_mb:1"})


def test_from_env_defaults_to_the_process_environment(monkeypatch):
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "garbage_collection_threshold:0.7")
    assert AllocatorOptions.from_env().garbage_collection_threshold == 0.7
