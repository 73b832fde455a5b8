"""A roofline estimate of one training step's time, to rank the layouts that fit (not a performance model).

Per rank, with ``T`` the tokens of one data-parallel replica's step (``micro_batch_size * seq_len *
num_micro_batches``) and every quantity split evenly over the ranks that share it:

- **compute** = FLOPs / peak dense bf16 FLOP/s. FLOPs of the job's step = ``6 * N * tokens`` for the matmul
  parameters ``N`` (all but the input embedding; an MoE model's *active* ones, ``top_k`` routed experts) plus causal
  attention ``6 * layers * heads * (d_qk + d_v) / 2 * seq`` per token (QK^T and PV, forward 1x + backward 2x, half of
  the score matrix). Full activation checkpointing adds one more forward (``+2N`` and the attention forward) per
  token; op-level selective AC saves matmul and attention outputs, so it recomputes none of those FLOPs. Each rank
  does 1/world of the job's FLOPs.
- **pipeline bubble**: compute x ``(pp - 1) / num_micro_batches`` (GPipe, 1F1B), divided by the stages per rank for
  the interleaved and V schedules.
- **collectives**, bytes each rank sends over the link its group spans (within a node when the group's ranks fit in
  ``gpus_per_node``: the mesh is row-major over pp, dp_replicate, dp_shard, cp, tp, so tp is innermost), ring
  algorithms (``(g - 1) / g`` of the buffer for all-gather / reduce-scatter, twice that for all-reduce):
  TP with sequence parallel, 2 all-gathers + 2 reduce-scatters of the bf16 hidden state per layer and micro batch in
  forward, as many in backward (and in the recompute of full AC); CP, ``cp - 1`` K/V blocks per layer in forward and
  twice in backward; EP, the dispatch and combine all-to-all of ``top_k`` tokens per MoE layer, forward and backward;
  PP, the hidden state (and its gradient) to the next stage per micro batch; FSDP2, an all-gather of the rank's
  stage parameters in ``param_dtype`` per micro batch in forward and again in backward (reshard after forward), a
  reduce-scatter of the gradients in ``reduce_dtype`` per micro batch (once per step with pp, where
  ``torch.distributed.pipelining`` defers it to the last micro batch); HSDP, an all-reduce of the sharded gradients
  over ``dp_replicate``.
- **optimizer**: memory-bound, ``(2 + 1 + 2 * states)`` accesses of each local parameter element (read and write the
  parameter and each state, read the gradient) over HBM bandwidth.

The step estimate is ``compute * (1 + bubble) + TP + CP + EP + PP + max(0, FSDP + HSDP - compute) + optimizer``:
TP, CP, EP and point-to-point transfers sit on the critical path, FSDP2's prefetched all-gathers and reduce-scatters
overlap the compute. Rates come from the GPU preset (:data:`RATES`, vendor datasheets cited there) and can be
overridden.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from hyperdryrun.search.bounds import DTYPE_BYTES, optimizer_states, state_bound

if TYPE_CHECKING:
    from hyperdryrun.config import JobConfig

GB = 10**9


@dataclass(frozen=True)
class Rates:
    """What a step's time is estimated from: one GPU's peak dense bf16 FLOP/s and HBM bandwidth, the per-GPU
    bandwidth (one direction) within a node and between nodes, and GPUs per node."""

    peak_flops: float
    hbm_bytes_per_s: float
    intra_node_bytes_per_s: float
    inter_node_bytes_per_s: float
    gpus_per_node: int = 8
    source: str = ""

    def with_overrides(self, **changes: Any) -> Rates:
        """These rates with the given fields replaced (None leaves a field as it is)."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


_NDR = (
    50 * GB
)  # 400 Gb/s InfiniBand NDR / ConnectX-7, one NIC per GPU (DGX H100, HGX H200/B200, MI300X platforms)
_HDR = 25 * GB  # 200 Gb/s InfiniBand HDR, one NIC per GPU (DGX A100)

