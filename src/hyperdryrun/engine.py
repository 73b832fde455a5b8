"""Run one training step in the simulated world and capture its memory trace.

A :class:`JobPlan` says what to build, how to parallelize it and which step to run; :func:`simulate_plan` dry-runs
it, :func:`hyperdryrun.measure.measure_plan` executes it for real, and both set it up with :func:`prepare`.
``simulate`` is the bring-your-own-model API; :func:`hyperdryrun.recipe.plan` is the built-in recipe's plan.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypedDict, Unpack

import torch
from torch import nn

from hyperdryrun.compat import torch_dtensor, versions
from hyperdryrun.patches import Patch, PatchSet
from hyperdryrun.trace.blocks import Category
from hyperdryrun.trace.gradless import gradless_parameters
from hyperdryrun.trace.optimizer_state import describe, no_state_limitation, warm_up
from hyperdryrun.trace.sites import recording_sites, resident_sites
from hyperdryrun.trace.stacks import step_code
from hyperdryrun.trace.step import WARNED, StepTrace
from hyperdryrun.trace.tensors import resident_tensors
from hyperdryrun.trace.tracker import MemoryTracker
from hyperdryrun.world import SimulatedWorld
from hyperdryrun.world.runtime import CudaRuntime, observed
from hyperdryrun.world.values import data_dependent_errors

ModelFn = Callable[[], nn.Module]
ParallelizeFn = Callable[[nn.Module, Any], nn.Module | None]
OptimizerFn = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
BatchFn = Callable[[int, torch.device], Any]
LossFn = Callable[[nn.Module, Any], torch.Tensor]
StepFn = Callable[[nn.Module, torch.optim.Optimizer, Iterator[Any]], None]
InitFn = Callable[[nn.Module], None]
HeldFn = Callable[[], Iterable[tuple[torch.Tensor, Category, str]]]


class SimulationError(RuntimeError):
    """A failure inside the simulation, with the stage it happened in."""

    def __init__(self, stage: str, error: BaseException) -> None:
        super().__init__(f"{stage}: {type(error).__name__}: {error}")
        self.stage, self.error = stage, error


def interrupt_behind(err: BaseException) -> BaseException | None:
    """The Ctrl-C or SIGTERM (an exception that is not an ``Exception``: ``KeyboardInterrupt``, the command line's
    ``Terminated``) that ``err`` was raised while unwinding, if any. torch's fake mode cannot be interrupted
    everywhere: ``fake_tensor.in_kernel_invocation_manager`` sets the mode's ``in_kernel_invocation`` before the
    ``try`` that resets it, so an interrupt between the two leaves it set, and the next fake op on the way out (a
    ``finally`` of FSDP's or of the step) raises ``AssertionError: False, True`` over the interrupt: the run would end
    as an internal error with a report instead of stopping."""
    seen: set[int] = set()
    cause: BaseException | None = err
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if not isinstance(cause, (Exception, SystemExit, GeneratorExit)):
            return cause
        cause = cause.__cause__ or cause.__context__
    return None


def user_code_error(message: str) -> Exception:
    """A mistake in the user's own callbacks (``model_fn`` returning a str, ``loss_fn`` returning None,
    ``sys.exit()`` in the step): a :class:`~hyperdryrun.config.ConfigError`, so bad input (exit 2) on one line, not
    an internal error."""
    from hyperdryrun.config import ConfigError

    return ConfigError(message)


def exited(err: SystemExit) -> Exception:
    """The :func:`user_code_error` of a ``sys.exit()`` the user's code called where a value was expected: exit 0
    would claim a step that never ran, exit 1 an OOM."""
    return user_code_error(
        f"sys.exit({err.code!r}) was called by the job's own code: the step did not run (return from the "
        "callbacks instead)"
    )


def _kind(value: Any) -> str:
    if value is None:
        return "None"
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)}"
    name = type(value).__name__
    return f"an {name}" if name[:1].lower() in "aeiou" else f"a {name}"


def checked_model(model: Any) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise user_code_error(f"model_fn() returned {_kind(model)}, not a torch.nn.Module")
    return model


def checked_optimizer(optimizer: Any) -> Any:
    """Something to step: an optimizer, or what the user's ``step_fn`` drives (a dict or list of optimizers, a
    wrapper); None never (the step would fail on it with an AttributeError, reported as an internal error)."""
    if optimizer is None:
        raise user_code_error("optimizer_fn(params) returned None, not a torch.optim.Optimizer")
    return optimizer


def checked_batch(batch: Any, i: int) -> Any:
    from torch.utils._pytree import tree_leaves

    if not any(isinstance(leaf, torch.Tensor) for leaf in tree_leaves(batch)):
        raise user_code_error(f"batch_fn({i}, device) returned {_kind(batch)} holding no tensor")
    return batch


def checked_loss(loss: Any) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.dtype.is_floating_point:
        raise user_code_error(
            f"loss_fn(model, batch) returned {_kind(loss)}, not a scalar floating-point tensor to call backward() on"
        )
    if not loss.requires_grad:
        raise user_code_error(
            "loss_fn(model, batch) returned a tensor that does not require grad (not computed from the model's "
            "parameters)"
        )
    return loss


def dtensor_speedups() -> list[Patch]:
    """Patches that make torch's DTensor sharding propagation cheaper without changing any result
    (:func:`hyperdryrun.compat.torch_dtensor.strided_shard_flag_patches`,
    :func:`~hyperdryrun.compat.torch_dtensor.foreach_strategy_patches`; none where the release lacks what they
    speed up)."""
    return [*torch_dtensor.strided_shard_flag_patches(), *torch_dtensor.foreach_strategy_patches()]


def default_optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW with the foreach implementation, torch's default on CUDA."""
    return torch.optim.AdamW(params, lr=3e-4, foreach=True)


