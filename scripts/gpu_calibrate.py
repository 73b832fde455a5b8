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

The GPU table of docs/ACCURACY.md is a record's: ``--from-record docs/gpu/h200_measured.json`` (no GPU needed) dry-runs
each row of a record that a GPU run wrote (``--device cuda`` writes one with ``--record-out``: the rows' configurations,
what the GPU measured, the torch version and the device's facts) and puts GPU and dry run side by side: allocated vs
``max_memory_allocated``, reserved vs ``max_memory_reserved``, device without NCCL vs ``nvidia-smi``. On a GPU machine
``--device cuda`` measures the record's rows (default: docs/gpu/h200_measured.json) again, so one command refreshes
both the record and the table.
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


ROOT = Path(__file__).resolve().parents[1]
ACCURACY = ROOT / "docs" / "ACCURACY.md"
GPU_RECORD = ROOT / "docs" / "gpu" / "h200_measured.json"
"""The H200 record (a copy of ../shared/gpu/h200_measured.json: six jobs of the built-in recipe on torch 2.11)."""
TOLERANCE = {"allocated": 0.01, "reserved": 0.03, "device": 0.03}
"""How far the dry run may be from the GPU, as a fraction of the GPU's figure (issue 20's bar, tested in CI)."""
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


def record_rows(record: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """A record's rows as (name, configuration override), in the record's order."""
    return [(name, row["over"]) for name, row in record["rows"].items()]


def load_record(path: Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def gpu_config(over: dict[str, Any], gpu: str | None) -> Any:
    """A record row's job for a CUDA target: ``target_device: cuda`` and the GPU preset, as the record ran it."""
    extra: dict[str, Any] = {"target_device": "cuda"}
    if gpu:
        extra["cuda"] = {"gpu": gpu}
    return build_config(merge(over, extra))


def compare_record(record: dict[str, Any], names: list[str] | None = None) -> list[dict[str, Any]]:
    """Dry-run each row of ``record`` (only ``names`` if given) on this torch and set it beside what the GPU measured:
    one dict per row with both sides' allocated, reserved and device bytes and their differences."""
    gpu = record.get("gpu_preset", "h200")
    out = []
    for name, over in record_rows(record):
        if names and name not in names:
            continue
        real = record["rows"][name]
        t0 = time.perf_counter()
        dry = dry_figures(gpu_config(over, gpu))
        out.append(
            {
                "row": name,
                **dry,
                "max_allocated": real["max_allocated"],
                "max_reserved": real["max_reserved"],
                "smi_used": real["smi_used"],
                "gpu_torch": real.get("torch"),
                "diff": {
                    "allocated": _frac(real["max_allocated"], dry["dry_allocated"]),
                    "reserved": _frac(real["max_reserved"], dry["dry_reserved"]),
                    "device": _frac(real["smi_used"], dry["dry_device"]),
                },
                "dry_s": round(time.perf_counter() - t0, 1),
            }
        )
        print(f"  done: {name}", file=sys.stderr, flush=True)
    return out


def _frac(real: int | None, dry: int | None) -> float | None:
    """(dry - real) / real: positive where the dry run is above the GPU."""
    return None if not real or dry is None else (dry - real) / real


def outside_tolerance(results: list[dict[str, Any]]) -> list[str]:
    """``row: figure +x.xx%`` for every figure outside :data:`TOLERANCE`."""
    return [
        f"{r['row']}: {k} {100 * d:+.2f}%"
        for r in results
        for k, d in r["diff"].items()
        if d is None or abs(d) > TOLERANCE[k]
    ]


def record_table(results: list[dict[str, Any]]) -> str:
    """Markdown: per row, GPU vs dry run for allocated, reserved and device (w/o NCCL) bytes, and the differences
    (dry run minus GPU, in % of the GPU's figure)."""
    lines = [
        "| row | GPU allocated | dry run | diff | GPU reserved | dry run | diff | nvidia-smi | dry run w/o NCCL "
        "| diff |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        d = r["diff"]
        lines.append(
            f"| {r['row']} | {_b(r['max_allocated'])} | {_b(r['dry_allocated'])} | {_f(d['allocated'])} "
            f"| {_b(r['max_reserved'])} | {_b(r['dry_reserved'])} | {_f(d['reserved'])} "
            f"| {_b(r['smi_used'])} | {_b(r['dry_device'])} | {_f(d['device'])} |"
        )
    return "\n".join(lines)


def record_heading(record: dict[str, Any], path: Path) -> str:
    gpu_torch = sorted({row.get("torch", "?") for row in record["rows"].values()})
    return (
        f"GPU: {record.get('machine', '?')}; measured with torch {', '.join(gpu_torch)} "
        f"(`{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}`). Dry run: torch {torch.__version__}, "
        f"`--gpu {record.get('gpu_preset', 'h200')}`. Differences are (dry run - GPU) / GPU; the bar is "
        + ", ".join(f"{k} {100 * v:g}%" for k, v in TOLERANCE.items())
        + "."
    )


def _f(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.2f}%"


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


def measure_record(rows: list[tuple[str, dict[str, Any]]], gpu: str | None) -> dict[str, Any]:
    """Measure ``rows`` on this GPU (:func:`measure_cuda`): a record in the format of docs/gpu/h200_measured.json."""
    props = torch.cuda.get_device_properties(0)
    measured = {}
    for name, over in rows:
        t0 = time.perf_counter()
        real = measure_cuda(gpu_config(over, gpu))
        measured[name] = {
            "row": name,
            "over": over,
            "torch": torch.__version__,
            **real,
            "seconds": round(time.perf_counter() - t0, 1),
        }
        print(f"  measured: {name}", file=sys.stderr, flush=True)
    return {
        "machine": f"one {props.name}, torch {torch.__version__}, CUDA {torch.version.cuda}",
        "gpu_preset": gpu,
        "method": "scripts/gpu_calibrate.py --device cuda: measure_cuda(cfg) per row (one warm-up step, peak "
        "counters reset before the measured step; smi_used: nvidia-smi used memory of the process after the step)",
        "device_facts": {"total_memory_bytes": props.total_memory},
        "rows": measured,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument("--tiny", action="store_true", help="llama-tiny rows (tests, CPU)")
    parser.add_argument(
        "--small",
        action="store_true",
        help="the small-shape rows (CONFIGS) instead of the record's rows (cuda)",
    )
    parser.add_argument("--rows", type=int, default=None, help="only the first N configurations")
    parser.add_argument("--json", default=None, help="also write the results as JSON here")
    parser.add_argument(
        "--from-record",
        nargs="?",
        const=str(GPU_RECORD),
        default=None,
        metavar="RECORD",
        help="no GPU needed: dry-run the rows of a GPU record (default docs/gpu/h200_measured.json) and write "
        "the GPU table (allocated, reserved, device) into docs/ACCURACY.md; exit 1 if a row is outside the bar",
    )
    parser.add_argument(
        "--record-out", default=None, help="cuda: write what the GPU measured as a record (the rows' format)"
    )
    parser.add_argument(
        "--rows-from",
        default=str(GPU_RECORD),
        metavar="RECORD",
        help="cuda: measure the rows of this record (default docs/gpu/h200_measured.json; "
        "docs/gpu/compile_rows.json holds the compiled rows no GPU has measured yet)",
    )
    parser.add_argument(
        "--accuracy",
        default=None,
        help="write the table into this ACCURACY.md (default on the cuda and record paths: docs/ACCURACY.md)",
    )
    parser.add_argument("--no-accuracy", action="store_true", help="do not write the table into ACCURACY.md")
    args = parser.parse_args(argv)
    from hyperdryrun.report.writer import atomic_write

    if args.from_record:
        path = Path(args.from_record).resolve()
        record = load_record(path)
        names = [n for n, _ in record_rows(record)][: args.rows]
        return _record_table(record, path, names, args)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_calibrate: error: --device cuda but torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    if args.device == "cuda" and not (args.tiny or args.small):
        # The record's rows, measured again on this GPU; the table compares the dry run with the new record.
        gpu = gpu_preset_name()
        record = measure_record(record_rows(load_record(Path(args.rows_from)))[: args.rows], gpu)
        out = Path(args.record_out or "gpu_record.json")
        atomic_write(out, json.dumps(record, indent=1) + "\n")
        print(f"wrote the record {out}", file=sys.stderr)
        return _record_table(record, out.resolve(), None, args)
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
        atomic_write(Path(args.json), json.dumps(results, indent=2) + "\n")
    target = args.accuracy or (str(ACCURACY) if args.device == "cuda" else None)
    if target and not args.no_accuracy:
        write_accuracy(Path(target), heading, text)
        print(f"wrote the table into {target}", file=sys.stderr)
    return 0


def _record_table(
    record: dict[str, Any], path: Path, names: list[str] | None, args: argparse.Namespace
) -> int:
    """Dry-run a record's rows, print and write the GPU table; 1 if a row is outside :data:`TOLERANCE`."""
    from hyperdryrun.report.writer import atomic_write

    results = compare_record(record, names)
    heading, text = record_heading(record, path), record_table(results)
    print(heading)
    print(text)
    if args.json:
        atomic_write(Path(args.json), json.dumps(results, indent=2) + "\n")
    if not args.no_accuracy:
        target = Path(args.accuracy or ACCURACY)
        write_accuracy(target, heading, text)
        print(f"wrote the table into {target}", file=sys.stderr)
    bad = outside_tolerance(results)
    for line in bad:
        print(f"outside the bar: {line}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
