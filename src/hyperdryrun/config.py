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

from hyperdryrun.models.llama import PRESETS, LlamaArgs
from hyperdryrun.models.moe import PRESETS as MOE_PRESETS
from hyperdryrun.models.moe import MoEArgs
from hyperdryrun.world.runtime import CudaRuntime
from hyperdryrun.world.values import ROUTING_OP, ValueRule, ValueRules

Dtype = Literal["bf16", "fp32"]
PipelineSchedule = Literal[
    "GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"
]
"""The training schedules of torch 2.13 ``torch.distributed.pipelining`` (``get_schedule_class`` names)."""
MULTI_STAGE_SCHEDULES = (
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
)
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
"""Schedules that place two stages per rank in a V (rank r holds stages r and 2*pp-1-r)."""


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

    @field_validator("name")
    @classmethod
    def _known_preset(cls, v: str) -> str:
        if v not in PRESETS and v not in MOE_PRESETS:
            names = ", ".join(sorted([*PRESETS, *MOE_PRESETS]))
            raise ValueError(f"unknown model {v!r}; choose one of {names}")
        return v

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
    def is_moe(self) -> bool:
        return self.name in MOE_PRESETS

    def args(self) -> LlamaArgs | MoEArgs:
        overrides = {k: v for k, v in self.model_dump(exclude={"name"}).items() if v is not None}
        return (MOE_PRESETS if self.is_moe else PRESETS)[self.name].replace(**overrides)


MOE_FIELDS = ("num_experts", "top_k", "moe_ffn_dim", "num_shared_experts", "n_dense_layers")


