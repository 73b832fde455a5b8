"""The job flags shared by every command that runs the built-in recipe (``run``, ``measure``): one table, so flags,
YAML keys and error messages agree.

Precedence: command-line flags > torchrun environment (rank identity only, field by field; a flag that contradicts
its variable is an error) > ``--config`` file > defaults.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from hyperdryrun.allocator.verdict import DEVICE_ERROR_FRACTION
from hyperdryrun.commands import plain_int
from hyperdryrun.commands.preflight import WORLD_SIZE, check_job_environment, check_output_dir
from hyperdryrun.config import TORCHRUN_VARS, ConfigError, JobConfig, build_config, load_yaml, rank_from_env
from hyperdryrun.models.hf import HF_PREFIX, shipped_configs
from hyperdryrun.models.registry import presets_help


def _int_list(text: str) -> list[int]:
    """``4,8,8,4`` -> [4, 8, 8, 4] (argparse reports a ValueError as a one-line usage error)."""
    return [plain_int(x) for x in text.split(",")]


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
    "--routing": (
        "values.routing",
        str,
        "MoE tokens per expert of every routed layer: balanced|hotspot|explicit|profile|bound (docs/MOE.md; "
        "--skew, --routing-counts, --routing-from, --capacity-factor alone choose theirs)",
    ),
    "--hot-expert": ("values.hot_expert", int, "hotspot/bound routing: the busiest expert's index"),
    "--skew": (
        "values.skew",
        float,
        "hotspot routing: the busiest expert of each routed layer gets S x the balanced load (tokens x top_k / "
        "experts, at most every token), the others share the rest evenly",
    ),
    "--routing-counts": (
        "values.counts",
        _int_list,
        "explicit routing: tokens per expert of one micro batch, comma-separated",
    ),
    "--routing-from": (
        "values.routing_from",
        str,
        "profile routing: per-expert loads by layer from a JSON file (a --measure report, torchtitan's "
        "tokens_per_expert by module, one list per layer; docs/MOE.md), scaled to the step's tokens x top_k",
    ),
    "--capacity-factor": (
        "values.capacity_factor",
        float,
        "bound routing: the router's capacity factor C (each expert at most C x the balanced load); without it "
        "the bound is dropless (every token to the same top_k experts)",
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
    "--ac-selective": (
        "training.ac_selective",
        str,
        "selective AC: 'op' (torchtitan's: every second matmul recomputed), 'op-save-all-matmuls', or every k-th layer",
    ),
    "--loss": (
        "training.loss",
        str,
        "model|builtin|chunked: the model's own (default; hf: models: labels= through HF's loss_function), the "
        "built-in fp32 cross entropy, or torchtitan's ChunkedLossWrapper (head and loss per chunk)",
    ),
    "--compile": (
        "training.compile",
        _BOOL,
        "compile each transformer block with torch.compile (Inductor), as torchtitan's --compile.enable does",
    ),
    "--loss-chunks": (
        "training.loss_chunks",
        int,
        "sequence chunks of --loss chunked (default 8, torchtitan's)",
    ),
    "--norm": (
        "model.norm",
        str,
        "RMSNorm: fused (nn.RMSNorm, torchtitan 0.3.0) or fp32-unfused (its 2024 releases)",
    ),
    "--fuse-qkv": (
        "model.fuse_qkv",
        _BOOL,
        "one fused q/k/v projection, torchtitan 0.3.0's (on; not MLA)",
    ),
    "--rope": (
        "model.rope",
        str,
        "RoPE table: per-layer (torchtitan 0.3.0) or shared by all layers (its 2024 releases)",
    ),
    "--moe-impl": (
        "model.moe_impl",
        str,
        "MoE router and token reordering: torchtitan (0.3.0) or torchtitan-2024 (scores before the experts)",
    ),
    "--fsdp-wrap": (
        "parallel.fsdp_wrap",
        str,
        "FSDP2 units: torchtitan (0.3.0: norm + head kept unsharded) or torchtitan-2024 (last block kept)",
    ),
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
        "capacity per device: adds headroom and a verdict (fits, at risk, OOM)",
    ),
    "--margin-gib": (
        "margin_gib",
        float,
        "verdict margin in GiB: a device peak within it under the capacity is 'at risk' and exits 1 like OOM "
        f"(default: the model's measured error, {100 * DEVICE_ERROR_FRACTION:g}%% of the capacity; 0: judge the "
        "figure as it is)",
    ),
    "--margin-pct": (
        "margin_pct",
        float,
        f"verdict margin in percent of the capacity, instead of --margin-gib (default: {100 * DEVICE_ERROR_FRACTION:g})",
    ),
    "--output-dir": ("output_dir", str, "where rank_<r>/ reports go"),
    "--live-set-limit": ("live_set_limit", int, "blocks of the peak live set written in full"),
}
FLAG_OF = {path: flag for flag, (path, _, _) in RUN_FLAGS.items()}
TARGET_FLAGS = (
    "--target-device",
    "--gpu",
    "--alloc-conf",
    "--device-memory-gib",
    "--margin-gib",
    "--margin-pct",
)
"""The device target's flags (:class:`hyperdryrun.world.target.DeviceTarget`), the same on every front door."""
ROUTING_FLAGS = (
    "--routing",
    "--hot-expert",
    "--skew",
    "--routing-counts",
    "--routing-from",
    "--capacity-factor",
)
"""The MoE routing flags (:class:`hyperdryrun.world.routing.RoutingSpec`), the same on every front door."""


