"""Run the same training step for real and record its allocations with torch.profiler.

The job is the dry run's plan (:class:`~hyperdryrun.engine.JobPlan`: same model, parallelisms, optimizer, batches
and step function, set up by the same :func:`~hyperdryrun.engine.prepare`); tensors are real, on the CPU (or any
real device), so every byte is a real allocation. World size > 1 runs the chosen rank in this process with real
tensors and the fake process group: collectives allocate their outputs but move no data.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import tempfile
import time
from collections.abc import Generator, Iterator
from typing import Any, Unpack

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from hyperdryrun import recipe
from hyperdryrun.engine import (
    BatchFn,
    JobPlan,
    ModelFn,
    PlanArgs,
    SimulationError,
    StepFn,
    interrupt_behind,
    job_plan,
    prepare,
    run_metadata,
    warnings_as_limitations,
)
from hyperdryrun.ingest.events import trace_from_events
from hyperdryrun.ingest.profiler import events_from_profiler, mark, mark_micro_batch, resident_events
from hyperdryrun.trace.blocks import STEP_PHASES, Category, Phase, live_bytes_by_task
from hyperdryrun.trace.roles import RoleMarker
from hyperdryrun.trace.step import ModuleStats, StepTrace
from hyperdryrun.trace.tensors import clean_fqn, resident_tensors, unique_storage_bytes

FAKE_PG_LIMITATION = (
    "measured with real tensors for one rank and the fake process group: collectives allocate their outputs "
    "but move no data, and the other ranks were not run"
)
CP_UNSUPPORTED = (
    "cp={cp}: context parallel cannot be measured on the CPU: torch 2.13's ring attention has no handler for the CPU "
    "SDPA kernel (_scaled_dot_product_flash_attention_for_cpu), only for the CUDA flash, efficient and cuDNN ops; "
    "measure with cp=1, or dry-run it"
)


MOE_UNSUPPORTED = (
    "model.name={model!r}: MoE models are not measured yet: a real run routes tokens by their values, while the dry "
    "run follows the routing scenario of its value rules, so the two would not count the same step; measure a dense "
    "model, or dry-run it"
)


class MeasureError(ValueError):
    """The job cannot be executed for real on this machine (the message says why)."""


def unsupported(cfg: Any) -> str | None:
    """Why ``cfg`` cannot be measured here (one line), or None."""
    if cfg.parallel.cp > 1:
        return CP_UNSUPPORTED.format(cp=cfg.parallel.cp)
    if cfg.model.is_moe:
        return MOE_UNSUPPORTED.format(model=cfg.model.name)
    return None


KERNEL_SCRATCH_NOTE = (
    "blocks allocated and freed inside one kernel (e.g. oneDNN's bf16 GEMM scratchpad, a CPU mm's contiguous "
    "copy of an operand) are real and counted in peak_bytes; a dry run records op outputs only, so "
    "peak_bytes_excluding is the figure that counts what it counts"
)
PROFILER_LIMITATION = (
    "measured from torch.profiler memory events on the '{device}' allocator: every allocation the step made, "
    "including scratch buffers inside kernels that a dry run does not see"
)


def measure(
    model_fn: ModelFn,
    batch_fn: BatchFn,
    *,
    device: str = "cpu",
    capture_stacks: bool = True,
    **plan: Unpack[PlanArgs],
) -> StepTrace:
    """Execute one training step for real, after one untracked warm-up step, and return its measured trace.

    Arguments as :func:`hyperdryrun.engine.simulate`; ``init_fn(model)`` fills the materialised parameters and
    buffers with real values (default: ``model.init_weights()`` where it exists). ``held_fn()`` names the other
    storages that the step function keeps from one step to the next, as ``(tensor, category, module)`` (e.g. a
    pipeline schedule's receive buffers): alive when profiling starts, they are seeded like the parameters.
    """
    p = job_plan(model_fn, batch_fn, target_device=device, **plan)
    return measure_plan(p, device=device, capture_stacks=capture_stacks)


def measure_plan(
    plan: JobPlan, device: str = "cpu", capture_stacks: bool = True, gradients_on_accumulation: bool = False
) -> StepTrace:
    """Execute ``plan`` for real on ``device``: set up with real values and a warm-up step (:func:`prepare`), then
    one step under torch.profiler; its allocations as a trace in the dry run's schema (``metadata.mode`` is
    ``"measured"``). ``gradients_on_accumulation``: FSDP2's unsharded gradients count as gradients, as the dry run
    counts them (off for the built-in recipe's measured reports). A failure is a :class:`SimulationError` naming
    the stage."""
    timings: dict[str, float] = {}
    stages = ["world"]
    t0 = time.perf_counter()
    try:
        world = plan.world(target_device=device, simulation_device=device)
        # torch's warnings (FSDP2's "returned a view tensor") go to the report's limitations, as run's do
        with world, warnings_as_limitations() as warned:
            model, optimizer = prepare(world, plan, stages, real=True)
            timings["setup"] = time.perf_counter() - t0
            stages.append("step")
            names = {id(m): clean_fqn(n) for n, m in model.named_modules()}
            held = list(plan.held_fn()) if plan.held_fn is not None else []
            resident = resident_events([*resident_tensors(model, optimizer), *held], device=device)
            del held
            t1 = time.perf_counter()
            prof = _profile_step(
                plan.step_fn,
                model,
                optimizer,
                _marked_batches(plan, torch.device(device)),
                gradients_on_accumulation,
            )
            timings["step"] = time.perf_counter() - t1
            stages.append("trace")
            events = events_from_profiler(prof, module_names=names, device=device)
            if not capture_stacks:
                events = [dataclasses.replace(e, frames=()) for e in events]
            del prof
            core = trace_from_events([e for e in events if not e.scratch], resident=resident, alignment=1)
            trace = trace_from_events(
                events,
                resident=resident,
                metadata={
                    **run_metadata(world, plan, optimizer),
                    **plan.metadata,
                    "mode": "measured",
                    "kernel_scratch": {
                        "peak_bytes_excluding": core.peak,
                        "phase_peak_bytes_excluding": {
                            str(ph): core.phase_peak[ph] for ph in STEP_PHASES if ph in core.phase_peak
                        },
                        "num_blocks": sum(1 for e in events if e.scratch and e.nbytes > 0),
                        "note": KERNEL_SCRATCH_NOTE,
                    },
                },
                # The recipe's plan.limitations describe its dry run; a measured report states how it was measured.
                limitations=[PROFILER_LIMITATION.format(device=device)]
                + ([FAKE_PG_LIMITATION] if plan.world_size > 1 else []),
                alignment=1,
                device=device,
                timings=timings,
            )
            trace.modules = module_stats(model, trace)
            del model, optimizer
            trace.limitations += warned()
    except Exception as err:
        if (interrupt := interrupt_behind(err)) is not None:
            raise interrupt from None
        raise SimulationError(stages[-1], err) from err
    return trace


@contextlib.contextmanager
def kineto_lines_dropped() -> Iterator[None]:
    """While inside, what is written to file descriptor 2 is held back, and on exit written to stderr less
    Kineto's ``USDT: ... profiler_start`` / ``profiler_stop`` lines, which its C++ code prints whenever a profiler
    starts or stops: noise on the terminal of a command that keeps it clean. Only around the profiler's start and
    stop, so that nothing of the step itself is held back."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):
        yield  # no stderr to keep clean
        return
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            text = held.read().decode("utf-8", "replace")
            kept = [line for line in text.splitlines(keepends=True) if not line.startswith("USDT:")]
            if kept:
                sys.stderr.write("".join(kept))


@contextlib.contextmanager
def _quiet(prof: Any) -> Iterator[Any]:
    """``with prof``, its start and stop under :func:`kineto_lines_dropped`."""
    with kineto_lines_dropped():
        prof.__enter__()
    try:
        yield prof
    finally:
        with kineto_lines_dropped():
            prof.__exit__(None, None, None)


def _marked_batches(plan: JobPlan, device: torch.device) -> Generator[Any, None, None]:
    """The plan's micro batches, each announced to the profiler and its tensors marked as input data ("Other",
    as the dry run labels them: input, not activations)."""
    for i in range(plan.num_micro_batches):
        mark_micro_batch(i)
        batch = plan.batch_fn(i, device)
        for leaf in tree_leaves(batch):
            if isinstance(leaf, torch.Tensor):
                mark(leaf, Category.OTHER)
        yield batch
        del batch


def module_stats(model: nn.Module, trace: StepTrace) -> dict[str, ModuleStats]:
    """Per module: parameter and buffer bytes (local shards), and its forward/backward local peaks: the most live
    bytes at a task whose allocations belong to the module or one inside it (recompute counts as backward, as in the
    dry run). Backward ownership comes from the autograd sequence number of the forward op, not from backward
    hooks as in the dry run, so backward local peaks of outer modules can differ by definition. Input/output bytes
    and call counts are not measured and stay 0. Containers that are never called (ModuleDict/ModuleList) get no
    peaks, as in the dry run."""
    stats: dict[str, ModuleStats] = {}
    called: set[str] = set()
    for name, mod in model.named_modules():
        m = stats.setdefault(clean_fqn(name), ModuleStats(clean_fqn(name)))
        if not isinstance(mod, (nn.ModuleDict, nn.ModuleList)):
            called.add(m.fqn)
        m.param_bytes = unique_storage_bytes(list(mod.parameters()), 1)
        m.buffer_bytes = unique_storage_bytes(list(mod.buffers()), 1)
    task_module: dict[int, str] = {}
    for blk in trace.blocks:
        if blk.phase is not Phase.INITIALIZATION:
            task_module.setdefault(blk.start, blk.module)
    live = live_bytes_by_task(trace.blocks, trace.num_tasks)
    for task, fqn in task_module.items():
        if not fqn:
            continue
        backward = trace.task_phase[task] in (Phase.BACKWARD, Phase.RECOMPUTE)
        parts = [] if fqn == "<root>" else fqn.split(".")
        for owner in ["<root>", *(".".join(parts[: i + 1]) for i in range(len(parts)))]:
            m = stats.get(owner)
            if m is None or owner not in called:
                continue
            if backward:
                m.bw_peak = max(m.bw_peak, live[task])
            elif trace.task_phase[task] is Phase.FORWARD:
                m.fw_peak = max(m.fw_peak, live[task])
    return stats


def _profile_step(
    step_fn: StepFn,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Generator[Any, None, None],
    gradients_on_accumulation: bool = False,
) -> Any:
    """The step under torch.profiler, with markers for the roles of parameters, gradients and states
    (:class:`~hyperdryrun.trace.roles.RoleMarker`, the tracker's rules)."""
    from torch.profiler import ProfilerActivity, profile

    # Without the dry run's marking on accumulation (the default): measured reports have counted FSDP2's unsharded
    # gradients, which its reduce-scatter frees before the optimizer runs, as backward temporaries; counting them as
    # gradients (as the dry run does) is a change to every measured FSDP report, to be made on its own.
    roles = RoleMarker(mark, gradients_on_accumulation=gradients_on_accumulation)
    with (
        roles.hooked(),
        _quiet(
            profile(
                activities=[ProfilerActivity.CPU],
                profile_memory=True,
                record_shapes=True,
                with_stack=True,  # also what names modules (nn.Module calls are Python-tracer events)
            )
        ) as prof,
    ):
        step_fn(model, optimizer, batches)
        # A step that takes exactly its micro batches (torchtitan's train_step calls next() n times) leaves the
        # generator suspended on its last batch; the dry run's generator is dropped when the step returns.
        batches.close()
        roles.step_done(model, optimizer)
    return prof


def init_llama(model: nn.Module) -> None:
    """Real values for the built-in Llama (the llama family's initialiser), stage by stage."""
    from hyperdryrun.models.registry import LLAMA

    recipe.init_stages(model, LLAMA.init_weights)


def measure_job(cfg: Any, capture_stacks: bool = True, device: str = "cpu") -> StepTrace:
    """Measure the built-in recipe for the rank that ``cfg`` names (the plan :func:`hyperdryrun.recipe.run_job`
    dry-runs), with real tensors on ``device``."""
    why = unsupported(cfg)
    if why:
        raise MeasureError(why)
    return measure_plan(recipe.plan(cfg), device=device, capture_stacks=capture_stacks)
