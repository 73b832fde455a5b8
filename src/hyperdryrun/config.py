"""The validated job description: the one place where defaults live.

Every consumer (CLI, YAML file, Python API) builds a :class:`JobConfig`; a bad value raises
:class:`ConfigError` whose message is one line naming the field and the value.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from hyperdryrun.bounds import (  # noqa: F401  (MAX_* re-exported)
    GIB,
    MAX_GIB,
    MAX_HEADS,
    MAX_LAYERS,
    MAX_MICRO_BATCHES,
    MAX_RANKS,
    MAX_TOKENS,
    MAX_VOCAB,
    MAX_WIDTH,
    TENSOR_BYTES,
    shown_number,
)
from hyperdryrun.ingest.files import (
    CONFIG_BYTES,
    NESTING,
    YAML_NODES,
    IngestError,
    bounded_int,
    read_bytes,
    shown,
)
from hyperdryrun.models import hf
from hyperdryrun.models.registry import ModelFamily, family_of, preset_names
from hyperdryrun.parallel_dims import ParallelDims, PipelineSchedule, stages_per_rank
from hyperdryrun.world.routing import USES as ROUTING_USES
from hyperdryrun.world.routing import RoutingSpec
from hyperdryrun.world.runtime import CudaRuntime
from hyperdryrun.world.value_rules import ValueRule, ValueRules

Dtype = Literal["bf16", "fp32"]


class ConfigError(ValueError):
    """A one-line, user-facing configuration error."""


class _Strict(BaseModel):
    # strict: YAML's `seq_len: true` or `"64"` is a mistake, not 1 or 64 (an int is still a float);
    # allow_inf_nan=False: "inf" GiB of device memory or a NaN learning rate is a typo, not a value.
    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True, allow_inf_nan=False)


# The upper bounds of every number live in hyperdryrun.bounds (the one place; re-exported here, where they were):
# the shape fields' are generous for any published model and small enough that the products a step forms (tokens x
# width, the fp32 logits) fit a tensor (int64 elements and bytes); see JobConfig._check_shapes.


class ModelConfig(_Strict):
    """A preset plus optional overrides of every shape field."""

    name: str = "llama3-8b"
    dim: int | None = Field(None, gt=0, le=MAX_WIDTH)
    n_layers: int | None = Field(None, gt=0, le=MAX_LAYERS)
    n_heads: int | None = Field(None, gt=0, le=MAX_HEADS)
    n_kv_heads: int | None = Field(None, gt=0, le=MAX_HEADS)
    ffn_dim: int | None = Field(None, gt=0, le=MAX_WIDTH)
    vocab_size: int | None = Field(None, gt=0, le=MAX_VOCAB)
    norm_eps: float | None = Field(None, gt=0)
    rope_theta: float | None = Field(None, gt=0)
    tie_embeddings: bool | None = None
    # --- the preset's torchtitan choices (None: the preset's, torchtitan 0.3.0's) ---
    norm: Literal["fused", "fp32-unfused"] | None = None
    """RMSNorm: ``fused`` (nn.RMSNorm, torchtitan 0.3.0) or ``fp32-unfused`` (torchtitan's 2024 releases)."""
    fuse_qkv: bool | None = None
    """One fused q/k/v projection (torchtitan 0.3.0) or three (MLA has neither)."""
    rope: Literal["per-layer", "shared"] | None = None
    """A RoPE table per layer (torchtitan 0.3.0) or one shared by all layers (its 2024 releases)."""
    moe_impl: Literal["torchtitan", "torchtitan-2024"] | None = None
    """MoE router and token reordering: torchtitan 0.3.0's (load-balancing buffers, scores applied after the
    experts) or its 2024 releases' (scores applied before)."""
    # --- MoE models (presets of hyperdryrun.models.moe) ---
    num_experts: int | None = Field(None, gt=0, le=MAX_HEADS)
    top_k: int | None = Field(None, gt=0, le=MAX_HEADS)
    moe_ffn_dim: int | None = Field(None, gt=0, le=MAX_WIDTH)
    num_shared_experts: int | None = Field(None, ge=0, le=MAX_HEADS)
    n_dense_layers: int | None = Field(None, ge=0, le=MAX_LAYERS)
    # --- Hugging Face models (name "hf:NAME", hyperdryrun.models.hf) ---
    attn_implementation: Literal["sdpa", "eager", "flex_attention"] | None = None
    """HF attention kernel (config._attn_implementation); None: sdpa."""
    experts_implementation: Literal["grouped_mm", "eager", "batched_mm"] | None = None
    """HF MoE experts kernel; None: transformers' default (grouped_mm)."""

    @field_validator("name")
    @classmethod
    def _known_preset(cls, v: str) -> str:
        if hf.is_hf_name(v):
            hf.transformers_module()
            hf.read_config(v)
            return v
        names = preset_names()
        if v not in names:
            raise ValueError(f"unknown model {v!r}; choose one of {', '.join(names)}")
        return v

    @model_validator(mode="after")
    def _hf_fields_need_hf(self) -> ModelConfig:
        if not hf.is_hf_name(self.name):
            for f in ("attn_implementation", "experts_implementation"):
                if getattr(self, f) is not None:
                    raise ValueError(
                        f"model.{f}={getattr(self, f)} applies to Hugging Face models (hf:NAME) only, "
                        f"{self.name!r} is a built-in preset"
                    )
        return self

    @model_validator(mode="after")
    def _preset_fields_need_builtin(self) -> ModelConfig:
        if hf.is_hf_name(self.name):
            for f in BUILTIN_FIELDS:
                if getattr(self, f) is not None:
                    raise ValueError(
                        f"model.{f}={getattr(self, f)} applies to built-in presets, {self.name!r} is a Hugging Face "
                        "model (its structure is its config's)"
                    )
        return self

    @model_validator(mode="after")
    def _moe_fields_need_moe(self) -> ModelConfig:
        if not self.is_moe:
            for f in MOE_FIELDS:
                if getattr(self, f) is not None:
                    raise ValueError(
                        f"model.{f}={getattr(self, f)} needs an MoE model, {self.name!r} is dense"
                    )
        elif self.fuse_qkv is not None and not hf.is_hf_name(self.name):
            if self.family.presets[self.name].attention == "mla":
                raise ValueError(
                    f"model.fuse_qkv={self.fuse_qkv} applies to grouped-query attention, {self.name!r} has MLA "
                    "(its own low-rank projections)"
                )
        return self

    @property
    def family(self) -> ModelFamily:
        """The registered model family of the preset (:mod:`hyperdryrun.models.registry`)."""
        return family_of(self.name)

    @property
    def is_moe(self) -> bool:
        if hf.is_hf_name(self.name):
            return self.args().is_moe
        return self.family.is_moe

    def args(self) -> Any:
        """The preset's shapes with this config's overrides (an instance of the family's argument class)."""
        overrides = {k: v for k, v in self.model_dump(exclude={"name"}).items() if v is not None}
        if hf.is_hf_name(self.name):
            return hf.load_args(self.name).replace(**overrides)
        return self.family.presets[self.name].replace(**overrides)


MOE_FIELDS = ("num_experts", "top_k", "moe_ffn_dim", "num_shared_experts", "n_dense_layers", "moe_impl")
BUILTIN_FIELDS = ("norm", "fuse_qkv", "rope", "moe_impl")


class ParallelConfig(_Strict):
    """Parallel degrees and options as given; ``dp_shard=None`` takes what the world leaves. The layout they make,
    and its rules, is :attr:`JobConfig.dims` (:class:`~hyperdryrun.parallel_dims.ParallelDims`)."""

    dp_replicate: int = Field(1, gt=0, le=MAX_RANKS)
    dp_shard: int | None = Field(None, gt=0, le=MAX_RANKS)
    tp: int = Field(1, gt=0, le=MAX_RANKS)
    cp: int = Field(1, gt=0, le=MAX_RANKS)
    pp: int = Field(1, gt=0, le=MAX_RANKS)
    ep: int = Field(1, gt=0, le=MAX_RANKS)
    etp: int = Field(1, gt=0, le=MAX_RANKS)
    reshard_after_forward: bool = True
    sequence_parallel: bool = True
    loss_parallel: bool = True
    pp_schedule: PipelineSchedule = "1F1B"
    """torch.distributed.pipelining schedule used when pp > 1."""
    pp_virtual_stages: int | None = Field(None, gt=0, le=MAX_LAYERS)
    """Pipeline stages per rank: 1 for single-stage schedules, 2 by default for multi-stage ones."""
    pp_stage_layers: list[int] | None = None
    """Decoder layers of each pipeline stage, in stage order (default: torchtitan's even split)."""
    cp_rotate_method: Literal["allgather", "alltoall"] = "allgather"
    """How ring attention passes K/V between CP ranks (torch 2.13 ``set_rotate_method``; torchtitan's default)."""
    fsdp_wrap: Literal["torchtitan", "torchtitan-2024"] = "torchtitan"
    """FSDP2 units: ``torchtitan`` (0.3.0: embedding, each block, norm + head kept unsharded after forward) or
    ``torchtitan-2024`` (each block, the last one kept unsharded; the root holds embedding, norm and head)."""

    @field_validator("pp_stage_layers")
    @classmethod
    def _non_negative_layers(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (not v or any(n < 0 or n > MAX_LAYERS for n in v) or len(v) > MAX_LAYERS):
            raise ValueError(
                f"must be a non-empty list of layer counts from 0 to {MAX_LAYERS}, got {v if len(v) <= 20 else f'{len(v)} counts'}"
            )
        return v

    @property
    def pp_stages_per_rank(self) -> int:
        return stages_per_rank(self.pp_schedule, self.pp_virtual_stages)

    @property
    def pp_num_stages(self) -> int:
        return self.pp * self.pp_stages_per_rank


class TrainingConfig(_Strict):
    dtype: Dtype = "fp32"
    """Dtype of the stored (master) parameters, their gradients and optimizer states."""
    param_dtype: Dtype | None = "bf16"
    """FSDP2 MixedPrecisionPolicy.param_dtype: the dtype of the unsharded parameters used in compute."""
    reduce_dtype: Dtype | None = "fp32"
    """FSDP2 MixedPrecisionPolicy.reduce_dtype: the dtype of gradient reduce-scatter."""
    seq_len: int = Field(2048, gt=0, le=MAX_TOKENS)
    micro_batch_size: int = Field(1, gt=0, le=MAX_TOKENS)
    num_micro_batches: int = Field(1, gt=0, le=MAX_MICRO_BATCHES)
    """Gradient accumulation: micro batches per optimizer step."""
    ac: Literal["none", "full", "selective"] = "none"
    ac_selective: str = "op"
    """``op`` (torchtitan 0.3.0: save compute-heavy ops' outputs but recompute every second matmul),
    ``op-save-all-matmuls`` (save every matmul and attention output) or ``k`` (checkpoint every k-th layer)."""
    loss: Literal["model", "builtin", "chunked"] = "model"
    """``model``: the model's own loss (Hugging Face models: ``labels=`` through their ``loss_function``; the
    built-in presets: the built-in one); ``builtin``: the fp32 cross entropy of the logits (torchtitan's; the old
    name ``cross-entropy`` is read as it); ``chunked``: torchtitan's ChunkedLossWrapper, the output head and the
    loss run per sequence chunk."""
    loss_chunks: int | None = Field(None, gt=0, le=MAX_TOKENS)
    """Sequence chunks of the chunked loss (default :data:`DEFAULT_LOSS_CHUNKS`, torchtitan's)."""
    compile: bool = False
    """Compile each transformer block with torch.compile (Inductor), as torchtitan's ``--compile.enable`` does."""
    optimizer: Literal["AdamW", "Adam", "SGD"] = "AdamW"
    optimizer_impl: Literal["foreach", "fused", "for-loop"] = "foreach"
    lr: float = Field(3e-4, gt=0)
    momentum: float = Field(0.9, ge=0)
    weight_decay: float = Field(0.1, ge=0)

    @field_validator("ac_selective")
    @classmethod
    def _ac_option(cls, v: str) -> str:
        if v not in AC_SELECTIVE_OPS and not (v.isdigit() and int(v) > 0):
            raise ValueError(
                f"must be {', '.join(map(repr, AC_SELECTIVE_OPS))} or a positive layer interval, got {v!r}"
            )
        return v

    @field_validator("loss", mode="before")
    @classmethod
    def _old_loss_name(cls, v: Any) -> Any:
        return "builtin" if v == "cross-entropy" else v

    @model_validator(mode="after")
    def _loss_chunks_need_chunked(self) -> TrainingConfig:
        if self.loss_chunks is not None and self.loss != "chunked":
            raise ValueError(
                f"training.loss_chunks={self.loss_chunks} has no effect without training.loss='chunked'"
            )
        if self.loss == "chunked" and self.seq_len % self.chunks:
            raise ValueError(
                f"training.loss_chunks={self.chunks} must divide training.seq_len={self.seq_len} (equal chunks)"
            )
        return self

    @property
    def chunks(self) -> int:
        """Sequence chunks of the chunked loss."""
        return DEFAULT_LOSS_CHUNKS if self.loss_chunks is None else self.loss_chunks


AC_SELECTIVE_OPS = ("op", "op-save-all-matmuls")
DEFAULT_LOSS_CHUNKS = 8
"""torchtitan 0.3.0's ``ChunkedLossWrapper.Config.num_chunks``."""


class ValuesConfig(RoutingSpec):
    """Data-dependent values (hyperdryrun.world.values): the MoE routing (:class:`RoutingSpec`, the one option of
    every front door) and extra value rules."""

    rules: list[ValueRule] = []
    """Rules tried first (module/op patterns); the routing applies to every MoE layer they leave."""

    def value_rules(self) -> ValueRules:
        """The rules a run uses: the explicit ones first, then the routing's for every MoE layer."""
        return ValueRules([*self.rules, *self.routing_rules()])


class RankConfig(_Strict):
    world_size: int = Field(1, ge=1, le=MAX_RANKS)
    rank: int = Field(0, ge=0, le=MAX_RANKS)
    local_rank: int | None = Field(None, ge=0, le=MAX_RANKS)

    @model_validator(mode="after")
    def _rank_in_world(self) -> RankConfig:
        if self.rank >= self.world_size:
            raise ValueError(f"rank={self.rank} must be < world_size={self.world_size}")
        if self.local_rank is not None and self.local_rank >= self.world_size:
            raise ValueError(
                f"local_rank={self.local_rank} must be < world_size={self.world_size} (a rank on one node of "
                "the world)"
            )
        return self


class JobConfig(_Strict):
    model: ModelConfig = ModelConfig()
    parallel: ParallelConfig = ParallelConfig()
    training: TrainingConfig = TrainingConfig()
    world: RankConfig = RankConfig()
    values: ValuesConfig = ValuesConfig()
    target_device: Literal["cuda", "cpu"] = "cuda"
    cuda: CudaRuntime = CudaRuntime()
    """A CUDA target's GPU, caching-allocator settings and runtime costs (defaults in hyperdryrun.world.runtime)."""
    device_memory_gib: float | None = Field(None, gt=0, le=MAX_GIB)
    margin_gib: float | None = Field(None, ge=0, le=MAX_GIB)
    """The verdict's margin in GiB: "at risk" within it under the capacity (hyperdryrun.allocator.verdict)."""
    margin_pct: float | None = Field(None, ge=0, le=100)
    """The verdict's margin in percent of the capacity; neither given: the model's measured device error."""
    output_dir: str = Field("hyperdryrun_out", min_length=1)
    live_set_limit: int = Field(50, gt=0, le=1_000_000)

    @field_validator("output_dir")
    @classmethod
    def _a_path(cls, v: str) -> str:
        if "\0" in v:
            raise ValueError(f"must be a path without NUL bytes, got {v!r}")
        return v

    @property
    def margin(self) -> Any:
        """The capacity verdict's :class:`~hyperdryrun.allocator.verdict.Margin`."""
        from hyperdryrun.allocator.verdict import Margin

        return Margin(self.margin_gib, self.margin_pct)

    @property
    def target(self) -> Any:
        """The resolved :class:`~hyperdryrun.world.target.DeviceTarget`: device, CUDA runtime (GPU preset,
        allocator settings), capacity and margin, the one place they are read from."""
        from hyperdryrun.world.target import DeviceTarget

        try:
            return DeviceTarget(self.target_device, self.cuda, self.device_memory_gib, self.margin)
        except ValueError as err:  # a capacity whose bytes overflow: one line naming the field
            raise ConfigError(str(err)) from None

    @model_validator(mode="after")
    def _one_margin(self) -> JobConfig:
        if self.margin_gib is not None and self.margin_pct is not None:
            raise ValueError(
                f"margin_gib={self.margin_gib:g} and margin_pct={self.margin_pct:g}: give one margin "
                "(--margin-gib or --margin-pct), not both"
            )
        return self

    @property
    def capacity_bytes(self) -> int | None:
        """The device's capacity the verdict judges against: ``device_memory_gib``, else the named GPU's (a CUDA
        target), else none."""
        if self.device_memory_gib is not None:
            return int(round(self.device_memory_gib * GIB))
        if self.target_device == "cuda" and self.cuda.gpu is not None:
            from hyperdryrun.world.gpus import gpu_preset

            return gpu_preset(self.cuda.gpu).capacity_bytes
        return None

    @model_validator(mode="after")
    def _capacity_fields(self) -> JobConfig:
        """A margin needs a capacity to be under (and a ``gib`` one is less than it); the CUDA target's fields
        (``--gpu``, ``--alloc-conf``, ...) need a CUDA target: otherwise they would be silently ignored."""
        if self.target_device != "cuda":
            for name, field in type(self.cuda).model_fields.items():
                value = getattr(self.cuda, name)
                if value != field.default:
                    raise ValueError(
                        f"cuda.{name}={value!r} has no effect with target_device={self.target_device!r} (it "
                        "describes a CUDA target)"
                    )
        capacity = self.capacity_bytes
        for name in ("margin_gib", "margin_pct"):
            if capacity is None and getattr(self, name) is not None:
                raise ValueError(
                    f"{name}={getattr(self, name):g} has no effect without a capacity (give --gpu or "
                    "--device-memory-gib)"
                )
        if capacity is not None:
            self.margin.bytes_for(capacity)  # a ValueError for a margin not under the capacity
        return self

    @model_validator(mode="after")
    def _layout(self) -> JobConfig:
        p, m, t = self.parallel, self.model.args(), self.training
        dims = self.dims
        problems = dims.problems(m, t, self.target_device, model_name=self.model.name)
        if problems:
            raise ValueError(problems[0])
        object.__setattr__(p, "dp_shard", dims.dp_shard)
        mixed = t.param_dtype not in (None, t.dtype) or t.reduce_dtype not in (None, t.dtype)
        fsdp_off = dims.dp_shard * p.dp_replicate * p.cp == 1 and not mixed
        if hf.is_hf_name(self.model.name) and (hf_problems := hf.layout_problems(m, p, fsdp_off)):
            raise ValueError(hf_problems[0])
        self._check_shapes(m)
        if self.model.is_moe:
            self._check_routing(m)
        self._check_effective()
        self._check_preset_choices(fsdp_off)
        if t.ac == "selective" and t.ac_selective.isdigit() and int(t.ac_selective) > m.n_layers:
            raise ValueError(f"training.ac_selective={t.ac_selective} exceeds model.n_layers={m.n_layers}")
        return self

    def _check_shapes(self, m: Any) -> None:
        """Shapes the step can form: RoPE rotates pairs (an even rotated head dim), and the widest activation of a
        micro batch (tokens x width, at 8 bytes an element at most) fits one tensor."""
        if getattr(m, "attention", "gqa") == "mla":
            rope, field = m.qk_rope_head_dim, "model.qk_rope_head_dim"
        elif getattr(m, "head_dim_override", None):
            rope, field = m.head_dim, f"the head dim of {self.model.name}"
        else:
            rope, field = m.head_dim, "model.dim / model.n_heads"
        if rope % 2:
            raise ValueError(f"{field} = {rope} must be even: RoPE rotates pairs of the head dimension")
        tokens = self.training.micro_batch_size * self.training.seq_len
        for name in ("dim", "ffn_dim", "vocab_size", "moe_ffn_dim"):
            width = getattr(m, name, 0)
            if tokens * width * 8 > TENSOR_BYTES:
                raise ValueError(
                    f"training.micro_batch_size * training.seq_len * model.{name} = {tokens} * {width} elements "
                    f"do not fit one tensor (at most {TENSOR_BYTES // 8} 8-byte elements)"
                )

    def _ignored(self) -> dict[tuple[str, str], str]:
        """The fields this configuration ignores, each with the reason: ``(section, field) -> why``."""
        t, v = self.training, self.values
        out: dict[tuple[str, str], str] = {}
        if t.ac != "selective":
            out["training", "ac_selective"] = (
                f"has no effect with training.ac={t.ac!r} (give training.ac: selective / --ac selective, or drop it)"
            )
        if not self.model.is_moe:
            for f in (*ROUTING_USES, "routing"):
                out["values", f] = f"has no effect: {self.model.name!r} is a dense model (no experts)"
            return out
        for name, routings in ROUTING_USES.items():
            if v.routing not in routings:
                out["values", name] = (
                    f"has no effect with values.routing={v.routing!r} (it is for values.routing: "
                    f"{' or '.join(routings)} / --routing {routings[0]})"
                )
        return out

    def _check_effective(self) -> None:
        """A field the rest of the configuration ignores is an error, not silence, when it was given (pydantic's
        ``model_fields_set``: ``--ac none --ac-selective op`` too, though ``op`` is the default) or differs from its
        default. A dump leaves the ignored fields that were not given out (:meth:`_without_ignored`), so that a
        config rebuilt from its own dump (the runner's workers do) validates alike."""
        for (section, name), why in self._ignored().items():
            part = getattr(self, section)
            value = getattr(part, name)
            if name in part.model_fields_set or value != _default(type(part), name):
                raise ValueError(f"{section}.{name}={value!r} {why}")

    @model_serializer(mode="wrap")
    def _without_ignored(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """The dump, less the ignored fields that were not given (see :meth:`_check_effective`)."""
        data = handler(self)
        try:
            ignored = self._ignored()
        except Exception:  # a config being built (validate_assignment) may not be whole yet
            return data
        for section, name in ignored:
            part = data.get(section)
            if isinstance(part, dict) and name not in getattr(self, section).model_fields_set:
                part.pop(name, None)
        return data

    def _check_preset_choices(self, fsdp_off: bool) -> None:
        """The torchtitan choices of the built-in presets (chunked loss, FSDP units) where the layout uses them."""
        t, p = self.training, self.parallel
        if t.loss == "chunked" and (p.pp > 1 or p.cp > 1):
            raise ValueError(
                f"training.loss='chunked' is not built with parallel.pp={p.pp} / parallel.cp={p.cp} (needs 1)"
            )
        if t.loss == "chunked" and hf.is_hf_name(self.model.name):
            raise ValueError(
                f"training.loss='chunked' applies to built-in presets, {self.model.name!r} is not one"
            )
        if t.loss == "chunked" and not fsdp_off and p.fsdp_wrap != "torchtitan":
            # The chunked loss runs the head per chunk: it needs the head as its own FSDP2 unit.
            raise ValueError(
                f"training.loss='chunked' needs norm + head as their own FSDP2 unit (parallel.fsdp_wrap: "
                f"torchtitan), not parallel.fsdp_wrap={p.fsdp_wrap!r}"
            )
        if p.fsdp_wrap != _default(ParallelConfig, "fsdp_wrap") and hf.is_hf_name(self.model.name):
            raise ValueError(
                f"parallel.fsdp_wrap={p.fsdp_wrap!r} applies to built-in presets, {self.model.name!r} is a "
                "Hugging Face model (FSDP2 on each decoder layer, the last kept unsharded)"
            )
        if p.fsdp_wrap != _default(ParallelConfig, "fsdp_wrap") and fsdp_off:
            raise ValueError(
                f"parallel.fsdp_wrap={p.fsdp_wrap!r} has no effect: FSDP2 is not applied "
                "(no data sharding, replication, CP or mixed precision)"
            )

    def _check_routing(self, m: Any) -> None:
        """The MoE routing scenario against the model's experts and one micro batch's tokens."""
        v = self.values
        tokens = self.training.micro_batch_size * self.training.seq_len
        if v.hot_expert >= m.num_experts:
            raise ValueError(f"values.hot_expert={v.hot_expert} must be < model.num_experts={m.num_experts}")
        if v.routing == "explicit":
            c = v.counts or []
            if len(c) != m.num_experts or sum(c) != tokens * m.top_k or max(c) > tokens:
                raise ValueError(
                    f"values.counts={c} must have model.num_experts={m.num_experts} entries summing to "
                    f"micro_batch_size*seq_len*top_k = {tokens * m.top_k}, each <= {tokens} tokens"
                )
        if v.routing == "profile" and v.routing_from:
            from hyperdryrun.world.routing import load_routing_file

            for key, load in load_routing_file(v.routing_from).items():
                if len(load) != m.num_experts:
                    where = f"layer {key}" if isinstance(key, int) else repr(key)
                    raise ValueError(
                        f"values.routing_from={v.routing_from!r}: {where} has {len(load)} loads, but "
                        f"model.num_experts={m.num_experts} (one per expert)"
                    )
                dense = getattr(m, "n_dense_layers", None)
                if isinstance(key, int) and dense is not None and not dense <= key < m.n_layers:
                    raise ValueError(
                        f"values.routing_from={v.routing_from!r}: layer {key} has no routed experts (the MoE "
                        f"layers are {dense}..{m.n_layers - 1})"
                    )

    @property
    def dims(self) -> ParallelDims:
        """The job's parallel layout: degrees, mesh, every rank's coordinates (:mod:`hyperdryrun.parallel_dims`),
        from its ``parallel`` section and ``world.world_size``."""
        p = self.parallel
        return ParallelDims(
            world_size=self.world.world_size,
            dp_replicate=p.dp_replicate,
            dp_shard=p.dp_shard,
            cp=p.cp,
            tp=p.tp,
            pp=p.pp,
            ep=p.ep,
            etp=p.etp,
            pp_schedule=p.pp_schedule,
            pp_virtual_stages=p.pp_virtual_stages,
            pp_stage_layers=None if p.pp_stage_layers is None else tuple(p.pp_stage_layers),
            sequence_parallel=p.sequence_parallel,
        )

    @property
    def local_rank(self) -> int:
        return self.world.rank if self.world.local_rank is None else self.world.local_rank

    def with_changes(self, **changes: Any) -> JobConfig:
        """This job with some fields changed, validated as a whole as :func:`build_config` validates a new one
        (:class:`ConfigError` naming the first problem): a section by a mapping of its fields
        (``cfg.with_changes(parallel={"tp": 2}, world={"rank": 3})``), a top-level field by its value. What is
        not changed is carried over typed, not dumped and read back; a changed section keeps the fields it was given
        (``model_fields_set``, which :meth:`_check_effective` reads) and takes the rest from their defaults and
        validators (``parallel.dp_shard`` from the world)."""
        update: dict[str, Any] = {}
        for name, value in changes.items():
            section = getattr(self, name)
            if isinstance(section, BaseModel):  # its given fields and the changes, validated under its name
                value = {**{k: getattr(section, k) for k in section.model_fields_set}, **value}
            update[name] = value
        try:
            return type(self).model_validate({**dict(self), **update})
        except ValidationError as err:
            raise ConfigError(_format_error(err)) from None


def _default(model: type[BaseModel], field: str) -> Any:
    """The default of ``model.field``: the one place it is written is the field's declaration."""
    return model.model_fields[field].default


def _format_error(err: ValidationError) -> str:
    e = err.errors()[0]
    loc = ".".join(str(x) for x in e["loc"])
    msg = e["msg"].removeprefix("Value error, ")
    if "input" in e and not isinstance(e["input"], dict) and e["type"] not in ("value_error",):
        return f"{loc}: {msg} (got {shown_number(e['input'])})" if loc else msg
    return f"{loc}: {msg}" if loc else msg


def build_config(data: dict[str, Any]) -> JobConfig:
    """Validate a nested dict into a JobConfig, turning pydantic's report into one line."""
    try:
        return JobConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_error(err)) from None


class _YamlLimit(Exception):
    """A job file beyond a limit of :mod:`hyperdryrun.ingest.files` (nesting, nodes) or with a duplicate key."""


class JobFileLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader (no Python objects), refusing what a job file never needs: a key given twice in one
    mapping (the last would silently win), collections nested deeper than :data:`NESTING`, and more than
    :data:`YAML_NODES` nodes once aliases are expanded (a 1 KB alias bomb stands for a billion strings)."""

    def __init__(self, stream: str, max_depth: int, max_nodes: int) -> None:
        super().__init__(stream)
        self.max_depth, self.max_nodes, self.depth = max_depth, max_nodes, 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        nested = self.check_event(yaml.SequenceStartEvent, yaml.MappingStartEvent)
        self.depth += nested
        try:
            if self.depth > self.max_depth:
                raise _YamlLimit(f"is nested deeper than {self.max_depth} levels ({NESTING.hint})")
            return super().compose_node(parent, index)
        finally:
            self.depth -= nested

    def get_single_node(self) -> Any:
        node = super().get_single_node()
        if node is not None:
            self._check_expanded(node)
        return node

    def _check_expanded(self, root: yaml.Node) -> None:
        """Nodes and nesting of the document as the constructor will expand it (each alias a copy)."""
        size: dict[int, int] = {}
        depth: dict[int, int] = {}
        on_path: set[int] = set()
        stack: list[tuple[yaml.Node, bool]] = [(root, False)]
        while stack:
            node, done = stack.pop()
            key = id(node)
            kids = _children(node)
            if done:
                on_path.discard(key)
                size[key] = 1 + sum(size[id(k)] for k in kids)
                depth[key] = (not isinstance(node, yaml.ScalarNode)) + max(
                    (depth[id(k)] for k in kids), default=0
                )
                if size[key] > self.max_nodes:
                    raise _YamlLimit(
                        f"has more than {self.max_nodes} nodes with its aliases expanded ({YAML_NODES.hint})"
                    )
                if depth[key] > self.max_depth:
                    raise _YamlLimit(
                        f"is nested deeper than {self.max_depth} levels with its aliases expanded ({NESTING.hint})"
                    )
                continue
            if key in size:
                continue
            if key in on_path:
                raise _YamlLimit("holds a recursive alias (a collection that contains itself)")
            on_path.add(key)
            stack.append((node, True))
            stack.extend((k, False) for k in kids if id(k) not in size)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *base` then overriding a key is what a merge is for
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
            except TypeError:
                continue  # an unhashable key: the constructor's own error
            if duplicate:
                raise _YamlLimit(f"has a duplicate key {key!r} at line {key_node.start_mark.line + 1}")
            seen.add(key)
        return super().construct_mapping(node, deep)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def load_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """The mapping in the YAML job file ``path``, read within the limits of :mod:`hyperdryrun.ingest.files` (size,
    nesting, nodes with aliases expanded), UTF-8, with no key given twice; any problem is a one-line ConfigError."""
    p = Path(path)
    where = f"--config: {str(p)!r}"
    try:
        raw = read_bytes(p, CONFIG_BYTES)
        max_depth, max_nodes = NESTING.of(p), YAML_NODES.of(p)
    except IngestError as err:
        reasons = {
            "no such file": "No such file or directory",
            "is a directory, not a file": "Is a directory",
        }
        if err.problem in reasons or err.problem.startswith("cannot read: "):
            why = reasons.get(err.problem) or err.problem.removeprefix("cannot read: ")
            raise ConfigError(f"--config: cannot read {str(p)!r}: {why}") from None
        sep = " " if err.problem.startswith("is ") else ": "
        raise ConfigError(f"{where}{sep}{err.problem}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"{where} is not UTF-8 text (byte {err.start}: {raw[err.start : err.start + 1]!r})"
        ) from None
    loader = None
    try:
        # PyYAML's reader refuses unprintable characters as the loader is made
        loader = JobFileLoader(text, max_depth, max_nodes)
        data = loader.get_single_data()
    except _YamlLimit as err:
        raise ConfigError(f"{where} {err}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{where} is not valid YAML: {str(err).splitlines()[0]}") from None
    except RecursionError:
        raise ConfigError(f"{where} is nested deeper than Python can construct ({NESTING.hint})") from None
    except ValueError as err:  # an integer past Python's digit limit (int_max_str_digits): no field takes it
        if "digits" not in str(err):
            raise
        raise ConfigError(
            f"{where} holds an integer of more than {sys.get_int_max_str_digits()} digits"
        ) from None
    finally:
        if loader is not None:
            loader.dispose()
    if data is None or data == {}:
        # an empty file (or one holding only comments) would run the default job, which no one meant
        raise ConfigError(
            f"{where} is empty: it gives no job (write at least one section, e.g. 'model: {{name: llama3-8b}}')"
        )
    if not isinstance(data, dict):
        raise ConfigError(f"--config: {str(p)!r} must hold a mapping, got {type(data).__name__}")
    return data


def check_rank(rank: int, world_size: int | None, error: type[ConfigError] | None = None) -> None:
    """The one check of a rank against its world (``--rank``, every front door): ``0 <= rank < world_size``
    (``world_size`` None: not known yet, only ``rank >= 0``); a one-line ``error`` (ConfigError) otherwise."""
    if rank < 0 or (world_size is not None and rank >= world_size):
        raise (error or ConfigError)(f"--rank: must satisfy 0 <= rank < world_size={world_size} (got {rank})")


TORCHRUN_VARS = {"world_size": "WORLD_SIZE", "rank": "RANK", "local_rank": "LOCAL_RANK"}
"""The torchrun variable of each rank-identity field of :class:`RankConfig`."""


def rank_from_env(environ: Mapping[str, str] | None = None) -> dict[str, int]:
    """torchrun's RANK / WORLD_SIZE / LOCAL_RANK (and LOCAL_WORLD_SIZE, as ``local_world_size``) that are set,
    each checked, and checked against each other where both are set, with a one-line error."""
    env = os.environ if environ is None else environ
    out: dict[str, int] = {}
    for key, var in (*TORCHRUN_VARS.items(), ("local_world_size", "LOCAL_WORLD_SIZE")):
        if var not in env:
            continue
        raw = env[var]
        try:
            out[key] = bounded_int(raw)
        except ValueError as err:
            why = "is out of range (2**64 or more)" if "out of range" in str(err) else "is not an integer"
            raise ConfigError(f"{var}={shown(raw)} {why}") from None
    for key, var, least in (
        ("world_size", "WORLD_SIZE", 1),
        ("rank", "RANK", 0),
        ("local_rank", "LOCAL_RANK", 0),
        ("local_world_size", "LOCAL_WORLD_SIZE", 1),
    ):
        if out.get(key, least) < least:
            raise ConfigError(f"{var}={out[key]} must be >= {least}")
    for low, high in (("rank", "world_size"), ("local_rank", "local_world_size")):
        if low in out and high in out and out[low] >= out[high]:
            a, b = _ENV_NAME[low], _ENV_NAME[high]
            raise ConfigError(f"{a}={out[low]} must satisfy 0 <= {a} < {b}={out[high]}")
    if out.get("local_world_size", 0) > out.get("world_size", out.get("local_world_size", 0)):
        raise ConfigError(
            f"LOCAL_WORLD_SIZE={out['local_world_size']} must be <= WORLD_SIZE={out['world_size']}"
        )
    return out


_ENV_NAME = {**TORCHRUN_VARS, "local_world_size": "LOCAL_WORLD_SIZE"}