def micro_batch_step(
    loss_fn: LossFn, num_micro_batches: int, context: Callable[[], Any] = contextlib.nullcontext
) -> StepFn:
    """The usual step: forward + backward per micro batch (loss / n), then optimizer step and zero_grad."""

    @step_code
    def step(model: nn.Module, optimizer: torch.optim.Optimizer, batches: Iterator[Any]) -> None:
        for batch in batches:
            with context():
                loss = checked_loss(loss_fn(model, batch)) / num_micro_batches
                loss.backward()
            del loss
        if not (
            callable(getattr(optimizer, "step", None)) and callable(getattr(optimizer, "zero_grad", None))
        ):
            raise user_code_error(
                f"optimizer_fn(params) returned {_kind(optimizer)}, not a torch.optim.Optimizer: the loss_fn step "
                "calls its step() and zero_grad() (give a step_fn to drive several optimizers)"
            )
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def default_init(model: nn.Module) -> None:
    """Real values for a materialised model: its ``init_weights()`` where it has one (torchtitan's convention)."""
    init = getattr(model, "init_weights", None)
    if callable(init):
        init()


def _check_micro_batches(num_micro_batches: int) -> None:
    """An int (not a bool) within :data:`~hyperdryrun.bounds.MAX_MICRO_BATCHES`: 10**400 overflowed in the step, 2.5
    and True ran (issue 30)."""
    from hyperdryrun.bounds import MAX_MICRO_BATCHES, check_number

    check_number("num_micro_batches", num_micro_batches, 1, MAX_MICRO_BATCHES, integer=True)


def resolve_step(loss_fn: LossFn | None, step_fn: StepFn | None, num_micro_batches: int) -> StepFn:
    """The step to run: the user's ``step_fn``, or :func:`micro_batch_step` over ``loss_fn`` (exactly one given)."""
    if (loss_fn is None) == (step_fn is None):
        raise ValueError("give exactly one of loss_fn or step_fn")
    _check_micro_batches(num_micro_batches)
    return step_fn or micro_batch_step(loss_fn, num_micro_batches)


