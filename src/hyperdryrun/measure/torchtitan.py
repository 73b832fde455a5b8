"""A torchtitan job's step executed for real on the CPU under torch.profiler: the ground truth of its dry run.

The job is the one ``hyperdryrun torchtitan`` dry-runs (:func:`hyperdryrun.integrations.torchtitan.torchtitan_job`:
torchtitan's config, model, parallelize function, optimizer container, loss and ``Trainer.train_step``), set up by
the same :func:`~hyperdryrun.engine.prepare` with real values and a warm-up step, as
:func:`~hyperdryrun.measure.measure_plan` does for the built-in recipe. World size > 1 runs the chosen rank alone with
real tensors and the fake process group, as ``hyperdryrun measure`` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Unpack

from hyperdryrun.compat import torchtitan_families as families
from hyperdryrun.integrations.torchtitan import JobArgs, TorchtitanJob, torchtitan_job
from hyperdryrun.measure.step import CP_UNSUPPORTED, MeasureError, measure_plan
from hyperdryrun.trace.step import StepTrace

FLEX_ON_CPU = (
    "--attention: torchtitan's {attention} has no backward on the CPU (torch 2.13: 'FlexAttention does not support "
    "backward on CPU'), so its step cannot be measured here; measure with --attention sdpa, and dry-run the same "
    "job with --attention sdpa --target-device cpu to compare"
)


def unsupported_torchtitan(job: TorchtitanJob) -> str | None:
    """Why the prepared ``job`` cannot be executed for real on the CPU (one line), or None."""
    titan = job.metadata["torchtitan"]
    delta_net = families.fla_layers(job.config.model_spec.model)
    if delta_net:
        return (
            f"--measure: layers {delta_net} are Gated DeltaNet, whose fla kernels ({families.FLA_KERNEL}) are "
            "Triton kernels that need a GPU (triton: '0 active drivers' on the CPU), so a real CPU step cannot run "
            "them; dry-run the job instead"
        )
    if titan["attention"] in ("FlexAttention", "VarlenAttention"):
        return FLEX_ON_CPU.format(attention=titan["attention"])
    if job.metadata["parallel"]["cp"] > 1:
        return CP_UNSUPPORTED.format(cp=job.metadata["parallel"]["cp"])
    if titan["compile"]:
        return (
            "compile.enable (--compile.enable): compiled regions are not measured on the CPU (Inductor would "
            "compile CPU kernels whose memory is not the dry run's); measure without --compile.enable (got True)"
        )
    return None


def measure_torchtitan(
    argv: Sequence[str], *, capture_stacks: bool = True, **job_args: Unpack[JobArgs]
) -> StepTrace:
    """Execute one training step of a torchtitan job (its own command line) for real on the CPU as rank ``rank``
    of ``world_size``, after one untracked warm-up step; its measured trace (``metadata.mode = "measured"``).
    Bad input raises :class:`~hyperdryrun.integrations.torchtitan.TorchtitanError`, a job the CPU cannot run
    :class:`~hyperdryrun.measure.step.MeasureError`."""
    with torchtitan_job(argv, **{**job_args, "target_device": "cpu"}, real=True) as job:
        why = unsupported_torchtitan(job)
        if why:
            raise MeasureError(why)
        trace = measure_plan(
            job.plan(), device="cpu", capture_stacks=capture_stacks, gradients_on_accumulation=True
        )
    trace.limitations = [*trace.limitations, *job.limitations]
    return trace