RATES: dict[str, Rates] = {
    "a100-40gb": Rates(
        312e12, 1555 * GB, 300 * GB, _HDR, 8,
        "NVIDIA A100 datasheet: BF16 312 TFLOPS dense (624 with sparsity), HBM2 1,555 GB/s, NVLink 600 GB/s "
        "(both directions); DGX A100: 8 x 200 Gb/s HDR",
    ),
    "a100-80gb": Rates(
        312e12, 2039 * GB, 300 * GB, _HDR, 8,
        "NVIDIA A100 datasheet: BF16 312 TFLOPS dense, HBM2e 2,039 GB/s (SXM), NVLink 600 GB/s; DGX A100: 8 x 200 Gb/s",
    ),
    "h100-80gb": Rates(
        989.5e12, 3350 * GB, 450 * GB, _NDR, 8,
        "NVIDIA H100 datasheet (SXM): BF16 1,979 TFLOPS with sparsity = 989.5 dense, HBM3 3.35 TB/s, NVLink 900 GB/s "
        "(both directions); DGX H100: 8 x 400 Gb/s ConnectX-7",
    ),
    "h100-96gb": Rates(
        989.5e12, 4000 * GB, 450 * GB, _NDR, 8,
        "NVIDIA GH200 datasheet: H100 96GB HBM3 4 TB/s, BF16 989.5 TFLOPS dense, NVLink 900 GB/s",
    ),
    "h200": Rates(
        989.5e12, 4800 * GB, 450 * GB, _NDR, 8,
        "NVIDIA H200 datasheet (SXM): BF16 1,979 TFLOPS with sparsity = 989.5 dense, HBM3e 4.8 TB/s, NVLink 900 GB/s",
    ),
    "b200": Rates(
        2250e12, 8000 * GB, 900 * GB, _NDR, 8,
        "NVIDIA HGX B200 datasheet: FP16/BF16 36 PFLOPS with sparsity for 8 GPUs = 2.25 PFLOPS dense per GPU, HBM3e "
        "8 TB/s per GPU, NVLink 5 1.8 TB/s per GPU (both directions)",
    ),
    "mi300x": Rates(
        1307.4e12, 5300 * GB, 448 * GB, _NDR, 8,
        "AMD Instinct MI300X datasheet: BF16 1,307.4 TFLOPS dense (2,614.9 with sparsity), HBM3 5.3 TB/s, "
        "Infinity Fabric 896 GB/s peer bandwidth (both directions)",
    ),
}  # fmt: skip
"""Rates of every GPU preset of :data:`hyperdryrun.world.gpus.GPU_PRESETS`, with their sources."""


def rates_for(gpu: str | None) -> Rates:
    """The rates of preset ``gpu`` (H100 80GB when None)."""
    if gpu is None:
        return RATES["h100-80gb"]
    try:
        return RATES[gpu]
    except KeyError:
        raise ValueError(f"gpu={gpu!r}: no rates for it; choose one of {', '.join(RATES)}") from None


@dataclass(frozen=True)
class StepTime:
    """The estimate, in seconds, and its parts."""

    total: float
    compute: float
    bubble: float
    tp: float
    cp: float
    ep: float
    pp: float
    fsdp: float
    """FSDP + HSDP collectives (only what exceeds the compute is counted in ``total``)."""
    optimizer: float
    tokens_per_step: int
    """Tokens of the whole job's step."""
    world: int = 1

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_step / self.total / self.world if self.total else 0.0

    def to_dict(self) -> dict[str, float]:
        keys = ("total", "compute", "bubble", "tp", "cp", "ep", "pp", "fsdp", "optimizer")
        return {k: getattr(self, k) for k in keys}


def flops_per_token(cfg: JobConfig) -> float:
    """Training FLOPs per token of the whole model (see the module docstring)."""
    args, t = cfg.model.args(), cfg.training
    moe = cfg.model.is_moe
    n = args.num_params(active=True) if moe else args.num_params()
    n_matmul = n - args.vocab_size * args.dim  # the input embedding is a lookup
    if moe and args.attention == "mla":
        d_qk, d_v = args.qk_nope_head_dim + args.qk_rope_head_dim, args.v_head_dim
    else:
        d_qk = d_v = args.head_dim
    attn_fwd = (
        args.n_layers * args.n_heads * (d_qk + d_v) * t.seq_len
    )  # 2 * s * (d_qk + d_v) * h, halved (causal)
    flops = 6 * n_matmul + 3 * attn_fwd
    if t.ac == "full":
        flops += 2 * n_matmul + attn_fwd
    return float(flops)