def add_many_ranks_flags(parser: Any, all_ranks: str) -> None:
    """``--ranks``, ``--all-ranks`` (``all_ranks``: what makes a rank class of this front door's job) and
    ``--jobs``, the same on every front door."""
    parser.add_argument(
        "--ranks",
        metavar="0,7,56-63",
        help="simulate these ranks (a-b: a to b inclusive) in worker processes, up to --jobs at a time",
    )
    parser.add_argument(
        "--all-ranks",
        action="store_true",
        help=f"every rank of the world: one simulated per rank class ({all_ranks})",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="processes in parallel for --ranks/--all-ranks/--fit (default: the CPUs this process may use)",
    )


def add_skew_table_flag(parser: Any) -> None:
    """``--skew-table``, the same on every front door that runs one rank."""
    parser.add_argument(
        "--skew-table",
        action="store_true",
        help="MoE: also dry-run the rank at skew 1, 1.5, 2 and 4 (--routing hotspot at --hot-expert; one full "
        "step each) and print how the peak grows (written to <output-dir>/skew_table.json)",
    )


def routing_from_args(args: argparse.Namespace) -> Any:
    """The :class:`~hyperdryrun.world.routing.RoutingSpec` of the routing flags (one-line ConfigError naming the
    flag otherwise): the front doors whose job is not a :class:`JobConfig` of the built-in recipe."""
    from pydantic import ValidationError

    from hyperdryrun.config import _format_error
    from hyperdryrun.world.routing import RoutingSpec

    values = flag_data(args, ROUTING_FLAGS).get("values", {})
    try:
        spec = RoutingSpec.model_validate(values)
    except ValidationError as err:
        raise naming_flag(ConfigError("values." + _format_error(err).removeprefix("values."))) from None
    for name, why in spec.ignored().items():
        raise naming_flag(ConfigError(f"values.{name}: {getattr(spec, name)!r} {why}"))
    return spec


def add_flags(parser: Any, flags: tuple[str, ...]) -> None:
    """``run``'s ``flags`` (of :data:`RUN_FLAGS`) on another command's ``parser``, with the same help and default."""
    for flag in flags:
        path, typ, help_ = RUN_FLAGS[flag]
        parser.add_argument(flag, dest=_dest(flag), type=typ, default=None, metavar=path.split(".")[-1],
                            help=_with_default(path, help_))  # fmt: skip


def flag_data(args: argparse.Namespace, flags: tuple[str, ...]) -> dict[str, Any]:
    """The job fields ``flags`` set on the command line, as nested data for :func:`build_config`."""
    data: dict[str, Any] = {}
    for flag in flags:
        value = getattr(args, _dest(flag))
        if value is not None:
            _set(data, RUN_FLAGS[flag][0], value)
    return data


def target_from_args(args: argparse.Namespace) -> Any:
    """The :class:`~hyperdryrun.world.target.DeviceTarget` of the target flags (one-line ConfigError naming the
    flag otherwise): the front doors whose job is not a :class:`JobConfig` of the built-in recipe resolve it here."""
    from hyperdryrun.allocator.verdict import Margin

    try:
        Margin(args.margin_gib, args.margin_pct)  # its one-line messages name the flags
    except ValueError as err:
        raise ConfigError(str(err)) from None
    try:
        return build_config(flag_data(args, TARGET_FLAGS)).target
    except ConfigError as err:
        raise naming_flag(err) from None


