"""Ground truth: the dry run's job executed for real, its allocations recorded by torch.profiler."""

from hyperdryrun.measure.step import init_llama, measure, measure_job, measure_plan

__all__ = ["init_llama", "measure", "measure_job", "measure_plan"]
