"""GPU calibration: the real step on a CUDA GPU beside the dry run of the same configurations, in one table.

Usage: ``PYTHONPATH=src python scripts/gpu_calibrate.py [--device cuda|cpu] [--rows N] [--json out.json]
[--accuracy docs/ACCURACY.md]``.
On a CUDA machine each configuration runs for real on the GPU (world 1 in process; for world > 1 the chosen rank
with real CUDA tensors and the fake process group), after one warm-up step, with
``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` reset before the measured step and the process's
``nvidia-smi`` used memory read after it (the cache is kept, so it holds the reserved peak unless the allocator
released segments); the dry run of the same configuration uses ``target_device: cuda`` on the same GPU preset and
gives the three figures to compare: allocated, reserved, and device bytes without NCCL (the fake process group
creates no communicator). The table goes into ``docs/ACCURACY.md`` (between the ``gpu-calibration`` markers), so
one run on a GPU machine records it. Without CUDA (``--device cpu``, the default there) the same rows run the CPU
path: the measured peak comes from the profiler (``hyperdryrun.measure``), the dry run uses ``target_device: cpu``,
and there are no reserved or device figures; nothing is written to ``docs/ACCURACY.md`` unless asked.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
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


ACCURACY = Path(__file__).resolve().parents[1] / "docs" / "ACCURACY.md"
BEGIN, END = "<!-- gpu-calibration:begin -->", "<!-- gpu-calibration:end -->"
"""The markers around the GPU table in docs/ACCURACY.md: :func:`write_accuracy` replaces what lies between."""


def nvidia_smi_used(pid: int | None = None) -> int | None:
    """Device memory ``nvidia-smi`` shows for process ``pid`` (default: this one), in bytes; None without it."""
    pid = os.getpid() if pid is None else pid
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid) and parts[1].isdigit():
            return int(parts[1]) * 2**20
    return None


def gpu_preset_name() -> str | None:
    """The GPU preset matching this machine's GPU (by name and memory), for the dry run's capacity and kernels."""
    from hyperdryrun.world.gpus import GPU_PRESETS

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    name = props.name.lower()
    family = next((f for f in ("a100", "h100", "h200", "b200") if f in name), None)
    candidates = [p for p in GPU_PRESETS.values() if family and p.name.startswith(family)]
    # the presets carry torch's total_memory, which moves with the driver by ~0.1%: the nearest one is this card
    nearest = min(candidates, key=lambda p: abs(p.capacity_bytes - props.total_memory), default=None)
    return nearest.name if nearest else None


def measure_cuda(cfg: Any) -> dict[str, int | None]:
    """Real step on the GPU: max allocated/reserved bytes of the measured step (after one warm-up step), and the
    process's nvidia-smi used memory after it."""
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
    torch.cuda.synchronize()
    return {
        "max_allocated": torch.cuda.max_memory_allocated(),
        "max_reserved": torch.cuda.max_memory_reserved(),
        "smi_used": nvidia_smi_used(),
        "profiler_peak": trace.peak,
    }


def measure_cpu(cfg: Any) -> dict[str, int | None]:
    from hyperdryrun.measure.step import measure_job

    trace = measure_job(cfg, capture_stacks=False)
    return {
        "max_allocated": trace.metadata["kernel_scratch"]["peak_bytes_excluding"],
        "max_reserved": trace.peak,
        "smi_used": None,
        "profiler_peak": trace.peak,
    }


def dry_figures(cfg: Any) -> dict[str, int | None]:
    """The dry run's tensor peak and, for a CUDA target, its allocated, reserved and device bytes (device without
    the NCCL line: a fake process group creates no communicator on the GPU either)."""
    from hyperdryrun.recipe import run_job
    from hyperdryrun.report.build import NCCL_LINE, device_memory_of

    trace = run_job(cfg, capture_stacks=False)
    dm = device_memory_of(trace)
    if dm is None:
        return {"dry_peak": trace.peak, "dry_allocated": None, "dry_reserved": None, "dry_device": None}
    nccl = sum(c.size for c in dm.outside if c.line == NCCL_LINE)
    return {
        "dry_peak": trace.peak,
        "dry_allocated": dm.peak_allocated,
        "dry_reserved": dm.peak_reserved,
        "dry_device": dm.peak_device - nccl,
    }


def _pct(real: int | None, dry: int | None) -> float | None:
    return None if not real or dry is None else (real - dry) / real * 100


