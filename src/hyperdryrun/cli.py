"""``hyperdryrun`` command line: thin — parse, build the config, call the library, print.

Precedence: command-line flags > torchrun environment (rank identity only) > ``--config`` file > defaults.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Sequence
from typing import Any

from hyperdryrun import __version__

# flag -> (config path, type, help). One table, so flags, YAML keys and error messages agree.
_BOOL = "bool"
RUN_FLAGS: dict[str, tuple[str, Any, str]] = {
    "--model": (
        "model.name",
        str,
        "model preset (llama3-8b, llama3-70b, llama3-405b, llama-debug, llama-tiny)",
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
    "--cp": ("parallel.cp", int, "context parallel degree (not supported yet)"),
    "--pp": ("parallel.pp", int, "pipeline parallel degree (not supported yet)"),
    "--ep": ("parallel.ep", int, "expert parallel degree (not supported yet)"),
    "--etp": ("parallel.etp", int, "expert tensor parallel degree (not supported yet)"),
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
        "gradient accumulation steps per optimizer step",
    ),
    "--ac": ("training.ac", str, "activation checkpointing: none|full|selective"),
    "--ac-selective": ("training.ac_selective", str, "selective AC: 'op' or every k-th layer"),
    "--optimizer": ("training.optimizer", str, "AdamW|Adam|SGD"),
    "--optimizer-impl": ("training.optimizer_impl", str, "foreach|fused|for-loop"),
    "--lr": ("training.lr", float, "learning rate"),
    "--target-device": ("target_device", str, "device whose memory is estimated (cuda|cpu)"),
    "--device-memory-gib": (
        "device_memory_gib",
        float,
        "capacity per device: adds headroom and an OOM verdict",
    ),
    "--output-dir": ("output_dir", str, "where rank_<r>/ reports go"),
    "--live-set-limit": ("live_set_limit", int, "blocks of the peak live set written in full"),
}
FLAG_OF = {path: flag for flag, (path, _, _) in RUN_FLAGS.items()}


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"hyperdryrun: error: {message}\n")
        raise SystemExit(2)


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="hyperdryrun", description="Per-rank accelerator memory of one training step."
    )
    parser.add_argument("--version", action="version", version=f"hyperdryrun {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    run = sub.add_parser("run", help="dry-run one training step of the built-in Llama recipe for one rank")
    run.add_argument("--config", metavar="job.yaml", help="YAML job description; flags override it")
    for flag, (path, typ, help_) in RUN_FLAGS.items():
        if typ is _BOOL:
            run.add_argument(
                flag, dest=_dest(flag), action=argparse.BooleanOptionalAction, default=None, help=help_
            )
        else:
            run.add_argument(
                flag, dest=_dest(flag), type=typ, default=None, help=help_, metavar=path.split(".")[-1]
            )
    run.add_argument("--no-stacks", action="store_true", help="do not capture Python stacks (faster)")
    run.add_argument("--quiet", action="store_true", help="print only the peak line")
    run.add_argument("--debug", action="store_true", help="show tracebacks")
    return parser


def _set(data: dict[str, Any], path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    node = data
    for key in parents:
        child = node.get(key)
        if not isinstance(child, dict):
            child = node[key] = {} if child is None else child
        node = child
    node[leaf] = value


def config_from_args(args: argparse.Namespace, environ: dict[str, str] | None = None):
    """Merge file, torchrun environment and flags into a validated JobConfig (one-line ConfigError otherwise)."""
    from hyperdryrun.config import build_config, load_yaml, rank_from_env

    data: dict[str, Any] = load_yaml(args.config) if args.config else {}
    flagged = {path for flag, (path, _, _) in RUN_FLAGS.items() if getattr(args, _dest(flag)) is not None}
    if "world" in data and not isinstance(data["world"], dict):
        data["world"] = {}  # let validation name it below
    rank_flags = {"world.world_size", "world.rank", "world.local_rank"}
    if not rank_flags & flagged:
        for key, value in rank_from_env(environ).items():
            _set(data, f"world.{key}", value)
    for flag, (path, _, _) in RUN_FLAGS.items():
        value = getattr(args, _dest(flag))
        if value is not None:
            _set(data, path, value)
    return build_config(data)


def _run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from hyperdryrun.config import ConfigError
    from hyperdryrun.engine import SimulationError
    from hyperdryrun.recipe import job_metadata, run_job
    from hyperdryrun.report import blocks_csv, build_report, error_report, write_error_report, write_reports
    from hyperdryrun.report.console import print_summary

    try:
        cfg = config_from_args(args)
    except ConfigError as err:
        msg = str(err)
        field = msg.split(":", 1)[0]
        if field in FLAG_OF:
            msg = f"{field} ({FLAG_OF[field]}){msg[len(field) :]}"
        return _fail(msg, err, args.debug)
    try:
        trace = run_job(cfg, capture_stacks=not args.no_stacks)
    except SimulationError as err:
        meta = _safe_metadata(cfg, job_metadata)
        path = write_error_report(error_report(err.stage, err.error, meta), cfg.output_dir, cfg.world.rank)
        return _fail(
            f"{err.stage} failed: {type(err.error).__name__}: {err.error} (report: {path})", err, args.debug
        )
    report = build_report(trace, cfg.device_memory_gib, cfg.live_set_limit)
    paths = write_reports(report, blocks_csv(trace), cfg.output_dir, cfg.world.rank)
    console = Console()
    if args.quiet:
        s = report["summary"]
        console.print(
            f"peak {s['peak_gib']:.2f} GiB ({s['peak_phase']}); {s.get('verdict', '')}".rstrip("; ")
        )
    else:
        print_summary(report, [str(p) for p in paths], console)
    return 1 if report["summary"].get("oom") else 0


def _safe_metadata(cfg: Any, job_metadata: Any) -> dict[str, Any]:
    try:
        return job_metadata(cfg)
    except Exception:
        return {}


def _fail(message: str, err: BaseException, debug: bool) -> int:
    if debug:
        traceback.print_exception(err)
    from hyperdryrun.report.build import one_line

    sys.stderr.write(f"hyperdryrun: error: {one_line(message)}\n")
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "run":
        return _run(args)
    return 2  # pragma: no cover - argparse enforces a known command


if __name__ == "__main__":
    raise SystemExit(main())