def naming_flag(err: ConfigError) -> ConfigError:
    """``err`` with its field's flag named beside it (``training.seq_len (--seq-len): ...``) when a flag sets it."""
    msg = str(err)
    field = msg.split(":", 1)[0]
    return ConfigError(f"{field} ({FLAG_OF[field]}){msg[len(field) :]}" if field in FLAG_OF else msg)


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def config_default(path: str) -> Any:
    """The default of the job field ``a.b`` as :mod:`hyperdryrun.config` declares it (the one place it lives)."""
    node: Any = JobConfig
    for key in path.split("."):
        fields = type(node).model_fields if isinstance(node, BaseModel) else node.model_fields
        node = fields[key].default
    return node


def _with_default(path: str, help_: str) -> str:
    """``help_`` with the field's default from the config, unless the text already says what the default is."""
    if "default" in help_:
        return help_
    value = config_default(path)
    if value is None:
        shown = "the preset's" if path.startswith("model.") else "none"
    elif isinstance(value, bool):
        shown = "on" if value else "off"
    else:
        shown = str(value)
    return f"{help_} (default: {shown})"


def add_job_arguments(parser: argparse.ArgumentParser) -> None:
    """``--config`` and one flag per job field, plus ``--debug``; each help text ends with the field's default."""
    parser.add_argument("--config", metavar="job.yaml", help="YAML job description; flags override it")
    for flag, (path, typ, help_) in RUN_FLAGS.items():
        text = _with_default(path, help_)
        if typ is _BOOL:
            parser.add_argument(
                flag, dest=_dest(flag), action=argparse.BooleanOptionalAction, default=None, help=text
            )
        else:
            parser.add_argument(
                flag, dest=_dest(flag), type=typ, default=None, help=text, metavar=path.split(".")[-1]
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


def _origin(key: str, flagged: dict[str, Any], env: dict[str, int], data: dict[str, Any]) -> str:
    """Where the merged rank-identity field ``key`` came from, as a user would name it."""
    if key in flagged:
        return f"--{key.replace('_', '-')}"
    if key in env:
        return TORCHRUN_VARS[key]
    return "--config" if key in (data.get("world") or {}) else "default"


def merge_rank_identity(
    data: dict[str, Any], args: argparse.Namespace, environ: Mapping[str, str] | None
) -> None:
    """Set world size, rank and local rank in ``data`` field by field: the flag, else the torchrun variable, else
    what the file says (else the default). A flag that contradicts its variable, or a merged identity that does not
    hold together, is a one-line error naming where each value came from."""
    env = rank_from_env(environ)
    flagged = {key: getattr(args, key) for key in TORCHRUN_VARS if getattr(args, key) is not None}
    for key, var in TORCHRUN_VARS.items():
        if key in flagged and key in env and flagged[key] != env[key]:
            flag = _origin(key, flagged, env, data)
            raise ConfigError(
                f"{flag} {flagged[key]} conflicts with {var}={env[key]} in the environment: drop one, or give "
                "the same value"
            )
        if key in env and key not in flagged:
            _set(data, f"world.{key}", env[key])
    world = data.get("world")
    if not isinstance(world, dict):
        return  # a malformed section is build_config's one-line error
    merged = {key: flagged.get(key, world.get(key)) for key in TORCHRUN_VARS}
    size, rank, local = (merged[k] for k in ("world_size", "rank", "local_rank"))
    if not all(v is None or type(v) is int for v in merged.values()):
        return  # a wrong type is build_config's one-line error
    if env.keys() & TORCHRUN_VARS.keys() and rank is not None and rank >= (size or 1):
        raise ConfigError(
            f"world: rank={rank} ({_origin('rank', flagged, env, data)}) must be < "
            f"world_size={size or 1} ({_origin('world_size', flagged, env, data)})"
        )
    local_size = env.get("local_world_size")
    if local_size is not None and local is not None and local >= local_size:
        raise ConfigError(
            f"world: local_rank={local} ({_origin('local_rank', flagged, env, data)}) must be < "
            f"LOCAL_WORLD_SIZE={local_size}"
        )
    if local_size is not None and size is not None and local_size > size:
        raise ConfigError(
            f"LOCAL_WORLD_SIZE={local_size} must be <= world_size={size} "
            f"({_origin('world_size', flagged, env, data)})"
        )


def config_from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> JobConfig:
    """Merge file, torchrun environment and flags into a validated JobConfig (one-line ConfigError otherwise)."""

    data: dict[str, Any] = load_yaml(args.config) if args.config else {}
    merge_rank_identity(data, args, environ)
    for flag, (path, _, _) in RUN_FLAGS.items():
        value = getattr(args, _dest(flag))
        if value is not None:
            _set(data, path, value)
    return build_config(data)


def job_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None, warnings: list[str] | None = None
) -> JobConfig:
    """Like :func:`config_from_args`, with the failing field's flag named beside it (``training.seq_len
    (--seq-len): ...``); the environment the step reads, the output directory and the simulation's host cost
    are checked before anything runs (:mod:`hyperdryrun.commands.preflight`, :func:`check_host_cost`). Its warning
    lines go to ``warnings`` when given (a command prints them once its own checks pass, so that bad input stays one
    line), else to stderr."""
    try:
        cfg = config_from_args(args, environ)
    except ConfigError as err:
        raise naming_flag(err) from None
    check_job_environment(cfg, environ)
    check_output_dir(cfg.output_dir, "--output-dir")
    lines = check_host_cost(cfg, ranks_asked(args, cfg.world.world_size), getattr(args, "jobs", None))
    if warnings is not None:
        warnings += lines
    else:
        print_warnings(lines)
    return cfg