def run(rows: list[tuple[str, dict[str, Any]]], device: str, gpu: str | None = None) -> list[dict[str, Any]]:
    """One result dict per configuration: the dry run's figures and the measured ones."""
    out = []
    for name, over in rows:
        extra: dict[str, Any] = {"target_device": device}
        if device == "cuda" and gpu:
            extra["cuda"] = {"gpu": gpu}
        cfg = build_config(merge(over, extra))
        t0 = time.perf_counter()
        dry = dry_figures(cfg)
        t1 = time.perf_counter()
        real = measure_cuda(cfg) if device == "cuda" else measure_cpu(cfg)
        t2 = time.perf_counter()
        out.append(
            {
                "config": name,
                "device": device,
                **dry,
                **real,
                "diff_allocated": real["max_allocated"] - dry["dry_peak"],
                "diff_pct": _pct(real["max_allocated"], dry["dry_peak"]),
                "diff_reserved_pct": _pct(real["max_reserved"], dry["dry_reserved"]),
                "diff_device_pct": _pct(real["smi_used"], dry["dry_device"]),
                "dry_s": round(t1 - t0, 2),
                "real_s": round(t2 - t1, 2),
            }
        )
        print(f"  done: {name}", file=sys.stderr, flush=True)
    return out


def _b(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def _p(x: float | None) -> str:
    return "-" if x is None else f"{x:+.2f}%"


def table(results: list[dict[str, Any]]) -> str:
    """Markdown table; on the CPU path 'max allocated' is the profiler peak without kernel scratch, and there are no
    reserved or device figures on the dry-run side."""
    lines = [
        "| config | device | dry-run peak (B) | max allocated (B) | diff (B) | diff % | dry-run allocated (B) "
        "| dry-run reserved (B) | max reserved (B) | reserved diff % | dry-run device w/o NCCL (B) "
        "| nvidia-smi used (B) | device diff % |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['config']} | {r['device']} | {r['dry_peak']:,} | {r['max_allocated']:,} "
            f"| {r['diff_allocated']:+,} | {_p(r['diff_pct'])} | {_b(r['dry_allocated'])} "
            f"| {_b(r['dry_reserved'])} | {_b(r['max_reserved'])} | {_p(r['diff_reserved_pct'])} "
            f"| {_b(r['dry_device'])} | {_b(r['smi_used'])} | {_p(r['diff_device_pct'])} |"
        )
    return "\n".join(lines)


def write_accuracy(path: Path, heading: str, table_text: str) -> None:
    """Put ``heading`` and ``table_text`` between the gpu-calibration markers of ``path`` (appended, with the
    markers, when the file has none); the rest of the file is kept as it is."""
    from hyperdryrun.report.writer import atomic_write

    text = path.read_text()
    block = f"{BEGIN}\n{heading}\n\n{table_text}\n{END}"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        tail = rest.split(END, 1)[1]
        new = head + block + tail
    else:
        new = text.rstrip("\n") + "\n\n" + block + "\n"
    atomic_write(path, new)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument("--tiny", action="store_true", help="llama-tiny rows (tests, CPU)")
    parser.add_argument("--rows", type=int, default=None, help="only the first N configurations")
    parser.add_argument("--json", default=None, help="also write the results as JSON here")
    parser.add_argument(
        "--accuracy",
        default=None,
        help="write the table into this ACCURACY.md (default on the cuda path: docs/ACCURACY.md)",
    )
    parser.add_argument("--no-accuracy", action="store_true", help="do not write the table into ACCURACY.md")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_calibrate: error: --device cuda but torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    rows = (TINY if args.tiny else CONFIGS)[: args.rows]
    gpu = gpu_preset_name() if args.device == "cuda" else None
    results = run(rows, args.device, gpu)
    if args.device == "cuda":
        heading = (
            f"GPU: {torch.cuda.get_device_name()} (dry run as --gpu {gpu or 'h100-80gb'}), torch {torch.__version__}, "
            "one rank, fake process group for world > 1."
        )
    else:
        heading = f"CPU path (no GPU): torch {torch.__version__}; no reserved or device figures."
    text = table(results)
    print(heading)
    print(text)
    if args.json:
        from hyperdryrun.report.writer import atomic_write

        atomic_write(Path(args.json), json.dumps(results, indent=2) + "\n")
    target = args.accuracy or (str(ACCURACY) if args.device == "cuda" else None)
    if target and not args.no_accuracy:
        write_accuracy(Path(target), heading, text)
        print(f"wrote the table into {target}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
