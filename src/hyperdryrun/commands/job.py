"""The job flags shared by every command that runs the built-in recipe (``run``, ``measure``): one table, so flags,
YAML keys and error messages agree.

Precedence: command-line flags > torchrun environment (rank identity only) > ``--config`` file > defaults.
"""

from __future__ import annotations

import argparse
from typing import Any

from hyperdryrun.config import ConfigError, JobConfig, build_config, load_yaml, rank_from_env
from hyperdryrun.models.hf import HF_PREFIX, shipped_configs
from hyperdryrun.models.registry import presets_help


def _int_list(text: str) -> list[int]:
    """``4,8,8,4`` -> [4, 8, 8, 4] (argparse reports a ValueError as a one-line usage error)."""
    return [int(x) for x in text.split(",")]


_int_list.__name__ = "comma-separated list of integers"

# flag -> (config path, type, help).
_BOOL = "bool"
RUN_FLAGS: dict[str, tuple[str, Any, str]] = {
    "--model": (
        "model.name",
        str,
        f"model preset ({presets_help()}) or a Hugging Face config "
        f"({', '.join(HF_PREFIX + n for n in shipped_configs())}, or {HF_PREFIX}PATH to a directory or config.json)",
    ),
    "--attn-implementation": (
        "model.attn_implementation",
        str,
        "Hugging Face models: attention kernel sdpa|eager|flex_attention (sdpa)",
    ),
    "--experts-implementation": (
        "model.experts_implementation",
        str,
        "Hugging Face MoE models: experts kernel grouped_mm|eager|batched_mm (transformers' default)",
    ),
    "--dim": ("model.dim", int, "hidden size"),
    "--n-layers": ("model.n_layers", int, "number of decoder layers"),
    "--n-heads": ("model.n_heads", int, "attention heads"),
    "--n-kv-heads": ("model.n_kv_heads", int, "key/value heads (grouped-query attention)"),
    "--ffn-dim": ("model.ffn_dim", int, "SwiGLU hidden size"),
    "--vocab-size": ("model.vocab_size", int, "vocabulary size"),
    "--tie-embeddings": ("model.tie_embeddings", _BOOL, "share the input embedding and the output head"),
    "--world-size": ("world.world_size", int, "ranks in the job (default: $WORLD_SIZE, else 1)"),
    "--rank": ("world.rank", int, "the rank to simulate (default: $RANK, else 0)"),
    "--local-rank": ("world.local_rank", int, "local rank (default: $LOCAL_RANK, else the rank)"),
    "--dp-replicate": ("parallel.dp_replicate", int, "HSDP replicas"),
    "--dp-shard": ("parallel.dp_shard", int, "FSDP shard group size (default: what the world leaves)"),
    "--tp": ("parallel.tp", int, "tensor parallel degree"),
    "--cp": ("parallel.cp", int, "context parallel degree (ring attention over the sequence)"),
    "--cp-rotate-method": (
        "parallel.cp_rotate_method",
        str,
        "how ring attention exchanges K/V between CP ranks: allgather|alltoall",
    ),
    "--pp": ("parallel.pp", int, "pipeline parallel degree"),
    "--pp-schedule": (
        "parallel.pp_schedule",
        str,
        "pipeline schedule: GPipe|1F1B|Interleaved1F1B|LoopedBFS|InterleavedZeroBubble|ZBVZeroBubble|DualPipeV",
    ),
    "--pp-virtual-stages": (
        "parallel.pp_virtual_stages",
        int,
        "pipeline stages per rank (default 1; 2 for multi-stage schedules)",
    ),
    "--pp-stage-layers": (
        "parallel.pp_stage_layers",
        _int_list,
        "decoder layers of each pipeline stage, comma-separated (default: even split)",
    ),
    "--ep": ("parallel.ep", int, "expert parallel degree (MoE models; divides dp_shard and num_experts)"),
    "--etp": (
        "parallel.etp",
        int,
        "expert tensor parallel degree: 1, or --tp (routed experts sharded over ep x etp)",
    ),
    # --- MoE model shape and routing scenario ---
    "--num-experts": ("model.num_experts", int, "MoE: routed experts per layer"),
    "--top-k": ("model.top_k", int, "MoE: experts per token"),
    "--moe-ffn-dim": ("model.moe_ffn_dim", int, "MoE: hidden size of each expert"),
    "--num-shared-experts": ("model.num_shared_experts", int, "MoE: always-on shared experts"),
    "--n-dense-layers": ("model.n_dense_layers", int, "MoE: leading layers with a dense FFN"),
    "--routing": ("values.routing", str, "MoE tokens per expert: balanced|hotspot|explicit"),
    "--hot-expert": ("values.hot_expert", int, "hotspot routing: the hot expert's index"),
    "--skew": ("values.skew", float, "hotspot routing: hot expert load as a multiple of the balanced load"),
    "--routing-counts": (
        "values.counts",
        _int_list,
        "explicit routing: tokens per expert of one micro batch, comma-separated",
    ),
    "--reshard-after-forward": ("parallel.reshard_after_forward", _BOOL, "FSDP2 reshard after forward"),
    "--sequence-parallel": ("parallel.sequence_parallel", _BOOL, "sequence parallel with tp > 1"),
    "--loss-parallel": ("parallel.loss_parallel", _BOOL, "loss parallel with tp > 1"),
    "--dtype": ("training.dtype", str, "dtype of stored parameters, gradients, optimizer states (bf16|fp32)"),
    "--param-dtype": ("training.param_dtype", str, "FSDP2 mixed precision param_dtype (bf16|fp32)"),
    "--reduce-dtype": ("training.reduce_dtype", str, "FSDP2 mixed precision reduce_dtype (bf16|fp32)"),
    "--seq-len": ("training.seq_len", int, "sequence length"),
    "--micro-batch-size": ("training.micro_batch_size", int, "sequences per micro batch"),
    "--num-micro-batches": (
        "training.num_micro_batches",
        int,
        "gradient accumulation steps per optimizer step; with --pp > 1, pipeline micro batches",
    ),
    "--ac": ("training.ac", str, "activation checkpointing: none|full|selective"),
    "--ac-selective": ("training.ac_selective", str, "selective AC: 'op' or every k-th layer"),
    "--optimizer": ("training.optimizer", str, "AdamW|Adam|SGD"),
    "--optimizer-impl": ("training.optimizer_impl", str, "foreach|fused|for-loop"),
    "--lr": ("training.lr", float, "learning rate"),
    "--target-device": ("target_device", str, "device whose memory is estimated (cuda|cpu)"),
    "--gpu": (
        "cuda.gpu",
        str,
        "GPU preset: capacity, SDPA choice, cuBLAS workspace (a100-40gb|a100-80gb|"
        "h100-80gb|h100-96gb|h200|b200)",
    ),
    "--alloc-conf": (
        "cuda.alloc_conf",
        str,
        "caching-allocator settings, PYTORCH_CUDA_ALLOC_CONF syntax (default: $PYTORCH_CUDA_ALLOC_CONF)",
    ),
    "--device-memory-gib": (
        "device_memory_gib",
        float,
        "capacity per device: adds headroom and an OOM verdict",
    ),
    "--output-dir": ("output_dir", str, "where rank_<r>/ reports go"),
    "--live-set-limit": ("live_set_limit", int, "blocks of the peak live set written in full"),
}
FLAG_OF = {path: flag for flag, (path, _, _) in RUN_FLAGS.items()}


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def add_job_arguments(parser: argparse.ArgumentParser) -> None:
    """``--config`` and one flag per job field, plus ``--debug``."""
    parser.add_argument("--config", metavar="job.yaml", help="YAML job description; flags override it")
    for flag, (path, typ, help_) in RUN_FLAGS.items():
        if typ is _BOOL:
            parser.add_argument(
                flag, dest=_dest(flag), action=argparse.BooleanOptionalAction, default=None, help=help_
            )
        else:
            parser.add_argument(
                flag, dest=_dest(flag), type=typ, default=None, help=help_, metavar=path.split(".")[-1]
            )
    parser.add_argument("--debug", action="store_true", help="show tracebacks")


