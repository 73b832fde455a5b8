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


SLOW = (
    "tests/accuracy/",
    "tests/commands/test_exit_codes.py",
    "tests/integrations/test_torchtitan.py",
    "tests/measure/",
    "tests/parallel/test_context.py",
    "tests/parallel/test_expert.py",
    "tests/parallel/test_pipeline.py",
    "tests/test_activation_checkpointing.py",
    "tests/test_benchmarks.py",
    "tests/test_cancellation.py",
    "tests/test_determinism.py",
    "tests/test_readme.py",
    "tests/test_run_ranks.py",
    "tests/test_runner.py",
    "tests/search/test_bounds.py",
    "tests/search/test_classes.py",
    "tests/search/test_executors.py",
    "tests/search/test_extrapolate.py",
    "tests/search/test_fit.py",
    "tests/viz/test_browser.py",
)
"""Test files that run real steps, child processes or a browser: marked ``slow``, so ``pytest -m "not slow"`` is the
inner loop (CI runs everything)."""


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: runs real steps, child processes or a browser (CI runs them)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        if path.startswith(SLOW):
            item.add_marker(pytest.mark.slow)
