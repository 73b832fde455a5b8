"""GPU calibration: the real step on a CUDA GPU beside the dry run of the same configurations, in one table.

Usage: ``PYTHONPATH=src python scripts/gpu_calibrate.py [--device cuda|cpu] [--rows N] [--json out.json]``.
On a CUDA machine each configuration runs for real on the GPU (world 1 in process; for world > 1 the chosen rank
with real CUDA tensors and the fake process group), after one warm-up step, with
``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` reset before the measured step; the dry run of the
same configuration uses ``target_device: cuda``. Without CUDA (``--device cpu``, the default there) the same rows
run the CPU path: the measured peak comes from the profiler (``hyperdryrun.measure``) and the dry run uses
``target_device: cpu``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch

from hyperdryrun.config import build_config
from hyperdryrun.measure.accuracy import merge

_SMALL_8B: dict[str, Any] = {
    "name": "llama3-8b",
    "dim": 1024,
    "n_layers": 2,
    "n_heads": 8,
    "n_kv_heads": 2,
    "ffn_dim": 3584,
    "vocab_size": 32768,
}
"""The Llama 3 8B layout cut to 2 layers of width 1024: fits one GPU with room to spare."""

CONFIGS: list[tuple[str, dict[str, Any]]] = [
    (
        "llama3-8b shape, 2 layers, dim 1024, seq 1024, w1 bf16 params",
        {"model": _SMALL_8B, "training": {"seq_len": 1024}},
    ),
    (
        "same, AC=full, 2 micro batches",
        {"model": _SMALL_8B, "training": {"seq_len": 1024, "ac": "full", "num_micro_batches": 2}},
    ),
    (
        "same, w8 FSDP rank 0 (fake PG)",
        {"model": _SMALL_8B, "training": {"seq_len": 1024}, "world": {"world_size": 8}},
    ),
    (
        "same, w8 FSDP4 x TP2 rank 0 (fake PG)",
        {
            "model": _SMALL_8B,
            "training": {"seq_len": 1024},
            "world": {"world_size": 8},
            "parallel": {"tp": 2},
        },
    ),
]
"""Shapes that fit one GPU and exercise the recipe's parallelisms; ``--tiny`` replaces them (tests, CPU)."""

TINY: list[tuple[str, dict[str, Any]]] = [
    ("llama-tiny w1", {"model": {"name": "llama-tiny"}, "training": {"seq_len": 32}}),
    (
        "llama-tiny w2 FSDP",
        {"model": {"name": "llama-tiny"}, "training": {"seq_len": 32}, "world": {"world_size": 2}},
    ),
]


def measure_cuda(cfg: Any) -> dict[str, int]:
    """Real step on the GPU: max allocated/reserved bytes of the measured step (after one warm-up step)."""
    from hyperdryrun.measure.step import measure_job

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    # measure_job runs the warm-up and then the profiled step; the peak counters are reset between them by the
    # hook below so that they cover the measured step only.
    from hyperdryrun.measure import step as step_mod

    orig = step_mod._profile_step

    def reset_then_profile(*args: Any) -> Any:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        out = orig(*args)
        torch.cuda.synchronize()
        return out

    step_mod._profile_step = reset_then_profile
    try:
        trace = measure_job(cfg, capture_stacks=False, device="cuda")
    finally:
        step_mod._profile_step = orig
    return {
        "max_allocated": torch.cuda.max_memory_allocated(),
        "max_reserved": torch.cuda.max_memory_reserved(),
        "profiler_peak": trace.peak,
    }


def measure_cpu(cfg: Any) -> dict[str, int]:
    from hyperdryrun.measure.step import measure_job

    trace = measure_job(cfg, capture_stacks=False)
    return {
        "max_allocated": trace.metadata["kernel_scratch"]["peak_bytes_excluding"],
        "max_reserved": trace.peak,
        "profiler_peak": trace.peak,
    }


def run(rows: list[tuple[str, dict[str, Any]]], device: str) -> list[dict[str, Any]]:
    """One result dict per configuration: dry-run peak and the measured figures."""
    from hyperdryrun.recipe import run_job

    out = []
    for name, over in rows:
        cfg = build_config(merge(over, {"target_device": device}))
        t0 = time.perf_counter()
        dry = run_job(cfg, capture_stacks=False).peak
        t1 = time.perf_counter()
        real = measure_cuda(cfg) if device == "cuda" else measure_cpu(cfg)
        t2 = time.perf_counter()
        out.append(
            {
                "config": name,
                "device": device,
                "dry_peak": dry,
                **real,
                "diff_allocated": real["max_allocated"] - dry,
                "diff_pct": (real["max_allocated"] - dry) / real["max_allocated"] * 100,
                "dry_s": round(t1 - t0, 2),
                "real_s": round(t2 - t1, 2),
            }
        )
        print(f"  done: {name}", file=sys.stderr, flush=True)
    return out


def table(results: list[dict[str, Any]]) -> str:
    """Markdown table; on the CPU path 'max allocated' is the profiler peak without kernel scratch."""
    lines = [
        "| config | device | dry-run peak (B) | max allocated (B) | max reserved (B) | diff (B) | diff % |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['config']} | {r['device']} | {r['dry_peak']:,} | {r['max_allocated']:,} | {r['max_reserved']:,} "
            f"| {r['diff_allocated']:+,} | {r['diff_pct']:+.2f}% |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument("--tiny", action="store_true", help="llama-tiny rows (tests, CPU)")
    parser.add_argument("--rows", type=int, default=None, help="only the first N configurations")
    parser.add_argument("--json", default=None, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_calibrate: error: --device cuda but torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    rows = (TINY if args.tiny else CONFIGS)[: args.rows]
    results = run(rows, args.device)
    if args.device == "cuda":
        print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(table(results))
    if args.json:
        from pathlib import Path

        from hyperdryrun.report.writer import atomic_write

        atomic_write(Path(args.json), json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
