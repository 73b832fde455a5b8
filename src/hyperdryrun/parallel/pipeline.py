"""Pipeline parallelism with torch-native ``torch.distributed.pipelining``, applied to the built-in decoders.

A rank builds only its own stage(s) — torchtitan's manual split: a copy of the whole model with the layers of
other stages deleted, the embedding kept on the first stage and norm + head on the last — parallelizes each stage
with TP/AC/FSDP as without pipelining, and runs the chosen schedule's ``step``. Stage shapes are given statically
(a single-process fake run cannot infer them from its neighbours), so fake send/recv complete at once and the
rank's peak follows the micro batches in flight under the schedule.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from hyperdryrun.compat import torch_pipelining
from hyperdryrun.compat.torch_pipelining import last_stage_outputs_unchecked, metadata_vote, receive_buffer
from hyperdryrun.patches import Patch, PatchSet
from hyperdryrun.trace.blocks import Category
from hyperdryrun.trace.tracker import active_tracker

if TYPE_CHECKING:
    from hyperdryrun.parallel_dims import ParallelDims


class PipelineError(RuntimeError):
    """The pipeline could not be laid out or run as configured."""


def stage_layer_counts(n_layers: int, num_stages: int, explicit: list[int] | None = None) -> list[int]:
    """Decoder layers per stage: ``explicit`` as given, else torchtitan's even split
    (``generate_llm_fqn_per_model_part``), which weighs the embedding and the head as one layer each."""
    if explicit is not None:
        return list(explicit)
    effective = n_layers + 2
    per, extra = divmod(effective, num_stages)
    if per == 0:
        raise PipelineError(f"{n_layers} layers do not split into {num_stages} pipeline stages")
    counts = [per + (1 if s < extra else 0) for s in range(num_stages)]
    counts[0] -= 1
    counts[-1] -= 1
    return counts


def stage_layer_ranges(n_layers: int, dims: ParallelDims) -> list[range]:
    """Global decoder-layer indices of every pipeline stage of ``n_layers`` decoder layers, in stage order."""
    explicit = None if dims.pp_stage_layers is None else list(dims.pp_stage_layers)
    counts = stage_layer_counts(n_layers, dims.num_stages, explicit)
    ranges, start = [], 0
    for n in counts:
        ranges.append(range(start, start + n))
        start += n
    return ranges


class PipelineStages(nn.ModuleDict):
    """The stage modules one rank holds, keyed ``stage<i>`` (one root for the engine when a rank has several)."""

    def forward(self, *args: Any) -> Any:  # pragma: no cover - stages are run by the schedule
        raise RuntimeError("pipeline stages are run by the schedule, not called as one module")


def split_stages(
    model: nn.Module, ranges: list[range], stage_ids: tuple[int, ...], cut: Callable[..., None]
) -> list[nn.Module]:
    """This rank's stage modules cut from the whole (meta) model, torchtitan's ``pipeline_module_split`` way, by
    the model family's pipeline cut (``ranges``: every stage's decoder layers, :func:`stage_layer_ranges`)."""
    last = len(ranges) - 1
    parts = []
    for k, s in enumerate(stage_ids):
        part = model if k == len(stage_ids) - 1 else copy.deepcopy(model)
        cut(part, ranges[s], embedding=s == 0, head=s == last)
        parts.append(part)
    return parts


@dataclasses.dataclass(frozen=True)
class StageShapes:
    """What a stage's example inputs, outputs and gradients are made of (one micro batch); the same for the
    built-in decoders and torchtitan's. ``head``: the last stage returns logits, else (torchtitan's chunked loss
    skips its head) the normed hidden states."""

    micro_batch_size: int
    seq_len: int
    dim: int
    vocab_size: int
    dtype: torch.dtype
    num_stages: int
    tp: int = 1
    sequence_parallel: bool = False
    loss_parallel: bool = False
    head: bool = True
    cp: int = 1
    """Context parallel degree: tokens and hidden states hold ``seq_len / cp`` positions of each row."""
    mesh: Any = None
    """The mesh of DTensor-typed stage inputs and outputs (torchtitan's TP, whose hidden states stay DTensors)."""
    hidden_placements: tuple | None = None
    """Placements on ``mesh`` of the hidden state between stages (None: a local tensor)."""
    output_placements: tuple | None = None
    """Placements on ``mesh`` of the last stage's output (None: a local tensor)."""


class StageIO(NamedTuple):
    """Example (meta) tensors of one stage, as ``PipelineStage`` takes them to skip shape inference (None: not
    given)."""

    inputs: tuple
    outputs: tuple
    output_grads: tuple | None = None
    input_grads: tuple | None = None


def stage_io(shapes: StageShapes, stage: int, tp_mesh: Any) -> StageIO:
    """Example (meta) inputs, outputs and gradients of one stage: what ``PipelineStage`` needs to skip shape
    inference. Between stages flows the hidden state as a local tensor (sequence-sharded with sequence parallel)
    or, with ``shapes.mesh``, as a DTensor; the last stage returns logits (a vocab-sharded DTensor with loss
    parallel)."""
    s, dtype = shapes, shapes.dtype
    if s.mesh is not None:
        return _dtensor_stage_io(s, stage)
    seq = s.seq_len // s.cp
    seq = seq // s.tp if s.tp > 1 and s.sequence_parallel else seq
    hidden = torch.empty(s.micro_batch_size, seq, s.dim, dtype=dtype, device="meta", requires_grad=True)
    if stage == 0:
        inputs: tuple = (_tokens(s),)
    else:
        inputs = (hidden,)
    if stage < s.num_stages - 1 or not s.head:
        return StageIO(inputs, (hidden,))
    if s.tp > 1 and s.loss_parallel:
        from torch.distributed.tensor import DTensor, Shard

        local = torch.empty(s.micro_batch_size, s.seq_len, s.vocab_size // s.tp, dtype=dtype, device="meta")
        logits = DTensor.from_local(local, tp_mesh, [Shard(2)], run_check=False).requires_grad_(True)
        grad = DTensor.from_local(local, tp_mesh, [Shard(2)], run_check=False)
        return StageIO(inputs, (logits,), (grad,), tuple(x.detach() for x in inputs))
    logits = torch.empty(
        s.micro_batch_size, s.seq_len, s.vocab_size, dtype=dtype, device="meta", requires_grad=True
    )
    return StageIO(inputs, (logits,))


def _tokens(s: StageShapes) -> torch.Tensor:
    """The first stage's input: a micro batch of token ids; under context parallel this rank's sequence shard,
    a narrow view of the whole rows as DTensor sharding (``Shard(1)``) leaves it, stride ``(seq_len, 1)``."""
    tokens = torch.empty(s.micro_batch_size, s.seq_len, dtype=torch.long, device="meta")
    return tokens if s.cp == 1 else tokens.tensor_split(s.cp, dim=1)[0]


def _dtensor_stage_io(s: StageShapes, stage: int) -> StageIO:
    """:func:`stage_io` when the hidden state between stages is a DTensor on ``s.mesh`` (torchtitan's TP): torch
    2.13's static mode then needs the gradients' metadata too, each gradient a DTensor with its tensor's placements
    (None where none flows: the token ids, the last stage's output)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    def tensor(shape: tuple[int, ...], placements: tuple | None) -> torch.Tensor:
        if placements is None:
            return torch.empty(shape, dtype=s.dtype, device="meta")
        local, _ = compute_local_shape_and_global_offset(torch.Size(shape), s.mesh, placements)
        return DTensor.from_local(
            torch.empty(local, dtype=s.dtype, device="meta"),
            s.mesh,
            placements,
            run_check=False,
            shape=torch.Size(shape),
            stride=torch.empty(shape, device="meta").stride(),
        )

    mb, seq = s.micro_batch_size, s.seq_len // s.cp
    hidden = (mb, seq, s.dim)
    if stage == 0:
        inputs: tuple = (_tokens(s),)
        input_grads: tuple = (None,)
    else:
        inputs = (tensor(hidden, s.hidden_placements).requires_grad_(True),)
        input_grads = (tensor(hidden, s.hidden_placements),)
    if stage < s.num_stages - 1:
        outputs: tuple = (tensor(hidden, s.hidden_placements).requires_grad_(True),)
        output_grads: tuple = (tensor(hidden, s.hidden_placements),)
    else:
        shape = (mb, seq, s.vocab_size) if s.head else hidden
        outputs, output_grads = (tensor(shape, s.output_placements).requires_grad_(True),), (None,)
    return StageIO(inputs, outputs, output_grads, input_grads)


def tracked_stage(
    part: nn.Module,
    stage: int,
    device: torch.device,
    group: Any,
    shapes: StageShapes,
    tp_mesh: Any = None,
    **kw: Any,
) -> Any:
    """This rank's stage ``stage`` of ``part`` as a tracked ``PipelineStage`` with static example shapes (``kw``:
    more of its keywords, e.g. torchtitan's ``get_mesh``)."""
    io = stage_io(shapes, stage, tp_mesh)
    kwargs: dict[str, Any] = {"input_args": io.inputs, "output_args": io.outputs, **kw}
    if io.output_grads is not None:
        kwargs["output_grads"] = io.output_grads
    if io.input_grads is not None:
        kwargs["input_grads"] = io.input_grads
    return _stage_class()(part, stage, shapes.num_stages, device, group=group, **kwargs)


def _stage_class() -> type:
    from torch.distributed.pipelining import PipelineStage

    class TrackedStage(torch_pipelining.SentFakeOutputsReleased, PipelineStage):
        """``PipelineStage`` that tells the tracker which micro batch it computes and labels its p2p receive
        buffers (torch 2.11 to 2.14: one per micro batch, allocated at the first step and kept) as ``Other``; its
        fake outputs are released after their send as real ones are (torch 2.15:
        :class:`~hyperdryrun.compat.torch_pipelining.SentFakeOutputsReleased`)."""

        def _label(self, mb: int) -> None:
            tracker = active_tracker()
            if tracker is not None:
                tracker.micro_batch = mb
            elif torch.autograd.profiler._is_profiler_enabled:  # hyperdryrun measure: the profiler's marker
                from hyperdryrun.ingest.profiler import mark_micro_batch

                mark_micro_batch(mb)

        def _mark_buffers(self, infos: Any) -> None:
            tracker = active_tracker()
            if tracker is None:
                return
            for recv in infos.values():
                for info in recv:
                    if (buffer := receive_buffer(info)) is not None:
                        tracker.mark(buffer, Category.OTHER)

        def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> Any:
            out = super()._prepare_forward_infra(*args, **kwargs)
            self._mark_buffers(self.args_recv_info)
            return out

        def _prepare_backward_infra(self, *args: Any, **kwargs: Any) -> Any:
            out = super()._prepare_backward_infra(*args, **kwargs)
            self._mark_buffers(self.grad_recv_info)
            return out

        def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            self._label(fwd_chunk_id)
            output = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
            if last_stage_outputs_unchecked(self):  # torch 2.12+ validates only the outputs it sends
                outputs = output if isinstance(output, tuple) else (output,)
                self._validate_stage_tensors(
                    f"Stage {self.stage_index} forward outputs", self._stage_meta.outputs, outputs
                )
            return output

        def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            self._label(bwd_chunk_id)
            return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)

        def backward_weight_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            self._label(bwd_chunk_id)
            return super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)

    return TrackedStage


