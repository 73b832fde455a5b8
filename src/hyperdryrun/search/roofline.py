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
overlap the compute. Rates come from the GPU preset (:data:`hyperdryrun.world.gpus.GPU_PRESETS`, vendor datasheets cited there) and can be
overridden.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hyperdryrun.search.bounds import DTYPE_BYTES, optimizer_states, state_bound
from hyperdryrun.world.gpus import DEFAULT_GPU, GPU_PRESETS, Rates, gpu_preset

if TYPE_CHECKING:
    from hyperdryrun.config import JobConfig

RATES: dict[str, Rates] = {name: preset.rates for name, preset in GPU_PRESETS.items()}
"""The rates of every GPU preset (:data:`hyperdryrun.world.gpus.GPU_PRESETS`, the one GPU table, sources there)."""


def rates_for(gpu: str | None) -> Rates:
    """The rates of preset ``gpu`` (:data:`~hyperdryrun.world.gpus.DEFAULT_GPU` when None)."""
    try:
        return gpu_preset(DEFAULT_GPU if gpu is None else gpu).rates
    except ValueError as err:
        raise ValueError(f"{err} (no rates for it)") from None


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


def flops_step_time(
    flops_per_token: float,
    tokens_per_step: int,
    world: int,
    rates: Rates,
    pp: int = 1,
    micro_batches: int = 1,
    stages_per_rank: int = 1,
) -> StepTime:
    """The estimate for a job that gives only its training FLOPs per token (a torchtitan model's
    ``get_nparams_and_flops``): the compute of ``tokens_per_step`` (the whole job's) split over ``world`` ranks
    at the peak rate, plus the pipeline bubble as :func:`step_time` counts it; no collectives or optimizer time (the
    job's communication is not known), so it ranks layouts by compute alone."""
    compute = flops_per_token * tokens_per_step / world / rates.peak_flops
    bubble = compute * (pp - 1) / (micro_batches * stages_per_rank) if pp > 1 else 0.0
    return StepTime(compute + bubble, compute, bubble, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, tokens_per_step, world)
