"""Shared helpers: build a job config from a few overrides and dry-run it."""

from __future__ import annotations

import pytest

from hyperdryrun.config import build_config
from hyperdryrun.recipe import run_job


def job(**over):
    """A JobConfig for llama-tiny with nested overrides given as ``section__field=value``."""
    data: dict = {"model": {"name": "llama-tiny"}, "training": {"seq_len": 64}}
    for key, value in over.items():
        if "__" in key:
            section, field = key.split("__", 1)
            data.setdefault(section, {})[field] = value
        else:
            data[key] = value
    return build_config(data)


def dry_run(**over):
    return run_job(job(**over))


@pytest.fixture
def tiny_trace():
    return dry_run(world__world_size=2)
