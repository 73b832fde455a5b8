"""Ground truth: the dry run's job executed for real, its allocations recorded by torch.profiler."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hyperdryrun.lazy import lazy_exports

if TYPE_CHECKING:
    from hyperdryrun.measure.step import init_llama, measure, measure_job, measure_plan

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "hyperdryrun.measure.step": (
            "init_llama",
            "measure",
            "measure_job",
            "measure_plan",
        ),
    },
)

__all__ = ["init_llama", "measure", "measure_job", "measure_plan"]
