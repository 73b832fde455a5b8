"""Run the same training step for real and record its allocations with torch.profiler.

The job is the dry run's (same model, parallelisms, optimizer, batches and step function); tensors are real, on
the CPU (or any real device), so every byte is a real allocation. World size > 1 runs the chosen rank in this
process with real tensors and the fake process group: collectives allocate their outputs but move no data.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from hyperdryrun.engine import (
    BatchFn,
    LossFn,
    ModelFn,
    OptimizerFn,
    ParallelizeFn,
    SimulationError,
    StepFn,
    default_optimizer,
    micro_batch_step,
    resolve_step,
)
from hyperdryrun.ingest.events import trace_from_events
from hyperdryrun.ingest.profiler import events_from_profiler, mark, mark_micro_batch, resident_events
from hyperdryrun.trace.blocks import STEP_PHASES, Category, Phase, live_bytes_by_task
from hyperdryrun.trace.step import ModuleStats, StepTrace
from hyperdryrun.trace.tensors import clean_fqn, local_tensor, resident_tensors, unique_storage_bytes
from hyperdryrun.world import SimulatedWorld

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
    loss_fn: LossFn | None = None,
    step_fn: StepFn | None = None,
    parallelize_fn: ParallelizeFn | None = None,
    optimizer_fn: OptimizerFn | None = None,
    init_fn: Any = None,
    world_size: int = 1,
    rank: int = 0,
    local_rank: int | None = None,
    mesh_shape: tuple[int, ...] | None = None,
    mesh_dim_names: tuple[str, ...] | None = None,
    device: str = "cpu",
    num_micro_batches: int = 1,
    capture_stacks: bool = True,
    metadata: dict[str, Any] | None = None,
    held_fn: Callable[[], Iterable[tuple[torch.Tensor, Category, str]]] | None = None,
) -> StepTrace:
    """Execute one training step for real, after one untracked warm-up step, and return its measured trace.

    Arguments as :func:`hyperdryrun.engine.simulate`; ``init_fn(model)`` fills the materialised parameters and
    buffers with real values (default: ``model.init_weights()`` where it exists). ``held_fn()`` names the other
    storages that the step function keeps from one step to the next, as ``(tensor, category, module)`` (e.g. a
    pipeline schedule's receive buffers): alive when profiling starts, they are seeded like the parameters.
    """
    step_fn = resolve_step(loss_fn, step_fn, num_micro_batches)
    optimizer_fn = optimizer_fn or default_optimizer
    timings: dict[str, float] = {}
    stage = "world"
    t0 = time.perf_counter()
    world = SimulatedWorld(
        world_size,
        rank,
        local_rank,
        mesh_shape,
        mesh_dim_names,
        target_device=device,
        simulation_device=device,
    )
    try:
        with world:
            stage = "model"
            with torch.device("meta"):
                model = model_fn()
            stage = "parallelize"
            if parallelize_fn is not None:
                model = parallelize_fn(model, world.mesh) or model
            stage = "materialize"
            model.to_empty(device=device)
            with torch.no_grad():
                (init_fn or _default_init)(model)
            stage = "optimizer"
            optimizer = optimizer_fn([p for p in model.parameters() if p.requires_grad])
            dev = torch.device(device)

            def batches(marked: bool) -> Iterator[Any]:
                for i in range(num_micro_batches):
                    if marked:
                        mark_micro_batch(i)
                    batch = batch_fn(i, dev)
                    if marked:  # the dry run labels the batch "Other" (it is input, not an activation)
                        for leaf in tree_leaves(batch):
                            if isinstance(leaf, torch.Tensor):
                                mark(leaf, Category.OTHER)
                    yield batch
                    del batch

            stage = "warm-up"
            step_fn(model, optimizer, batches(False))
            optimizer.zero_grad(set_to_none=True)
            gc.collect()
            timings["setup"] = time.perf_counter() - t0
            stage = "step"
            names = {id(m): clean_fqn(n) for n, m in model.named_modules()}
            held = list(held_fn()) if held_fn is not None else []
            resident = resident_events([*resident_tensors(model, optimizer), *held], device=device)
            del held
            t1 = time.perf_counter()
            prof = _profile_step(step_fn, model, optimizer, batches(True))
            timings["step"] = time.perf_counter() - t1
            stage = "trace"
            events = events_from_profiler(prof, module_names=names, device=device)
            if not capture_stacks:
                events = [dataclasses.replace(e, frames=()) for e in events]
            del prof
            core = trace_from_events([e for e in events if not e.scratch], resident=resident, alignment=1)
            trace = trace_from_events(
                events,
                resident=resident,
                metadata={
                    "world_size": world_size,
                    "rank": rank,
                    "local_rank": world.local_rank,
                    "target_device": device,
                    "simulation_device": device,
                    "mesh_shape": list(world.mesh_shape),
                    "mesh_dim_names": list(world.mesh_dim_names),
                    "num_micro_batches": num_micro_batches,
                    "optimizer": type(optimizer).__name__,
                    **(metadata or {}),
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
                limitations=[PROFILER_LIMITATION.format(device=device)]
                + ([FAKE_PG_LIMITATION] if world_size > 1 else []),
                alignment=1,
                device=device,
                timings=timings,
            )
            trace.modules = module_stats(model, trace)
            del model, optimizer
    except Exception as err:
        raise SimulationError(stage, err) from err
    return trace


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


def _default_init(model: nn.Module) -> None:
    init = getattr(model, "init_weights", None)
    if callable(init):
        init()


def _profile_step(step_fn: StepFn, model: nn.Module, optimizer: torch.optim.Optimizer, batches) -> Any:
    """The step under torch.profiler, with markers for the roles of parameters, gradients and states."""
    from torch.nn.modules.module import (
        register_module_forward_hook,
        register_module_forward_pre_hook,
    )
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
    from torch.profiler import ProfilerActivity, profile

    def note_module(mod: nn.Module, *_: Any) -> None:
        for p in mod._parameters.values():
            if p is not None:
                mark(local_tensor(p), Category.PARAMETER)
        for b in mod._buffers.values():
            if b is not None:
                mark(b, Category.BUFFER)

    def note_grads(opt: torch.optim.Optimizer, *_: Any) -> None:
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    mark(local_tensor(p.grad), Category.GRADIENT)

    def note_states(opt: torch.optim.Optimizer, *_: Any) -> None:
        for state in opt.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    mark(local_tensor(v), Category.OPTSTATE)

    handles = [
        register_module_forward_pre_hook(note_module),
        register_module_forward_hook(note_module),
        register_optimizer_step_pre_hook(note_grads),
        register_optimizer_step_post_hook(note_states),
    ]
    try:
        with profile(
            activities=[ProfilerActivity.CPU],
            profile_memory=True,
            record_shapes=True,
            with_stack=True,  # also what names modules (nn.Module calls are Python-tracer events)
        ) as prof:
            step_fn(model, optimizer, batches)
    finally:
        for h in handles:
            h.remove()
    return prof


def init_stages(model: nn.Module, init_weights: Callable[[nn.Module], None]) -> None:
    """Real values by a model family's initialiser, on each of a rank's pipeline stages
    (:class:`~hyperdryrun.parallel.pipeline.PipelineStages`) or on the whole model."""
    from hyperdryrun.parallel.pipeline import PipelineStages

    for part in model.values() if isinstance(model, PipelineStages) else [model]:
        init_weights(part)


def init_llama(model: nn.Module) -> None:
    """Real values for the built-in Llama (the llama family's initialiser), stage by stage."""
    from hyperdryrun.models.registry import LLAMA

    init_stages(model, LLAMA.init_weights)


def measure_job(cfg: Any, capture_stacks: bool = True, device: str = "cpu") -> StepTrace:
    """Measure the built-in recipe for the rank that ``cfg`` names (the job :func:`hyperdryrun.recipe.run_job`
    dry-runs), with real tensors on ``device``."""
    from hyperdryrun.parallel.optimizer import build_optimizer
    from hyperdryrun.recipe import (
        batch_fn,
        job_metadata,
        llama_loss,
        loss_context,
        model_fn,
        parallelize,
        pipeline,
    )

    why = unsupported(cfg)
    if why:
        raise MeasureError(why)
    dims, family = cfg.dims, cfg.model.family
    held_fn = None
    if cfg.parallel.pp > 1:
        pipe = pipeline(cfg)
        step_fn, parallelize_fn = pipe.step, pipe.parallelize
        held_fn = lambda: pipeline_held_buffers(pipe.schedule)  # noqa: E731
    else:
        step_fn = micro_batch_step(llama_loss, cfg.training.num_micro_batches, loss_context(cfg))
        parallelize_fn = parallelize(cfg)
    return measure(
        model_fn(cfg),
        batch_fn(cfg),
        step_fn=step_fn,
        parallelize_fn=parallelize_fn,
        optimizer_fn=lambda params: build_optimizer(params, cfg),
        init_fn=lambda model: init_stages(model, family.init_weights),
        world_size=cfg.world.world_size,
        rank=cfg.world.rank,
        local_rank=cfg.local_rank,
        mesh_shape=dims.mesh_shape,
        mesh_dim_names=dims.mesh_dim_names,
        device=device,
        num_micro_batches=cfg.training.num_micro_batches,
        capture_stacks=capture_stacks,
        metadata=job_metadata(cfg),
        held_fn=held_fn,
    )


def pipeline_held_buffers(schedule: Any) -> Iterator[tuple[torch.Tensor, Category, str]]:
    """The p2p receive buffers of a built pipeline schedule's stages (torch 2.13 ``PipelineStage`` allocates one
    per micro batch for activations and for gradients at the first step and keeps them): input data, ``Other``,
    as the dry run labels them."""
    if schedule is None:
        return
    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    for stage in stages:
        for infos in (stage.args_recv_info, stage.grad_recv_info):
            for recv in infos.values():
                for info in recv:
                    if not getattr(info, "is_root_arg", True) and info.buffer is not None:
                        yield info.buffer, Category.OTHER, ""