@dataclass
class JobPlan:
    """One rank's training step: what to build, how to parallelize it, which step to run and what its report says.
    The dry run (:func:`simulate_plan`) and the measured run (``hyperdryrun.measure.measure_plan``) both run it."""

    model_fn: ModelFn
    """Builds the model; called under ``torch.device("meta")``, so it allocates nothing."""
    batch_fn: BatchFn
    """``batch_fn(i, device)``: micro batch ``i``."""
    step_fn: StepFn
    """``step_fn(model, optimizer, batches)``: the whole step, optimizer step and ``zero_grad`` included."""
    parallelize_fn: ParallelizeFn | None = None
    """``parallelize_fn(model, mesh)``: the parallelisms, applied on meta with the world's mesh."""
    optimizer_fn: OptimizerFn = default_optimizer
    init_fn: InitFn | None = None
    """Real values for the materialised parameters and buffers, in a measured run (default: :func:`default_init`)."""
    world_size: int = 1
    rank: int = 0
    local_rank: int | None = None
    mesh_shape: tuple[int, ...] | None = None
    mesh_dim_names: tuple[str, ...] | None = None
    target_device: str = "cuda"
    """The device whose memory a dry run estimates (a measured run uses the device it runs on)."""
    num_micro_batches: int = 1
    metadata: dict[str, Any] = field(default_factory=dict)
    """The job's own report metadata, after the world's (``world_size``, ``mesh_shape``, ``optimizer``...)."""
    limitations: list[str] = field(default_factory=list)
    """What the dry run of this job approximates, stated after the world's (a measured run states its own)."""
    cuda: CudaRuntime | None = None
    """The GPU, caching-allocator settings and runtime costs of a CUDA target (None: the defaults)."""
    held_fn: HeldFn | None = None
    """Storages the step function keeps from one step to the next, as ``(tensor, category, module FQN)`` (e.g. a
    pipeline schedule's receive buffers): a measured run, whose warm-up step made them, seeds them as residents."""

    def __post_init__(self) -> None:
        _check_micro_batches(self.num_micro_batches)

    def world(self, target_device: str | None = None, simulation_device: str | None = None) -> SimulatedWorld:
        """The simulated world of this plan's rank (not entered yet)."""
        return SimulatedWorld(
            self.world_size,
            self.rank,
            self.local_rank,
            self.mesh_shape,
            self.mesh_dim_names,
            target_device or self.target_device,
            simulation_device,
            cuda=self.cuda,
        )


class PlanArgs(TypedDict, total=False):
    """The keyword arguments of :func:`simulate`, ``measure`` and :func:`job_plan`: :class:`JobPlan`'s fields
    (documented there, with their defaults) plus ``loss_fn``, the one place they are listed."""

    loss_fn: LossFn | None
    step_fn: StepFn | None
    parallelize_fn: ParallelizeFn | None
    optimizer_fn: OptimizerFn | None
    init_fn: InitFn | None
    world_size: int
    rank: int
    local_rank: int | None
    mesh_shape: tuple[int, ...] | None
    mesh_dim_names: tuple[str, ...] | None
    target_device: str
    num_micro_batches: int
    metadata: dict[str, Any] | None
    held_fn: HeldFn | None
    cuda: CudaRuntime | None


def job_plan(model_fn: ModelFn, batch_fn: BatchFn, **args: Unpack[PlanArgs]) -> JobPlan:
    """The plan of :func:`simulate`'s and ``measure``'s arguments: the step is ``step_fn``, or
    :func:`micro_batch_step` over ``loss_fn``; the optimizer ``optimizer_fn`` or :func:`default_optimizer`."""
    fields: dict[str, Any] = dict(args)
    step_fn = resolve_step(
        fields.pop("loss_fn", None), fields.pop("step_fn", None), args.get("num_micro_batches", 1)
    )
    fields["optimizer_fn"] = fields.get("optimizer_fn") or default_optimizer
    fields["metadata"] = dict(fields.get("metadata") or {})
    return JobPlan(model_fn, batch_fn, step_fn, **fields)