class ParallelConfig(_Strict):
    """Parallel degrees (torchtitan's ParallelDims). ``dp_shard=None`` takes what the world leaves."""

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
        if self.pp_virtual_stages is not None:
            return self.pp_virtual_stages
        return 2 if self.pp_schedule in MULTI_STAGE_SCHEDULES else 1

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
        p, w, m = self.parallel, self.world, self.model.args()
        others = p.dp_replicate * p.cp * p.tp * p.pp
        if p.dp_shard is None:
            if w.world_size % others:
                raise ValueError(
                    f"world.world_size={w.world_size} is not divisible by dp_replicate*cp*tp*pp={others}"
                )
            object.__setattr__(p, "dp_shard", w.world_size // others)
        product = others * p.dp_shard
        if product != w.world_size:
            raise ValueError(
                f"world.world_size={w.world_size} != dp_replicate*dp_shard*cp*tp*pp = "
                f"{p.dp_replicate}*{p.dp_shard}*{p.cp}*{p.tp}*{p.pp} = {product}"
            )
        if m.dim % m.n_heads:
            raise ValueError(f"model.dim={m.dim} is not divisible by model.n_heads={m.n_heads}")
        if m.n_heads % m.n_kv_heads:
            raise ValueError(f"model.n_heads={m.n_heads} is not divisible by model.n_kv_heads={m.n_kv_heads}")
        for field in ("n_heads", "n_kv_heads", "ffn_dim", "vocab_size"):
            if getattr(m, field) % p.tp:
                raise ValueError(f"model.{field}={getattr(m, field)} is not divisible by parallel.tp={p.tp}")
        if p.tp > 1 and p.sequence_parallel and self.training.seq_len % p.tp:
            raise ValueError(
                f"training.seq_len={self.training.seq_len} is not divisible by parallel.tp={p.tp} "
                "(sequence parallel shards the sequence)"
            )
        if p.pp > 1:
            self._check_pipeline()
        if p.cp > 1:
            self._check_context_parallel()
        self._check_moe()
        if self.training.ac == "selective" and self.training.ac_selective != "op":
            if int(self.training.ac_selective) > m.n_layers:
                raise ValueError(
                    f"training.ac_selective={self.training.ac_selective} exceeds model.n_layers={m.n_layers}"
                )
        return self

    def _check_context_parallel(self) -> None:
        """Context parallel: the head-tail load-balanced sequence split and what it can be combined with."""
        p, seq = self.parallel, self.training.seq_len
        if seq % (2 * p.cp):
            raise ValueError(
                f"training.seq_len={seq} is not divisible by 2*parallel.cp={2 * p.cp} (context parallel's "
                "load-balanced layout splits the sequence into 2*cp chunks, two per rank)"
            )
        if p.tp > 1 and p.sequence_parallel and (seq // p.cp) % p.tp:
            raise ValueError(
                f"training.seq_len/parallel.cp={seq // p.cp} is not divisible by parallel.tp={p.tp} "
                "(sequence parallel shards each context-parallel shard of the sequence)"
            )
        if p.pp > 1:
            raise ValueError(
                f"parallel.cp={p.cp} with parallel.pp={p.pp} is not supported yet "
                "(this recipe's pipeline step does not run its stages under the context-parallel context)"
            )
        if self.target_device != "cuda":
            raise ValueError(
                f"parallel.cp={p.cp} needs target_device=cuda, got {self.target_device!r} (torch 2.13 ring attention "
                "only dispatches the CUDA flash, memory-efficient and cuDNN SDPA kernels)"
            )
        compute = self.training.param_dtype or self.training.dtype
        m = self.model.args()
        if compute == "fp32" and m.n_kv_heads != m.n_heads:
            raise ValueError(
                f"parallel.cp={p.cp} with fp32 compute and grouped-query attention (model.n_kv_heads={m.n_kv_heads} "
                f"< n_heads={m.n_heads}) is not supported: CUDA runs that SDPA with the math kernel (flash and cuDNN "
                "need bf16/fp16, memory-efficient has no GQA in torch 2.13), which ring attention does not handle"
            )
        if compute == "fp32" and (seq // (2 * p.cp)) % 32:
            raise ValueError(
                f"training.seq_len={seq} with parallel.cp={p.cp} and fp32 compute: the memory-efficient SDPA kernel "
                "pads its logsumexp to a multiple of 32 rows, so ring attention's half-shard merge needs "
                f"seq_len/(2*cp)={seq // (2 * p.cp)} to be a multiple of 32"
            )

    def _check_pipeline(self) -> None:
        """The pipeline layout: schedule vs stages per rank, the layer split, micro batches per schedule."""
        p, m, n_mb = self.parallel, self.model.args(), self.training.num_micro_batches
        v = p.pp_stages_per_rank
        if p.pp_schedule in V_SCHEDULES and v != 2:
            raise ValueError(
                f"parallel.pp_virtual_stages={v} must be 2 for parallel.pp_schedule={p.pp_schedule} "
                "(a V schedule holds exactly two stages per rank)"
            )
        if p.pp_schedule not in MULTI_STAGE_SCHEDULES and v != 1:
            raise ValueError(
                f"parallel.pp_virtual_stages={v} needs a multi-stage schedule "
                f"({', '.join(MULTI_STAGE_SCHEDULES)}); parallel.pp_schedule={p.pp_schedule} runs one stage per rank"
            )
        stages = p.pp_num_stages
        if m.tie_embeddings:
            raise ValueError(
                "model.tie_embeddings=True cannot be used with parallel.pp > 1 "
                "(the embedding and the output head live on different pipeline stages)"
            )
        if p.pp_stage_layers is not None:
            layers = p.pp_stage_layers
            if len(layers) != stages:
                raise ValueError(
                    f"parallel.pp_stage_layers has {len(layers)} entries, needs one per pipeline stage: "
                    f"pp*stages_per_rank = {p.pp}*{v} = {stages}"
                )
            if sum(layers) != m.n_layers:
                raise ValueError(
                    f"parallel.pp_stage_layers={layers} sums to {sum(layers)}, model.n_layers={m.n_layers}"
                )
            empty = [i for i in range(1, stages - 1) if layers[i] == 0]
            if empty:
                raise ValueError(
                    f"parallel.pp_stage_layers={layers}: middle stage {empty[0]} has no layers "
                    "(only the first and last stages, which hold the embedding and the head, may have none)"
                )
        elif m.n_layers + 2 < stages:
            raise ValueError(
                f"model.n_layers={m.n_layers} does not split into {stages} pipeline stages (the even split counts "
                f"the embedding and the head as one layer each: needs n_layers + 2 >= {stages})"
            )
        if p.pp_schedule in ("1F1B", "DualPipeV") and n_mb < stages:
            raise ValueError(
                f"training.num_micro_batches={n_mb} must be >= the {stages} pipeline stages "
                f"for parallel.pp_schedule={p.pp_schedule}"
            )
        if p.pp_schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
            rounds = max(1, n_mb // p.pp)
            if n_mb % rounds:
                raise ValueError(
                    f"training.num_micro_batches={n_mb} must be a multiple of max(1, num_micro_batches // pp) "
                    f"= {rounds} for parallel.pp_schedule={p.pp_schedule}"
                )

    def _check_moe(self) -> None:
        """Expert parallel and the routing scenario against the MoE model's shapes."""
        p, m, v = self.parallel, self.model.args(), self.values
        if not self.model.is_moe:
            for name in ("ep", "etp"):
                if getattr(p, name) > 1:
                    raise ValueError(
                        f"parallel.{name}={getattr(p, name)} needs an MoE model, {self.model.name!r} is dense"
                    )
            return
        if m.top_k > m.num_experts:
            raise ValueError(f"model.top_k={m.top_k} exceeds model.num_experts={m.num_experts}")
        if m.n_dense_layers > m.n_layers:
            raise ValueError(f"model.n_dense_layers={m.n_dense_layers} exceeds model.n_layers={m.n_layers}")
        if p.cp > 1:
            raise ValueError(
                f"parallel.cp={p.cp} with an MoE model is not supported yet (MoE runs with FSDP/TP/EP/PP)"
            )
        # torchtitan's layouts: etp is 1 or tp; with ep > 1, etp = tp shards each local expert over tp (ep x etp),
        # etp = 1 lends the tp ranks to EP, which this recipe does not build (EP splits dp_shard only).
        if p.etp > 1 and p.tp == 1:
            raise ValueError(
                f"parallel.etp={p.etp} needs parallel.tp={p.etp} (expert TP shards experts over tp)"
            )
        if p.etp not in (1, p.tp):
            raise ValueError(f"parallel.etp={p.etp} must be 1 or parallel.tp={p.tp} (torchtitan's layouts)")
        if p.tp > 1 and p.ep > 1 and p.etp == 1:
            raise ValueError(
                f"parallel.etp=1 with parallel.tp={p.tp} and parallel.ep={p.ep} is not supported (EP borrowing the "
                f"tp ranks is not built; use parallel.etp={p.tp})"
            )
        if p.tp > 1:
            shared = m.num_shared_experts * m.moe_ffn_dim
            for name, value in (("moe_ffn_dim", m.moe_ffn_dim), ("num_shared_experts*moe_ffn_dim", shared)):
                if value % p.tp:
                    raise ValueError(f"model.{name}={value} is not divisible by parallel.tp={p.tp}")
        if p.dp_shard % p.ep:
            raise ValueError(
                f"parallel.ep={p.ep} must divide parallel.dp_shard={p.dp_shard} (EP splits dp_shard)"
            )
        if m.num_experts % p.ep:
            raise ValueError(f"parallel.ep={p.ep} must divide model.num_experts={m.num_experts}")
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