def _ring(nbytes: float, group: int) -> float:
    return nbytes * (group - 1) / group if group > 1 else 0.0


def step_time(cfg: JobConfig, rates: Rates, param_elements: int | None = None) -> StepTime:
    """The roofline estimate of ``cfg``'s step (see the module docstring); ``param_elements``: the local parameter
    elements of the rank that holds the most (default: rank 0's)."""
    args, t, p, dims = cfg.model.args(), cfg.training, cfg.parallel, cfg.dims
    world = dims.world_size
    seqs = t.micro_batch_size * t.num_micro_batches * p.dp_replicate * p.dp_shard
    tokens = seqs * t.seq_len
    compute = flops_per_token(cfg) * tokens / world / rates.peak_flops
    v = dims.stages_per_rank
    bubble = compute * (p.pp - 1) / (t.num_micro_batches * v) if p.pp > 1 else 0.0

    def link(span: int) -> float:
        return rates.intra_node_bytes_per_s if span <= rates.gpus_per_node else rates.inter_node_bytes_per_s

    layers = args.n_layers / p.pp
    passes = 3 if t.ac == "full" else 2  # forward, backward, and the recompute's forward
    n_mb = t.num_micro_batches
    hidden = t.micro_batch_size * t.seq_len * args.dim * 2 / p.cp  # bf16 hidden state of one micro batch
    tp_time = 0.0
    if p.tp > 1:
        tp_time = 4 * passes * layers * n_mb * _ring(hidden, p.tp) / link(p.tp)
    cp_time = 0.0
    if p.cp > 1:
        kv = 2 * t.micro_batch_size * (t.seq_len / p.cp) * args.n_kv_heads * args.head_dim * 2 / p.tp
        cp_time = (p.cp - 1) * kv * (1 + 2 + (1 if t.ac == "full" else 0)) * layers * n_mb / link(p.cp * p.tp)
    ep_time = 0.0
    if cfg.model.is_moe and p.ep > 1:
        moe_layers = (args.n_layers - args.n_dense_layers) / p.pp
        routed = t.micro_batch_size * t.seq_len * args.top_k * args.dim * 2
        ep_time = 2 * passes * moe_layers * n_mb * _ring(routed, p.ep) / link(p.ep * p.cp * p.tp)
    pp_time = 0.0
    if p.pp > 1:
        local_hidden = hidden / p.tp if p.sequence_parallel and p.tp > 1 else hidden
        pp_time = 2 * v * n_mb * local_hidden / link(world)
    stage_params = state_bound(cfg, 0).param_elements if param_elements is None else param_elements
    fsdp_group = p.dp_shard * p.cp
    fsdp_time = 0.0
    if fsdp_group > 1:
        unsharded = stage_params * fsdp_group  # the stage's TP-local parameters, gathered
        gather = _ring(unsharded * DTYPE_BYTES[t.param_dtype or t.dtype], fsdp_group)
        gathers = n_mb * (2 if p.reshard_after_forward else 1)
        reduces = 1 if p.pp > 1 else n_mb
        scatter = _ring(unsharded * DTYPE_BYTES[t.reduce_dtype or t.dtype], fsdp_group)
        fsdp_time = (gathers * gather + reduces * scatter) / link(fsdp_group * p.tp)
    if p.dp_replicate > 1:
        grads = stage_params * DTYPE_BYTES[t.reduce_dtype or t.dtype]
        fsdp_time += 2 * _ring(grads, p.dp_replicate) / link(world)
    accesses = 2 + 1 + 2 * optimizer_states(cfg)
    optimizer = stage_params * DTYPE_BYTES[t.dtype] * accesses / rates.hbm_bytes_per_s
    total = (
        compute + bubble + tp_time + cp_time + ep_time + pp_time + max(0.0, fsdp_time - compute) + optimizer
    )
    return StepTime(
        total, compute, bubble, tp_time, cp_time, ep_time, pp_time, fsdp_time, optimizer, tokens, world
    )
