"""The parallel layout of a job: its degrees, its device mesh, every rank's coordinates and the rules a layout obeys.

Plain arithmetic that imports nothing above the model registry (no torch, no config), below both the job config and
the parallelisms: the job config validates with :meth:`ParallelDims.problems` (:attr:`JobConfig.dims
<hyperdryrun.config.JobConfig.dims>` makes the dims of a job), the functions of :mod:`hyperdryrun.parallel` take
the dims and the options they use, a layout search calls it on thousands of candidates, and
:class:`~hyperdryrun.world.SimulatedWorld` builds the device mesh from :attr:`ParallelDims.mesh_shape` and
:attr:`ParallelDims.mesh_dim_names` (torchtitan's ``ParallelDims``, without the mesh it builds there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

PipelineSchedule = Literal[
    "GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"
]
"""The training schedules of torch 2.13 ``torch.distributed.pipelining`` (``get_schedule_class`` names)."""
PIPELINE_SCHEDULES: tuple[str, ...] = get_args(PipelineSchedule)
MULTI_STAGE_SCHEDULES = (
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
)
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
"""Schedules that place two stages per rank in a V (rank r holds stages r and 2*pp-1-r)."""

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""The device mesh's dimensions, outermost first: a rank's index is row-major over them."""
DEGREES = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep", "etp")


def stages_per_rank(schedule: str, virtual_stages: int | None) -> int:
    """Pipeline stages one rank holds: as given, else 2 for the multi-stage schedules and 1 for the others."""
    if virtual_stages is not None:
        return virtual_stages
    return 2 if schedule in MULTI_STAGE_SCHEDULES else 1


@dataclass(frozen=True)
class RankCoordinates:
    """Where one rank sits: its index along each mesh dimension, its expert-parallel rank (within ``dp_shard``,
    which EP splits) and the pipeline stages it holds."""

    rank: int
    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    ep: int
    stages: tuple[int, ...]