def print_warnings(lines: list[str]) -> None:
    for line in lines:
        sys.stderr.write(f"hyperdryrun: warning: {line}\n")


# --- host cost: what a simulation costs this machine before it starts -------------------------------------------
MESH_SECONDS_PER_RANK = 0.35e-3
"""torch 2.13's DeviceMesh creates a process group per mesh dimension per group of ranks: its setup grows with the
world size (measured: 7 s for 20,000 ranks on a 2-core machine)."""
FSDP_SECONDS_PER_SHARD = 35e-6
"""FSDP2's fully_shard splits every parameter tensor into one chunk per rank of its shard group (measured: 14 s
for the 21 tensors of llama-tiny over 20,000 ranks)."""
WARN_SECONDS = 60.0
WARN_RANKS = 64
"""More ranks asked for than this (``--all-ranks``, ``--ranks``): a warning line, each is a whole simulation."""


def setup_seconds(cfg: JobConfig) -> float:
    """A cheap estimate of the seconds the simulated world's setup takes on a 2-core machine, from the layout:
    DeviceMesh's process groups and FSDP2's per-rank parameter chunks (the parts that grow with the world)."""
    m, p = cfg.model.args(), cfg.parallel
    tensors = (
        10 * -(-m.n_layers // p.pp) + 3
    )  # per decoder layer about ten (projections, norms), and the ends
    return cfg.world.world_size * MESH_SECONDS_PER_RANK + tensors * p.dp_shard * p.cp * FSDP_SECONDS_PER_SHARD


def ranks_asked(args: argparse.Namespace, world_size: int) -> int:
    """How many ranks the command will simulate (``--all-ranks``, ``--ranks``; 1 otherwise)."""
    if getattr(args, "all_ranks", False):
        return world_size
    ranks = getattr(args, "ranks", None)
    return len({r.strip() for r in ranks.split(",")}) if ranks else 1


def check_host_cost(cfg: JobConfig, ranks: int = 1, jobs: int | None = None) -> list[str]:
    """Refuse (one-line ConfigError) a world beyond :data:`WORLD_SIZE`; return the warning lines for a run whose
    setup alone takes more than a minute or that simulates many ranks."""
    try:
        limit = WORLD_SIZE.value()
    except ValueError as err:
        raise ConfigError(str(err)) from None
    seconds = setup_seconds(cfg)
    size = cfg.world.world_size
    if size > limit:
        raise ConfigError(
            f"world.world_size={size} is more than the limit of {limit} ranks ({WORLD_SIZE.hint}): the "
            f"simulated world's setup grows with it (DeviceMesh process groups, FSDP2 shards), about "
            f"{seconds / 60:,.0f} minutes here"
        )
    warnings = []
    if seconds > WARN_SECONDS:
        warnings.append(
            f"world.world_size={size} with dp_shard={cfg.parallel.dp_shard}: setting up the simulated world "
            f"(DeviceMesh process groups, FSDP2 shards) takes about {seconds:,.0f} s per rank simulated"
        )
    if ranks > WARN_RANKS:
        at = f"{jobs} at a time" if jobs else "as many at a time as there are cores"
        warnings.append(f"{ranks} ranks to simulate, each a whole simulation in a worker process ({at})")
    return warnings