def _finish_fsdp_lazy_init(model: nn.Module) -> None:
    """Steady state for FSDP2: its lazy init, which real training runs in the first forward, re-pads uneven shards
    that ``to_empty`` left unpadded (torch 2.13 ``FSDPParam.reset_sharded_param``: a new padded storage and a copy on
    ranks that own fewer rows). Run it before tracking so the step sees the storages of step 2 onwards."""
    from torch.distributed.fsdp import FSDPModule

    roots: list[str] = []
    for name, mod in model.named_modules():
        if isinstance(mod, FSDPModule) and not any(r == "" or name.startswith(r + ".") for r in roots):
            roots.append(name)
            mod._get_fsdp_state()._lazy_init()  # private in torch 2.13; the public trigger is a forward


def _materialize_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Steady state: real training reaches step 2 with optimizer states allocated. One optimizer step on zero
    gradients, before tracking, creates them lazily as torch would; the gradients are then dropped."""
    warm_up(optimizer)


def simulate(
    model_fn: ModelFn, batch_fn: BatchFn, *, capture_stacks: bool = True, **plan: Unpack[PlanArgs]
) -> StepTrace:
    """Dry-run one training step of your own model as rank ``rank`` of ``world_size``.

    ``model_fn()`` builds the model (called under ``torch.device("meta")``: no memory is used);
    ``parallelize_fn(model, mesh)`` applies your parallelisms on meta, exactly as in your training script;
    ``optimizer_fn(params)`` builds the optimizer; ``batch_fn(i, device)`` makes micro batch ``i``;
    ``loss_fn(model, batch)`` returns the loss, or ``step_fn(model, optimizer, batches)`` runs the whole step.
    ``cuda``: the GPU, caching-allocator settings and runtime costs of a CUDA target (``metadata["cuda"]``).
    The other keywords (:class:`PlanArgs`) are :class:`JobPlan`'s fields: ``world_size``, ``rank``, ``local_rank``,
    ``mesh_shape``, ``mesh_dim_names``, ``target_device`` (``"cuda"``), ``num_micro_batches``, ``metadata``.
    """
    versions.require_supported_torch()
    return simulate_plan(job_plan(model_fn, batch_fn, **plan), capture_stacks=capture_stacks)


def simulate_plan(plan: JobPlan, capture_stacks: bool = True) -> StepTrace:
    """Dry-run ``plan``: set up on fake tensors (:func:`prepare`), trace one step, return it with its metadata and
    limitations. A failure after the world is made is a :class:`SimulationError` naming the stage."""
    versions.require_supported_torch()  # the API refuses an unsupported torch as the command line does, before any work
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    world = plan.world()
    stages = ["world"]
    try:
        with world, PatchSet(dtensor_speedups()), warnings_as_limitations() as warned:
            model, optimizer = prepare(world, plan, stages)
            with world.fake():
                timings["setup"] = time.perf_counter() - t0
                stages.append("step")
                t1 = time.perf_counter()
                # no rule given: an uncovered data-dependent op (`if tensor:`) is one line naming it, not torch's
                with data_dependent_errors(root=model), gradless_parameters(model) as gradless:
                    tracker, initial = traced_step(
                        world,
                        model,
                        optimizer,
                        plan.step_fn,
                        plan.batch_fn,
                        plan.num_micro_batches,
                        capture_stacks,
                    )
                timings["step"] = time.perf_counter() - t1
                if (
                    not tracker.task_phase
                ):  # nothing of a training step to measure (a step_fn that returns at once)
                    raise SimulationError(
                        "step",
                        user_code_error("the step ran no tensor operation: a step_fn must run the step"),
                    )
                stages.append("trace")
                trace = step_trace(tracker, initial)
                trace.metadata = {**run_metadata(world, plan, optimizer), **plan.metadata}
                if world.streams is not None:
                    trace.metadata["cuda"] = observed(world.cuda_settings, tracker, world.streams.names)
                trace.limitations = [
                    *world.limitations,
                    *no_state_limitation(optimizer, model),
                    *gradless(),
                    *plan.limitations,
                ]
                trace.timings = timings
                del model, optimizer
            trace.limitations += warned()  # what torch (or the model code) warned, once each, counted
    except (
        SimulationError,
        BrokenPipeError,
    ):  # a closed stdout under the job's own prints: 141, as the CLI's
        raise
    except SystemExit as err:  # the user's code called sys.exit(): the step did not run, so not a success
        raise SimulationError(stages[-1], exited(err)) from err
    except Exception as err:
        if (interrupt := interrupt_behind(err)) is not None:
            raise interrupt from None
        raise SimulationError(stages[-1], err) from err
    return trace


@contextlib.contextmanager
def warnings_as_limitations() -> Iterator[Callable[[], list[str]]]:
    """Record every Python warning raised inside (torch's ``UserWarning`` that an FSDP2 module returned a view,
    transformers' deprecations, ...) and every WARNING torch logs (``torch._logging``'s ``warning_once``: dynamo's
    "context_fn is passed to torch.utils.checkpoint under torch.compile", Inductor's async-TP pass) instead of
    printing it: a warning from inside the simulated step is about the simulation's model code, not the user's
    terminal, so it goes into the report's limitations, once per distinct warning, with how many times it was
    raised. Yields a function returning those lines; the warning filters and torch's log handlers come back on exit
    (``warnings.catch_warnings``, :func:`torch_log_warnings`)."""
    with warnings.catch_warnings(record=True) as caught, torch_log_warnings() as logged:
        warnings.simplefilter("always")  # every occurrence reaches the record, so the count is true

        def lines() -> list[str]:
            counts: dict[str, int] = {}
            for w in caught:
                text = f"{w.category.__name__}: {str(w.message).strip()}"
                counts[text] = counts.get(text, 0) + 1
            for text in logged:
                counts[text] = counts.get(text, 0) + 1
            return [
                f"{WARNED} ({n} time{'s' if n > 1 else ''}): {' '.join(text.split())}"
                for text, n in counts.items()
            ]

        yield lines


class _Caught(logging.Handler):
    def __init__(self, texts: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.texts = texts

    def emit(self, record: logging.LogRecord) -> None:
        # a record that reaches two torch loggers (a child that propagates) is counted once; marked on the record
        # itself (an id would be reused by the next record once this one is freed)
        if not getattr(record, "_hyperdryrun_caught", False):
            record._hyperdryrun_caught = True
            self.texts.append(f"{record.levelname} {record.name}: {record.getMessage().strip()}")


@contextlib.contextmanager
def torch_log_warnings() -> Iterator[list[str]]:
    """While inside, what torch's loggers (``torch`` and the ``torch.*`` loggers ``torch._logging`` gave handlers of
    their own) log at WARNING or above is collected into the yielded list instead of reaching their handlers
    (stderr); the handlers are put back on exit."""
    names = ["torch", *(n for n in list(logging.root.manager.loggerDict) if n.startswith("torch."))]
    loggers = [logging.getLogger(n) for n in names]
    loggers = [lg for lg in loggers if lg.name == "torch" or lg.handlers]
    texts: list[str] = []
    caught = _Caught(texts)
    saved = [(lg, list(lg.handlers)) for lg in loggers]
    try:
        for lg, handlers in saved:
            for h in handlers:
                lg.removeHandler(h)
            lg.addHandler(caught)
        yield texts
    finally:
        for lg, handlers in saved:
            lg.removeHandler(caught)
            for h in handlers:
                lg.addHandler(h)  # a no-op for a handler already there


def run_metadata(world: SimulatedWorld, plan: JobPlan, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What every report says about the run itself: the rank, its world and mesh, the devices, the optimizer, and
    the torch release it ran on (what the step's kernels, FSDP2 and DTensor behaviour come from)."""
    return {
        "world_size": world.world_size,
        "rank": world.rank,
        "local_rank": world.local_rank,
        "target_device": world.target_device,
        "simulation_device": world.device,
        "mesh_shape": list(world.mesh_shape),
        "mesh_dim_names": list(world.mesh_dim_names),
        "num_micro_batches": plan.num_micro_batches,
        "optimizer": describe(optimizer),
        "torch_version": versions.torch_version(),
    }