def _set(data: dict[str, Any], path: str, value: Any) -> None:
    """Set ``a.b.c`` in nested dicts; a section that the file gave as a non-mapping is a one-line error."""
    *parents, leaf = path.split(".")
    node = data
    for depth, key in enumerate(parents):
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        elif not isinstance(child, dict):
            section = ".".join(parents[: depth + 1])
            raise ConfigError(f"{section}: must be a mapping of fields (got {child!r})")
        node = child
    node[leaf] = value


def config_from_args(args: argparse.Namespace, environ: dict[str, str] | None = None) -> JobConfig:
    """Merge file, torchrun environment and flags into a validated JobConfig (one-line ConfigError otherwise)."""

    data: dict[str, Any] = load_yaml(args.config) if args.config else {}
    flagged = {path for flag, (path, _, _) in RUN_FLAGS.items() if getattr(args, _dest(flag)) is not None}
    rank_flags = {"world.world_size", "world.rank", "world.local_rank"}
    if not rank_flags & flagged:
        for key, value in rank_from_env(environ).items():
            _set(data, f"world.{key}", value)
    for flag, (path, _, _) in RUN_FLAGS.items():
        value = getattr(args, _dest(flag))
        if value is not None:
            _set(data, path, value)
    return build_config(data)


def job_from_args(args: argparse.Namespace, environ: dict[str, str] | None = None) -> JobConfig:
    """Like :func:`config_from_args`, with the failing field's flag named beside it (``training.seq_len
    (--seq-len): ...``)."""
    try:
        return config_from_args(args, environ)
    except ConfigError as err:
        msg = str(err)
        field = msg.split(":", 1)[0]
        if field in FLAG_OF:
            msg = f"{field} ({FLAG_OF[field]}){msg[len(field) :]}"
        raise ConfigError(msg) from None
