"""One rank's step figures for the layout search: from sample runs where the exact shortcut holds (allocated figures
extrapolated, :mod:`hyperdryrun.search.extrapolate`; reserved and device peaks of the step's blocks written down from
the samples, :mod:`hyperdryrun.search.synthesis`), else from one full simulation."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hyperdryrun.search.extrapolate import (
    SampleSource,
    ShortcutFailed,
    StepFigures,
    extrapolate,
    full_figures,
    plan_for,
    run_sample,
    sample_config,
)
from hyperdryrun.search.synthesis import with_device_peaks

if TYPE_CHECKING:
    from hyperdryrun.config import JobConfig


def step_figures(cfg: JobConfig, shortcut: bool = True, sample: SampleSource | None = None) -> StepFigures:
    """``cfg``'s rank's step figures: extrapolated from sample runs when :func:`plan_for` finds a plan and every
    check holds, else one full simulation (``method`` and ``detail`` say which and why)."""
    if not shortcut:
        return full_figures(cfg, "shortcut off")
    plan, why = plan_for(cfg)
    if plan is None:
        return full_figures(cfg, why)
    get = sample or run_sample
    samples = [(point, get(sample_config(cfg, plan, point))) for point in plan.points]
    try:
        figures = extrapolate(samples, plan)
    except ShortcutFailed as err:
        return full_figures(cfg, f"extrapolation check failed: {err}")
    return with_device_peaks(
        figures, samples, plan, None if cfg.target is None else cfg.target.capacity_bytes
    )