def prepare(
    world: SimulatedWorld, plan: JobPlan, stages: list[str] | None = None, *, real: bool = False
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``plan``'s model and optimizer in the steady state of step 2, in an entered world: built on meta,
    parallelized with the world's mesh, materialised on the world's device. Fake tensors (a dry run): FSDP2's lazy
    init finished and the optimizer states created by one step on zero gradients. ``real`` (a measured run): real
    values from ``plan.init_fn``, then one untracked warm-up step. ``stages`` gets each stage's name as it starts."""
    stages = stages if stages is not None else []
    stages.append("model")
    with torch.device("meta"), recording_sites():
        model = checked_model(plan.model_fn())
    stages.append("parallelize")
    if plan.parallelize_fn is not None:
        model = plan.parallelize_fn(model, world.mesh) or model
    with contextlib.nullcontext() if real else world.fake():
        stages.append("materialize")
        model.to_empty(device=world.device)
        if real:
            with torch.no_grad():
                (plan.init_fn or default_init)(model)
        else:
            _finish_fsdp_lazy_init(model)
        stages.append("optimizer")
        optimizer = checked_optimizer(plan.optimizer_fn([p for p in model.parameters() if p.requires_grad]))
        if real:
            stages.append("warm-up")
            plan.step_fn(model, optimizer, _batches(plan.batch_fn, plan.num_micro_batches, world.device))
            optimizer.zero_grad(set_to_none=True)
            gc.collect()
        else:
            _materialize_optimizer_state(model, optimizer)
    return model, optimizer


def _batches(batch_fn: BatchFn, num_micro_batches: int, device: str) -> Iterator[Any]:
    dev = torch.device(device)
    for i in range(num_micro_batches):
        batch = checked_batch(batch_fn(i, dev), i)
        yield batch
        del batch


def traced_step(
    world: SimulatedWorld,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    step_fn: StepFn,
    batch_fn: BatchFn,
    num_micro_batches: int,
    capture_stacks: bool = True,
) -> tuple[MemoryTracker, int]:
    """Run one step under the world's fake mode with a fresh tracker; returns it and the bytes live before the step."""
    tracker = world.track(capture_stacks=capture_stacks)
    _seed(tracker, model, optimizer)
    initial = tracker.current
    device = torch.device(world.device)

    def batches() -> Iterator[Any]:
        for i in range(num_micro_batches):
            tracker.micro_batch = i
            with tracker.labelled(Category.OTHER):
                batch = checked_batch(batch_fn(i, device), i)
            yield batch
            del batch

    tracker.start(root=model)
    try:
        step_fn(model, optimizer, batches())
    finally:
        tracker.stop()
    tracker.roles.step_done(model, optimizer)
    return tracker, initial


def step_trace(tracker: MemoryTracker, initial: int) -> StepTrace:
    """The finished tracker as plain data: blocks finalised (categories, plot coordinates), no metadata yet."""
    blocks = tracker.finalize()
    return StepTrace(
        blocks=blocks,
        num_tasks=tracker.num_tasks,
        task_phase=tracker.task_phase,
        task_op=tracker.task_op,
        peak=tracker.peak,
        peak_task=tracker.peak_task,
        current=tracker.current,
        phase_peak=dict(tracker.phase_peak),
        modules=tracker.modules,
        stacks=tracker.stacks,
        initial=initial,
    )


def _seed(tracker: MemoryTracker, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Blocks for what exists before the step (:func:`~hyperdryrun.trace.tensors.resident_tensors`), each with the
    stack of the line that created its parameter or buffer (:mod:`hyperdryrun.trace.sites`)."""
    sites = resident_sites(model, optimizer) if tracker.capture_stacks else {}
    for tensor, category, fqn in resident_tensors(model, optimizer):
        tracker.seed(tensor, category, fqn, sites.get(id(tensor.untyped_storage()), ()))