@dataclass(frozen=True)
class ParallelDims:
    """The parallel degrees of a job over ``world_size`` ranks, its pipeline layout, and what follows from them.

    ``dp_shard=None`` takes what the world leaves (``world_size / (dp_replicate*cp*tp*pp)``) when that divides;
    an invalid layout can still be built, and :meth:`problems` says what is wrong with it.

    >>> dims = ParallelDims(world_size=8, tp=2, pp=2)
    >>> dims.mesh_shape, dims.coordinates(5)
    ((2, 1, 2, 1, 2), RankCoordinates(rank=5, pp=1, dp_replicate=0, dp_shard=0, cp=0, tp=1, ep=0, stages=(1,)))
    >>> dims.problems(LLAMA_PRESETS["llama-tiny"], cfg.training)   # [] when valid
    """

    world_size: int
    dp_replicate: int = 1
    dp_shard: int | None = None
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    pp_schedule: str = "1F1B"
    pp_virtual_stages: int | None = None
    pp_stage_layers: tuple[int, ...] | None = None
    """Decoder layers of each pipeline stage, in stage order (None: torchtitan's even split)."""
    sequence_parallel: bool = True

    def __post_init__(self) -> None:
        if self.pp_stage_layers is not None and not isinstance(self.pp_stage_layers, tuple):
            object.__setattr__(self, "pp_stage_layers", tuple(self.pp_stage_layers))
        others = self.non_dp_shard_size
        if self.dp_shard is None and others > 0 and self.world_size % others == 0:
            object.__setattr__(self, "dp_shard", self.world_size // others)

    # ------------------------------------------------------------------ the mesh
    @property
    def non_dp_shard_size(self) -> int:
        """``dp_replicate * cp * tp * pp``: the ranks one ``dp_shard`` index spans."""
        return self.dp_replicate * self.cp * self.tp * self.pp

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        return MESH_DIMS

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """The mesh's size along each of :data:`MESH_DIMS` (raises if the degrees do not fill the world)."""
        problem = self._world_problem()
        if problem:
            raise ValueError(problem)
        return (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.mesh_shape[2]

    @property
    def stages_per_rank(self) -> int:
        return stages_per_rank(self.pp_schedule, self.pp_virtual_stages)

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    def degrees(self) -> dict[str, int | None]:
        """Every parallel degree by name, mesh dimensions first (the report's ``metadata.parallel``)."""
        return {d: getattr(self, d) for d in DEGREES}

    def stage_indices(self, pp_rank: int) -> tuple[int, ...]:
        """The stages pipeline rank ``pp_rank`` holds: looped (r, r+pp, ...) or, for V schedules, (r, 2*pp-1-r)."""
        if self.pp_schedule in V_SCHEDULES:
            return (pp_rank, self.num_stages - 1 - pp_rank)
        return tuple(pp_rank + k * self.pp for k in range(self.stages_per_rank))

    def coordinates(self, rank: int) -> RankCoordinates:
        """Rank ``rank``'s place in the mesh (row-major over :data:`MESH_DIMS`, as ``init_device_mesh`` lays it)."""
        shape = self.mesh_shape
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} must satisfy 0 <= rank < world_size={self.world_size}")
        index, rest = [], rank
        for size in reversed(shape):
            rest, i = divmod(rest, size)
            index.append(i)
        pp, dp_replicate, dp_shard, cp, tp = reversed(index)
        # EP unflattens dp_shard into (dp_shard // ep, ep): the ep index is the inner part.
        return RankCoordinates(
            rank, pp, dp_replicate, dp_shard, cp, tp, ep=dp_shard % self.ep, stages=self.stage_indices(pp)
        )

    # ------------------------------------------------------------------ the rules
    def _world_problem(self) -> str | None:
        bad = [d for d in DEGREES if d != "dp_shard" and getattr(self, d) < 1]
        if bad or (self.dp_shard is not None and self.dp_shard < 1):
            name = bad[0] if bad else "dp_shard"
            return f"parallel.{name}={getattr(self, name)} must be >= 1"
        others = self.non_dp_shard_size
        if self.dp_shard is None:
            return f"world.world_size={self.world_size} is not divisible by dp_replicate*cp*tp*pp={others}"
        product = others * self.dp_shard
        if product != self.world_size:
            return (
                f"world.world_size={self.world_size} != dp_replicate*dp_shard*cp*tp*pp = "
                f"{self.dp_replicate}*{self.dp_shard}*{self.cp}*{self.tp}*{self.pp} = {product}"
            )
        return None

    def problems(
        self, model_args: Any, training: Any, target_device: str = "cuda", model_name: str | None = None
    ) -> list[str]:
        """Why this layout cannot run ``model_args`` (a preset's shapes) with ``training`` (seq_len,
        num_micro_batches, dtype, param_dtype) on ``target_device``: one line per problem, in the order the job
        config reports them (it raises the first); empty when the layout is valid. Never raises."""
        from hyperdryrun.models.registry import family_of_args  # the models are torch code: only when checked

        m, t = model_args, training
        family = family_of_args(m)
        out: list[str] = []
        world = self._world_problem()
        if world:
            out.append(world)
            if self.non_dp_shard_size < 1:
                return out
        if m.dim % m.n_heads:
            out.append(f"model.dim={m.dim} is not divisible by model.n_heads={m.n_heads}")
        if m.n_heads % m.n_kv_heads:
            out.append(f"model.n_heads={m.n_heads} is not divisible by model.n_kv_heads={m.n_kv_heads}")
        for field in ("n_heads", "n_kv_heads", "ffn_dim", "vocab_size"):
            if getattr(m, field) % self.tp:
                out.append(f"model.{field}={getattr(m, field)} is not divisible by parallel.tp={self.tp}")
        if self.tp > 1 and self.sequence_parallel and t.seq_len % self.tp:
            out.append(
                f"training.seq_len={t.seq_len} is not divisible by parallel.tp={self.tp} "
                "(sequence parallel shards the sequence)"
            )
        if self.pp > 1:
            out.extend(self._pipeline_problems(m, t.num_micro_batches))
        if self.cp > 1:
            out.extend(self._context_parallel_problems(m, t, target_device))
        if family.is_moe:
            out.extend(self._moe_problems(m))
        else:
            name = model_name or family.name
            for degree in ("ep", "etp"):
                if getattr(self, degree) > 1:
                    out.append(
                        f"parallel.{degree}={getattr(self, degree)} needs an MoE model, {name!r} is dense"
                    )
        return out

    def _pipeline_problems(self, m: Any, n_mb: int) -> list[str]:
        """The pipeline layout: schedule vs stages per rank, the layer split, micro batches per schedule."""
        out, schedule, v = [], self.pp_schedule, self.stages_per_rank
        if schedule in V_SCHEDULES and v != 2:
            out.append(
                f"parallel.pp_virtual_stages={v} must be 2 for parallel.pp_schedule={schedule} "
                "(a V schedule holds exactly two stages per rank)"
            )
        if schedule not in MULTI_STAGE_SCHEDULES and v != 1:
            out.append(
                f"parallel.pp_virtual_stages={v} needs a multi-stage schedule "
                f"({', '.join(MULTI_STAGE_SCHEDULES)}); parallel.pp_schedule={schedule} runs one stage per rank"
            )
        stages = self.num_stages
        if m.tie_embeddings:
            out.append(
                "model.tie_embeddings=True cannot be used with parallel.pp > 1 "
                "(the embedding and the output head live on different pipeline stages)"
            )
        if self.pp_stage_layers is not None:
            layers = list(self.pp_stage_layers)
            if len(layers) != stages:
                out.append(
                    f"parallel.pp_stage_layers has {len(layers)} entries, needs one per pipeline stage: "
                    f"pp*stages_per_rank = {self.pp}*{v} = {stages}"
                )
            if sum(layers) != m.n_layers:
                out.append(
                    f"parallel.pp_stage_layers={layers} sums to {sum(layers)}, model.n_layers={m.n_layers}"
                )
            empty = [i for i in range(1, stages - 1) if layers[i] == 0] if len(layers) == stages else []
            if empty:
                out.append(
                    f"parallel.pp_stage_layers={layers}: middle stage {empty[0]} has no layers "
                    "(only the first and last stages, which hold the embedding and the head, may have none)"
                )
        elif m.n_layers + 2 < stages:
            out.append(
                f"model.n_layers={m.n_layers} does not split into {stages} pipeline stages (the even split counts "
                f"the embedding and the head as one layer each: needs n_layers + 2 >= {stages})"
            )
        if schedule in ("1F1B", "DualPipeV") and n_mb < stages:
            out.append(
                f"training.num_micro_batches={n_mb} must be >= the {stages} pipeline stages "
                f"for parallel.pp_schedule={schedule}"
            )
        if schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
            rounds = max(1, n_mb // self.pp)
            if n_mb % rounds:
                out.append(
                    f"training.num_micro_batches={n_mb} must be a multiple of max(1, num_micro_batches // pp) "
                    f"= {rounds} for parallel.pp_schedule={schedule}"
                )
        return out

    def _context_parallel_problems(self, m: Any, t: Any, target_device: str) -> list[str]:
        """Context parallel: the head-tail load-balanced sequence split and what it can be combined with."""
        out, cp, tp, seq = [], self.cp, self.tp, t.seq_len
        if seq % (2 * cp):
            out.append(
                f"training.seq_len={seq} is not divisible by 2*parallel.cp={2 * cp} (context parallel's "
                "load-balanced layout splits the sequence into 2*cp chunks, two per rank)"
            )
        if tp > 1 and self.sequence_parallel and (seq // cp) % tp:
            out.append(
                f"training.seq_len/parallel.cp={seq // cp} is not divisible by parallel.tp={tp} "
                "(sequence parallel shards each context-parallel shard of the sequence)"
            )
        if self.pp > 1:
            out.append(
                f"parallel.cp={cp} with parallel.pp={self.pp} is not supported yet "
                "(this recipe's pipeline step does not run its stages under the context-parallel context)"
            )
        if target_device != "cuda":
            out.append(
                f"parallel.cp={cp} needs target_device=cuda, got {target_device!r} (torch 2.13 ring attention "
                "only dispatches the CUDA flash, memory-efficient and cuDNN SDPA kernels)"
            )
        compute = t.param_dtype or t.dtype
        if compute == "fp32" and m.n_kv_heads != m.n_heads:
            out.append(
                f"parallel.cp={cp} with fp32 compute and grouped-query attention (model.n_kv_heads={m.n_kv_heads} "
                f"< n_heads={m.n_heads}) is not supported: CUDA runs that SDPA with the math kernel (flash and cuDNN "
                "need bf16/fp16, memory-efficient has no GQA in torch 2.13), which ring attention does not handle"
            )
        if compute == "fp32" and (seq // (2 * cp)) % 32:
            out.append(
                f"training.seq_len={seq} with parallel.cp={cp} and fp32 compute: the memory-efficient SDPA kernel "
                "pads its logsumexp to a multiple of 32 rows, so ring attention's half-shard merge needs "
                f"seq_len/(2*cp)={seq // (2 * cp)} to be a multiple of 32"
            )
        return out

    def _moe_problems(self, m: Any) -> list[str]:
        """Expert parallel and expert TP against the MoE model's shapes (torchtitan's layouts)."""
        out, tp, ep, etp = [], self.tp, self.ep, self.etp
        if m.top_k > m.num_experts:
            out.append(f"model.top_k={m.top_k} exceeds model.num_experts={m.num_experts}")
        if m.n_dense_layers > m.n_layers:
            out.append(f"model.n_dense_layers={m.n_dense_layers} exceeds model.n_layers={m.n_layers}")
        if self.cp > 1:
            out.append(
                f"parallel.cp={self.cp} with an MoE model is not supported yet (MoE runs with FSDP/TP/EP/PP)"
            )
        # etp is 1 or tp; with ep > 1, etp = tp shards each local expert over tp (ep x etp), etp = 1 lends the tp
        # ranks to EP, which this recipe does not build (EP splits dp_shard only).
        if etp > 1 and tp == 1:
            out.append(f"parallel.etp={etp} needs parallel.tp={etp} (expert TP shards experts over tp)")
        if etp not in (1, tp):
            out.append(f"parallel.etp={etp} must be 1 or parallel.tp={tp} (torchtitan's layouts)")
        if tp > 1 and ep > 1 and etp == 1:
            out.append(
                f"parallel.etp=1 with parallel.tp={tp} and parallel.ep={ep} is not supported (EP borrowing the "
                f"tp ranks is not built; use parallel.etp={tp})"
            )
        if tp > 1:
            shared = m.num_shared_experts * m.moe_ffn_dim
            for name, value in (("moe_ffn_dim", m.moe_ffn_dim), ("num_shared_experts*moe_ffn_dim", shared)):
                if value % tp:
                    out.append(f"model.{name}={value} is not divisible by parallel.tp={tp}")
        if self.dp_shard is not None and self.dp_shard % ep:
            out.append(f"parallel.ep={ep} must divide parallel.dp_shard={self.dp_shard} (EP splits dp_shard)")
        if m.num_experts % ep:
            out.append(f"parallel.ep={ep} must divide model.num_experts={m.num_experts}")
        return out
