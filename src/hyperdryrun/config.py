"""The validated job description: the one place where defaults live.

Every consumer (CLI, YAML file, Python API) builds a :class:`JobConfig`; a bad value raises
:class:`ConfigError` whose message is one line naming the field and the value.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from hyperdryrun.models import hf
from hyperdryrun.models.registry import ModelFamily, family_of, preset_names
from hyperdryrun.parallel.dims import ParallelDims, PipelineSchedule, stages_per_rank
from hyperdryrun.world.runtime import CudaRuntime
from hyperdryrun.world.values import ROUTING_OP, ValueRule, ValueRules

Dtype = Literal["bf16", "fp32"]


class ConfigError(ValueError):
    """A one-line, user-facing configuration error."""


class _Strict(BaseModel):
    # allow_inf_nan=False: "inf" GiB of device memory or a NaN learning rate is a typo, not a value.
    model_config = ConfigDict(extra="forbid", strict=False, validate_assignment=True, allow_inf_nan=False)


class ModelConfig(_Strict):
    """A preset plus optional overrides of every shape field."""

    name: str = "llama3-8b"
    dim: int | None = Field(None, gt=0)
    n_layers: int | None = Field(None, gt=0)
    n_heads: int | None = Field(None, gt=0)
    n_kv_heads: int | None = Field(None, gt=0)
    ffn_dim: int | None = Field(None, gt=0)
    vocab_size: int | None = Field(None, gt=0)
    norm_eps: float | None = Field(None, gt=0)
    rope_theta: float | None = Field(None, gt=0)
    tie_embeddings: bool | None = None
    # --- MoE models (presets of hyperdryrun.models.moe) ---
    num_experts: int | None = Field(None, gt=0)
    top_k: int | None = Field(None, gt=0)
    moe_ffn_dim: int | None = Field(None, gt=0)
    num_shared_experts: int | None = Field(None, ge=0)
    n_dense_layers: int | None = Field(None, ge=0)
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
    def _moe_fields_need_moe(self) -> ModelConfig:
        if not self.is_moe:
            for f in MOE_FIELDS:
                if getattr(self, f) is not None:
                    raise ValueError(
                        f"model.{f}={getattr(self, f)} needs an MoE model, {self.name!r} is dense"
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


MOE_FIELDS = ("num_experts", "top_k", "moe_ffn_dim", "num_shared_experts", "n_dense_layers")


class ParallelConfig(_Strict):
    """Parallel degrees and options as given; ``dp_shard=None`` takes what the world leaves. The layout they make,
    and its rules, is :attr:`JobConfig.dims` (:class:`~hyperdryrun.parallel.dims.ParallelDims`)."""

    dp_replicate: int = Field(1, gt=0)
    dp_shard: int | None = Field(None, gt=0)
    tp: int = Field(1, gt=0)
    cp: int = Field(1, gt=0)
    pp: int = Field(1, gt=0)
    ep: int = Field(1, gt=0)
    etp: int = Field(1, gt=0)
    reshard_after_forward: bool = True
    sequence_parallel: bool = True
    loss_parallel: bool = True
    pp_schedule: PipelineSchedule = "1F1B"
    """torch.distributed.pipelining schedule used when pp > 1."""
    pp_virtual_stages: int | None = Field(None, gt=0)
    """Pipeline stages per rank: 1 for single-stage schedules, 2 by default for multi-stage ones."""
    pp_stage_layers: list[int] | None = None
    """Decoder layers of each pipeline stage, in stage order (default: torchtitan's even split)."""
    cp_rotate_method: Literal["allgather", "alltoall"] = "allgather"
    """How ring attention passes K/V between CP ranks (torch 2.13 ``set_rotate_method``; torchtitan's default)."""

    @field_validator("pp_stage_layers")
    @classmethod
    def _non_negative_layers(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (not v or any(n < 0 for n in v)):
            raise ValueError(f"must be a non-empty list of layer counts >= 0, got {v}")
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
    seq_len: int = Field(2048, gt=0)
    micro_batch_size: int = Field(1, gt=0)
    num_micro_batches: int = Field(1, gt=0)
    """Gradient accumulation: micro batches per optimizer step."""
    ac: Literal["none", "full", "selective"] = "none"
    ac_selective: str = "op"
    """``op`` (save matmul and attention outputs, recompute the rest) or ``k`` (checkpoint every k-th layer)."""
    optimizer: Literal["AdamW", "Adam", "SGD"] = "AdamW"
    optimizer_impl: Literal["foreach", "fused", "for-loop"] = "foreach"
    lr: float = Field(3e-4, gt=0)
    momentum: float = Field(0.9, ge=0)
    weight_decay: float = Field(0.1, ge=0)

    @field_validator("ac_selective")
    @classmethod
    def _ac_option(cls, v: str) -> str:
        if v != "op" and not (v.isdigit() and int(v) > 0):
            raise ValueError(f"must be 'op' or a positive layer interval, got {v!r}")
        return v


class ValuesConfig(_Strict):
    """Data-dependent values (hyperdryrun.world.values): the MoE routing scenario and extra value rules."""

    routing: Literal["balanced", "hotspot", "explicit"] = "balanced"
    """Tokens per expert on each rank: even, one hot expert, or ``counts`` as given."""
    hot_expert: int = Field(0, ge=0)
    skew: float = Field(2.0, ge=1)
    """hotspot: the hot expert's load as a multiple of the balanced load."""
    counts: list[int] | None = None
    """explicit: tokens per expert of one rank's micro batch (sum = micro_batch_size * seq_len * top_k)."""
    rules: list[ValueRule] = []
    """Rules tried first (module/op patterns); the routing scenario applies to every MoE layer they leave."""

    @model_validator(mode="after")
    def _scenario_fields(self) -> ValuesConfig:
        if self.routing == "explicit" and not self.counts:
            raise ValueError("values.routing='explicit' needs values.counts (tokens per expert)")
        if self.counts is not None and any(c < 0 for c in self.counts):
            raise ValueError(f"values.counts={self.counts} must all be >= 0")
        return self

    def routing_rule(self) -> ValueRule:
        return ValueRule(
            module="*", op=ROUTING_OP, handler=self.routing, hot_expert=self.hot_expert, skew=self.skew,
            counts=self.counts,
        )  # fmt: skip

    def value_rules(self) -> ValueRules:
        """The rules a run uses: the explicit ones first, then the routing scenario for every MoE layer."""
        return ValueRules([*self.rules, self.routing_rule()])


class RankConfig(_Strict):
    world_size: int = Field(1, ge=1)
    rank: int = Field(0, ge=0)
    local_rank: int | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _rank_in_world(self) -> RankConfig:
        if self.rank >= self.world_size:
            raise ValueError(f"rank={self.rank} must be < world_size={self.world_size}")
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
    device_memory_gib: float | None = Field(None, gt=0)
    output_dir: str = "hyperdryrun_out"
    live_set_limit: int = Field(50, gt=0)

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
        if self.model.is_moe:
            self._check_routing(m)
        if t.ac == "selective" and t.ac_selective != "op" and int(t.ac_selective) > m.n_layers:
            raise ValueError(f"training.ac_selective={t.ac_selective} exceeds model.n_layers={m.n_layers}")
        return self

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

    @property
    def dims(self) -> ParallelDims:
        """The job's parallel layout: degrees, mesh, every rank's coordinates (:mod:`hyperdryrun.parallel.dims`)."""
        return ParallelDims.from_config(self)

    @property
    def local_rank(self) -> int:
        return self.world.rank if self.world.local_rank is None else self.world.local_rank


def _format_error(err: ValidationError) -> str:
    e = err.errors()[0]
    loc = ".".join(str(x) for x in e["loc"])
    msg = e["msg"].removeprefix("Value error, ")
    if "input" in e and not isinstance(e["input"], dict) and e["type"] not in ("value_error",):
        return f"{loc}: {msg} (got {e['input']!r})" if loc else msg
    return f"{loc}: {msg}" if loc else msg


def build_config(data: dict[str, Any]) -> JobConfig:
    """Validate a nested dict into a JobConfig, turning pydantic's report into one line."""
    try:
        return JobConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_error(err)) from None


def load_yaml(path: str | os.PathLike) -> dict[str, Any]:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as err:
        raise ConfigError(f"--config: cannot read {str(p)!r}: {err.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"--config: {str(p)!r} is not valid YAML: {str(err).splitlines()[0]}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config: {str(p)!r} must hold a mapping, got {type(data).__name__}")
    return data


def rank_from_env(environ: dict[str, str] | None = None) -> dict[str, int]:
    """Read torchrun's RANK / WORLD_SIZE / LOCAL_RANK, each validated with a one-line error."""
    env = os.environ if environ is None else environ
    out: dict[str, int] = {}
    for var, key in (("WORLD_SIZE", "world_size"), ("RANK", "rank"), ("LOCAL_RANK", "local_rank")):
        if var not in env:
            continue
        raw = env[var]
        try:
            out[key] = int(raw)
        except ValueError:
            raise ConfigError(f"{var}={raw!r} is not an integer") from None
    if out.get("world_size", 1) < 1:
        raise ConfigError(f"WORLD_SIZE={out['world_size']} must be >= 1")
    if "rank" in out and not 0 <= out["rank"] < out.get("world_size", 1):
        raise ConfigError(
            f"RANK={out['rank']} must satisfy 0 <= RANK < WORLD_SIZE={out.get('world_size', 1)}"
        )
    if out.get("local_rank", 0) < 0:
        raise ConfigError(f"LOCAL_RANK={out['local_rank']} must be >= 0")
    return out