def static_vote_patches() -> list[Patch]:
    """:func:`static_vote_patch` where the torch release runs the vote
    (:func:`~hyperdryrun.compat.torch_pipelining.metadata_vote`), none where it does not (torch 2.11)."""
    return [static_vote_patch()] if metadata_vote() else []


def static_vote_patch() -> Patch:
    """The P2P metadata vote answered STATIC for every stage, a stage without complete static metadata refused
    (:func:`hyperdryrun.compat.torch_pipelining.static_vote_patch`): every rank of the simulated job gives complete
    static metadata (this module does), so the vote's outcome is known."""
    return torch_pipelining.static_vote_patch(
        lambda stage: PipelineError(
            f"stage {stage.stage_index} lacks static input/output metadata; a dry run cannot infer it"
        )
    )


class DecoderPipeline:
    """The pipeline-parallel part of the built-in recipe, for every built-in decoder (Llama and MoE): split +
    parallelize (on meta), then each step runs the schedule over this rank's stages and the optimizer.

    ``dims`` and ``rank``: the layout and this rank's place in it; ``n_layers`` and ``cut``: the decoder's layers
    and its family's pipeline cut; ``shapes``: what flows between stages (one micro batch).

    >>> pipe = DecoderPipeline(dims, rank, n_layers, cut, shapes, num_micro_batches, parallelize_stage, loss_fn)
    >>> simulate(..., parallelize_fn=pipe.parallelize, step_fn=pipe.step)
    """

    def __init__(
        self,
        dims: ParallelDims,
        rank: int,
        n_layers: int,
        cut: Callable[..., None],
        shapes: StageShapes,
        num_micro_batches: int,
        parallelize_stage: Callable[[nn.Module, Any], nn.Module | None],
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        loss_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    ) -> None:
        self.dims, self.rank = dims, rank
        self.ranges = stage_layer_ranges(n_layers, dims)
        self.cut = cut
        self.shapes = shapes
        self.num_micro_batches = num_micro_batches
        self.parallelize_stage = parallelize_stage
        self.loss_fn = loss_fn
        self.loss_context = loss_context
        coords = dims.coordinates(rank)
        self.pp_rank = coords.pp
        self.stage_ids = coords.stages
        self.num_stages = dims.num_stages
        self.schedule: Any = None
        self._mesh: Any = None

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last(self) -> bool:
        return self.num_stages - 1 in self.stage_ids

    def parallelize(self, model: nn.Module, mesh: Any) -> nn.Module:
        """Cut this rank's stages from the meta model and parallelize each (TP, AC, FSDP) as the recipe does."""
        mesh_pp = mesh["pp"].get_local_rank()
        if mesh_pp != self.pp_rank:
            raise PipelineError(
                f"the mesh puts this rank on pipeline rank {mesh_pp}, the job's rank {self.rank} "
                f"is on pipeline rank {self.pp_rank}"
            )
        self._mesh = mesh
        parts = [
            self.parallelize_stage(part, mesh) or part
            for part in split_stages(model, self.ranges, self.stage_ids, self.cut)
        ]
        if len(parts) == 1:
            return parts[0]
        return PipelineStages({f"stage{s}": part for s, part in zip(self.stage_ids, parts, strict=True)})

    def _parts(self, model: nn.Module) -> list[nn.Module]:
        return list(model.values()) if isinstance(model, PipelineStages) else [model]

    def _build_schedule(self, model: nn.Module, device: torch.device) -> Any:
        from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

        cls = get_schedule_class(self.dims.pp_schedule)
        tp_mesh = self._mesh["tp"] if self.dims.tp > 1 else None
        shapes, group = self.shapes, self._mesh["pp"].get_group()
        stages = [
            tracked_stage(part, s, device, group, shapes, tp_mesh)
            for s, part in zip(self.stage_ids, self._parts(model), strict=True)
        ]
        n = self.num_micro_batches
        if issubclass(cls, PipelineScheduleSingle):
            return cls(stages[0], n_microbatches=n, loss_fn=self.loss_fn, scale_grads=True)
        return cls(stages, n_microbatches=n, loss_fn=self.loss_fn, scale_grads=True)

    def step(self, model: nn.Module, optimizer: torch.optim.Optimizer, batches: Iterator[Any]) -> None:
        """One training step: the whole local batch through the schedule, then the optimizer (torchtitan's
        ``train_step`` with pp; ``return_outputs=False`` so the last stage keeps no logits)."""
        micro = list(batches)
        tokens = torch.cat([b[0] for b in micro])
        labels = torch.cat([b[1] for b in micro])
        del micro
        tracker = active_tracker()
        if tracker is not None:  # the batch, like the engine's micro batches, is input data: "Other"
            tracker.mark(tokens, Category.OTHER)
            tracker.mark(labels, Category.OTHER)
        elif torch.autograd.profiler._is_profiler_enabled:  # hyperdryrun measure: the profiler's marker
            from hyperdryrun.ingest.profiler import mark

            mark(tokens, Category.OTHER)
            mark(labels, Category.OTHER)
        if self.schedule is None:
            device = next(iter(model.parameters())).device
            self.schedule = self._build_schedule(model, device)
        losses: list | None = [] if self.has_last else None
        target = labels if self.has_last else None
        args = (tokens,) if self.has_first else ()
        with PatchSet(static_vote_patches()), self.loss_context():
            self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
        del tokens, labels, target, losses
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def metadata(self) -> dict[str, Any]:
        """What the report says about this rank's place in the pipeline."""
        ranges = self.ranges
        return {
            "schedule": self.dims.pp_schedule,
            "pp_rank": self.pp_rank,
            "num_stages": self.num_stages,
            "stages_per_rank": self.dims.stages_per_rank,
            "stage_indices": list(self.stage_ids),
            "stage_layers": {str(s): [ranges[s].start, ranges[s].stop] for s in self.stage_ids},
            "layers_per_stage": [len(r) for r in ranges],
            "num_micro_batches": self.num_micro_batches,
            "has_embedding": self.has_first,
            "has_head": self.has_last,
        }
