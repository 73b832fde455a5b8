"""Cost of a HyperDryRun dry run against its floor (the untracked fake step) and against torch's own trackers.

Each variant runs in its own subprocess (so its host peak RSS is its own): setup once, one warm-up step, then
``--reps`` timed steps; every figure is the median of the reps. Ratios are to the floor of the same depth, measured
in the same invocation of this script. The job is the Llama-3-8B shape at seq 8192, micro batch 1, AC none, FSDP2
over 8 simulated ranks (rank 0), in the recipe's default precision: fp32 sharded master parameters, gradients and
AdamW states, with FSDP2 mixed precision ``param_dtype=bf16, reduce_dtype=fp32`` for compute.

    PYTHONPATH=src python benchmarks/bench.py --layers 4,8,16,32 --reps 3 --out docs/PERFORMANCE.md
    PYTHONPATH=src python benchmarks/bench.py --smoke          # tiny model, one depth, one rep: it must run
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from commands import timed  # benchmarks/commands.py (this script's folder): one process's CPU and wall time

VARIANTS = ("floor", "track", "full", "memtracker", "fsdpmemtracker")
VARIANT_HELP = {
    "floor": "untracked fake step: same world, same fake mode, no tracker",
    "track": "HyperDryRun tracked step without Python stacks",
    "full": "HyperDryRun full dry run: tracked step with stacks + blocks + report build + writing",
    "memtracker": "torch.distributed._tools.mem_tracker.MemTracker on the same step",
    "fsdpmemtracker": "torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker on the same step",
}
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
GIB = 1024**3


# ----------------------------------------------------------------------------------------------- worker
def _job(model: str, layers: int, seq: int, output_dir: str):
    from hyperdryrun.config import build_config

    return build_config(
        {
            "model": {"name": model, "n_layers": layers},
            "world": {"world_size": 8, "rank": 0},
            # torchtitan 2024's FSDP2 units: torch 2.13's FSDPMemTracker raises "does not support memory tracking
            # for multiple iterative calls" on torchtitan 0.3.0's unit of norm + output (two modules, one state),
            # and every variant must run the same step.
            "parallel": {"dp_shard": 8, "fsdp_wrap": "torchtitan-2024"},
            "training": {"seq_len": seq, "micro_batch_size": 1, "ac": "none"},
            "output_dir": output_dir,
        }
    )


def _max_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class _Lap:
    """Stage stopwatch: ``lap(name)`` stores wall ``name_s`` and CPU ``name_cpu`` since the previous lap."""

    def __init__(self, timings: dict[str, float]) -> None:
        self.timings = timings
        self.restart()

    def restart(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def __call__(self, name: str) -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        self.timings[name + "_s"], self.timings[name + "_cpu"] = wall - self.wall, cpu - self.cpu
        self.wall, self.cpu = wall, cpu


class _OpCounter:
    """Stands in for the tracker in the fake mode's hook to count every op that reaches it (one untimed step)."""

    active = True

    def __init__(self) -> None:
        self.ops = 0

    def begin_op(self) -> None:
        self.ops += 1

    def end_op(self, *args: Any) -> None:
        pass


def worker(variants: list[str], model: str, layers: int, seq: int, reps: int) -> dict[str, Any]:
    """Setup once, then ``reps + 1`` rounds (round 0 is the warm-up) that each run every variant once, back to back,
    so a burst of load from elsewhere hits all variants of a round alike. Returns per-variant medians and counts."""
    import torch

    from hyperdryrun.engine import (
        JobPlan,
        dtensor_speedups,
        micro_batch_step,
        prepare,
        step_trace,
        traced_step,
    )
    from hyperdryrun.parallel import parallelize_llama
    from hyperdryrun.recipe import (
        batch_fn,
        job_metadata,
        llama_loss,
        loss_context,
        model_fn,
        optimizer,
        parallelize_options,
    )
    from hyperdryrun.report import blocks_csv, build_report, write_reports
    from hyperdryrun.world import SimulatedWorld
    from hyperdryrun.world.patches import PatchSet

    out_dir = tempfile.TemporaryDirectory(prefix="hdr_bench_")  # removed when this process exits
    cfg = _job(model, layers, seq, out_dir.name)
    n_mb = cfg.training.num_micro_batches
    step_fn = micro_batch_step(llama_loss, n_mb, loss_context(cfg))
    make_batch = batch_fn(cfg)
    res: dict[str, Any] = {"layers": layers, "variants": {v: {} for v in variants}}
    samples: dict[str, dict[str, list[float]]] = {v: {} for v in variants}

    def run_once(variant: str, out: dict[str, Any]) -> dict[str, float]:
        timings: dict[str, float] = {}
        lap = _Lap(timings)
        if variant == "floor":
            step_fn(model_, optim, (make_batch(i, device) for i in range(n_mb)))
            lap("step")
            return timings
        if variant in ("track", "full"):
            tracker, initial = traced_step(
                world, model_, optim, step_fn, make_batch, n_mb, capture_stacks=variant == "full"
            )
            lap("step")
            world.tracker = world.fake_mode.tracker = None
            out["tasks"], out["blocks"], out["peak_gib"] = (
                tracker.num_tasks,
                len(tracker.blocks),
                tracker.peak / GIB,
            )
            if variant == "full":
                lap.restart()
                trace = step_trace(tracker, initial)
                lap("blocks")
                trace.metadata = job_metadata(cfg)
                trace.limitations = world.limitations
                report = build_report(trace, cfg.target, cfg.live_set_limit)
                csv_text = blocks_csv(trace)
                lap("build")
                paths = write_reports(report, csv_text, cfg.output_dir, 0)
                lap("write")
                out["stacks"] = len(trace.stacks)
                out["json_bytes"], out["csv_bytes"] = (p.stat().st_size for p in paths)
            return timings
        if variant == "memtracker":
            from torch.distributed._tools.mem_tracker import MemTracker

            mt = MemTracker()
            mt.track_external(model_, optim)
        else:
            from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

            mt = FSDPMemTracker(model_, optim)
        with mt:
            step_fn(model_, optim, (make_batch(i, device) for i in range(n_mb)))
        lap("step")
        peak = mt.get_tracker_snapshot("peak")
        out["peak_gib"] = max(v.get("Total", 0) for v in peak.values()) / GIB if peak else 0.0
        return timings

    with (
        SimulatedWorld(8, 0, mesh_shape=(8,), mesh_dim_names=("dp_shard",)) as world,
        PatchSet(dtensor_speedups()),
    ):
        t0, c0 = time.perf_counter(), time.process_time()
        model_, optim = prepare(
            world,
            JobPlan(
                model_fn(cfg),
                make_batch,
                step_fn,
                parallelize_fn=lambda m, mesh: parallelize_llama(m, mesh, cfg.dims, parallelize_options(cfg)),
                optimizer_fn=optimizer(cfg),
            ),
        )
        res["setup_s"], res["setup_cpu"] = time.perf_counter() - t0, time.process_time() - c0
        res["rss_after_setup"] = _max_rss()
        device = torch.device(world.device)
        with world.fake():
            for rnd in range(reps + 1):
                for v in variants:
                    gc.collect()
                    timings = run_once(v, res["variants"][v])
                    timings["total_s"] = sum(x for k, x in timings.items() if k.endswith("_s"))
                    timings["cpu_s"] = sum(x for k, x in timings.items() if k.endswith("_cpu"))
                    if rnd:
                        for k, x in timings.items():
                            samples[v].setdefault(k, []).append(x)
            if "floor" in variants:
                counter = _OpCounter()
                world.fake_mode.tracker = counter
                step_fn(model_, optim, (make_batch(i, device) for i in range(n_mb)))
                world.fake_mode.tracker = None
                res["variants"]["floor"]["ops"] = counter.ops
    for v in variants:
        out = res["variants"][v]
        for k, xs in samples[v].items():
            out[k] = statistics.median(xs)
        if "floor" in samples and samples[v]:
            for key, name in (("total_s", "ratio"), ("cpu_s", "cpu_ratio")):
                ratios = [x / f for x, f in zip(samples[v][key], samples["floor"][key])]
                out[name] = statistics.median(ratios)
    res["max_rss"] = _max_rss()
    return res


# ----------------------------------------------------------------------------------------------- driver
def _env() -> dict[str, str]:
    import hyperdryrun

    src = str(Path(hyperdryrun.__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    return env


def run_worker(variants: list[str], model: str, layers: int, seq: int, reps: int) -> dict[str, Any]:
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        ",".join(variants),
        "--model",
        model,
        "--layers",
        str(layers),
    ]
    cmd += ["--seq", str(seq), "--reps", str(reps)]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        return {"layers": layers, "error": tail or f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def time_cli(model: str, layers: int, seq: int, reps: int) -> dict[str, Any]:
    """The whole ``hyperdryrun run`` command for the job, process start to exit (``python -m hyperdryrun.cli``)."""
    times: list[float] = []
    cpu: list[float] = []
    rc = 0
    with tempfile.TemporaryDirectory(prefix="hdr_cli_") as out:
        cmd = [sys.executable, "-m", "hyperdryrun.cli", "run", "--model", model, "--n-layers", str(layers)]
        cmd += ["--world-size", "8", "--seq-len", str(seq), "--micro-batch-size", "1", "--ac", "none"]
        cmd += ["--output-dir", out, "--quiet"]
        for _ in range(reps):
            r = timed(cmd, _env())
            times.append(r.wall)
            cpu.append(r.cpu)
            rc = rc or r.code
    return {
        "median_s": statistics.median(times),
        "min_s": min(times),
        "cpu_s": statistics.median(cpu),
        "rc": rc,
        "cmd": " ".join(cmd[1:]).replace(out, "OUT"),
    }


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "—" if x is None else format(x, spec)


def tables(
    timing: dict[int, dict[str, Any]],
    rss: dict[tuple[int, str], dict[str, Any]],
    cli: dict[str, Any],
    meta: dict[str, Any],
) -> tuple[str, list[str]]:
    """The markdown tables and the PASS/FAIL target lines."""
    depths = sorted(timing)
    lines = [
        f"Model `{meta['model']}` shape, seq {meta['seq']}, micro batch 1, FSDP2 over 8 simulated ranks (rank 0), "
        "AC none, fp32 master params/grads/AdamW states + FSDP2 mixed precision bf16 compute (the recipe default). "
        f"Times: medians of {meta['reps']} rounds after 1 warm-up round, every variant once per round in one "
        "process; × floor = median over rounds of (variant / floor of the same round). "
        + (
            "RSS: each variant alone in its own process (setup + one step). "
            if meta["rss"] == "each"
            else "RSS: the timing process's peak (all variants together). "
        )
        + f"Load average at start {meta['load']}; {meta['cpus']} CPUs; "
        f"torch {meta['torch']}.",
        "",
        "| layers | variant | wall s | × floor (wall) | CPU s | × floor (CPU) | host peak RSS MiB | peak GiB | "
        "ops / tasks | blocks |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for d in depths:
        t = timing[d]
        if "error" in t:
            lines.append(f"| {d} | all | error: {t['error'][:120]} | | | | | | | |")
            continue
        for v, r in t["variants"].items():
            own = rss.get((d, v), {"max_rss": t["max_rss"]})
            mem = f"{own['max_rss'] / 2**20:.0f}" if "max_rss" in own else own.get("error", "—")[:60]
            count = r.get("ops") if v == "floor" else r.get("tasks")
            lines.append(
                f"| {d} | {v} | {r['total_s']:.2f} | {_fmt(r.get('ratio'))} | {r['cpu_s']:.2f} | {_fmt(r.get('cpu_ratio'))} | "
                f"{mem} | {_fmt(r.get('peak_gib'))} | {count if count is not None else '—'} | {r.get('blocks', '—')} |"
            )
    lines += [
        "",
        "Stages of the full dry run, CPU s (medians; `stacks` = full step − tracked step without stacks; setup "
        "= model on meta, parallelize, to_empty, FSDP lazy init, optimizer state: once per process, not in "
        "the times above):",
        "",
        "| layers | setup | tracked step | of which stacks | blocks | report build | writing | JSON KiB | CSV KiB |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for d in depths:
        f = timing[d].get("variants", {}).get("full", {})
        t = timing[d].get("variants", {}).get("track", {})
        if "step_cpu" not in f:
            continue
        stacks = f["step_cpu"] - t["step_cpu"] if "step_cpu" in t else None
        lines.append(
            f"| {d} | {timing[d]['setup_cpu']:.2f} | {f['step_cpu']:.2f} | {_fmt(stacks)} | {f['blocks_cpu']:.3f} | "
            f"{f['build_cpu']:.3f} | {f['write_cpu']:.3f} | {f['json_bytes'] / 1024:.0f} | {f['csv_bytes'] / 1024:.0f} |"
        )
    lines += [
        "",
        f"Whole command `{cli['cmd']}` (process start to exit): {cli['median_s']:.2f} s wall median "
        f"(min {cli['min_s']:.2f} s), {cli['cpu_s']:.2f} s CPU (user + sys) median.",
    ]

    def get(d: int, v: str, key: str) -> float | None:
        return timing.get(d, {}).get("variants", {}).get(v, {}).get(key)

    top = max(depths)
    checks: list[str] = []

    def check(name: str, value: float | None, ok: Any, target: str) -> None:
        verdict = "SKIP" if value is None else ("PASS" if ok(value) else "FAIL")
        checks.append(f"{verdict}  {name}: {_fmt(value, '.3f')} (target {target})")

    r = get(top, "full", "cpu_ratio")
    check(f"full dry run / floor at {top} layers (CPU time)", r, lambda x: x <= 2.0, "<= 2.0")
    check(f"full dry run / floor at {top} layers (CPU time, stretch)", r, lambda x: x <= 1.6, "<= 1.6")
    full, f8 = get(top, "full", "cpu_s"), get(8, "full", "cpu_s") if top != 8 else None
    check(
        f"full dry run CPU time {top} layers / 8 layers",
        full / f8 if full and f8 else None,
        lambda x: x <= 4.4,
        "<= 4.4",
    )
    mt, full = get(top, "memtracker", "cpu_ratio"), get(top, "full", "cpu_ratio")
    r = mt / full if mt and full else None
    check(f"MemTracker / full dry run at {top} layers (CPU time)", r, lambda x: x >= 5.0, ">= 5")
    own = rss.get((top, "full"), {"max_rss": timing.get(top, {}).get("max_rss")}).get("max_rss")
    check(
        f"host peak RSS of the full dry run at {top} layers (GiB)",
        own / GIB if own else None,
        lambda x: x <= 1.5,
        "<= 1.5",
    )
    f = timing.get(top, {}).get("variants", {}).get("full", {})
    r = (f["build_cpu"] + f["write_cpu"]) / f["cpu_s"] if "write_cpu" in f else None
    check(
        f"report build + writing share of the full dry run at {top} layers (CPU time)",
        r,
        lambda x: x <= 0.10,
        "<= 0.10",
    )
    check(
        f"whole `hyperdryrun run` command at {top} layers (s)",
        cli["median_s"],
        lambda x: cli["rc"] == 0 and x < 15,
        "< 15, exit 0",
    )
    check(
        f"whole `hyperdryrun run` command at {top} layers, CPU time (s; wall on an idle machine)",
        cli["cpu_s"],
        lambda x: cli["rc"] == 0 and x < 15,
        "< 15, exit 0",
    )
    if top != 32 or 8 not in depths:
        checks.append(f"note: the targets are defined at 32 and 8 layers; this run measured {depths}")
    return "\n".join(lines), checks


def write_out(path: Path, body: str) -> None:
    """Put ``body`` between the bench markers of ``path`` (appended with markers if it has none)."""
    from hyperdryrun.report.writer import atomic_write

    block = f"{BEGIN}\n{body}\n{END}"
    text = path.read_text() if path.exists() else ""
    if BEGIN in text and END in text:
        text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, text, flags=re.S)
    else:
        text = (text.rstrip() + "\n\n" if text else "") + block + "\n"
    atomic_write(path, text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", default="4,8,16,32", help="comma-separated depths (default 4,8,16,32)")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions per variant after one warm-up")
    p.add_argument("--model", default="llama3-8b", help="model preset whose shape is used")
    p.add_argument("--seq", type=int, default=8192, help="sequence length")
    p.add_argument(
        "--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ",".join(VARIANTS)
    )
    p.add_argument("--cli-reps", type=int, default=None, help="runs of the whole command (default: --reps)")
    p.add_argument("--smoke", action="store_true", help="tiny and fast: llama-tiny, 1 layer, seq 64, 1 rep")
    p.add_argument(
        "--rss",
        choices=("each", "shared"),
        default="each",
        help="host peak RSS from one process per variant (each), or the timing process's for all (shared, faster)",
    )
    p.add_argument("--out", type=Path, help="write the tables and target lines into this markdown file")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        args.model, args.layers, args.seq, args.reps, args.rss = "llama-tiny", "1", 64, 1, "shared"
    if args.worker:
        print(json.dumps(worker(args.worker.split(","), args.model, int(args.layers), args.seq, args.reps)))
        return 0
    import torch

    depths = [int(x) for x in args.layers.split(",")]
    variants = [v for v in args.variants.split(",") if v]
    meta = {
        "model": args.model,
        "seq": args.seq,
        "reps": args.reps,
        "load": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "rss": args.rss,
    }
    timing: dict[int, dict[str, Any]] = {}
    rss: dict[tuple[int, str], dict[str, Any]] = {}
    for d in depths:
        timing[d] = run_worker(variants, args.model, d, args.seq, args.reps)
        for v, r in timing[d].get("variants", {}).items():
            print(f"# {d:>3} layers {v:<15} {r.get('total_s', float('nan')):8.2f} s", flush=True)
        for v in variants if args.rss == "each" else []:
            rss[(d, v)] = run_worker([v], args.model, d, args.seq, 0)
            print(f"# {d:>3} layers {v:<15} RSS {rss[(d, v)].get('max_rss', 0) / 2**20:8.0f} MiB", flush=True)
    cli = time_cli(args.model, max(depths), args.seq, args.cli_reps or args.reps)
    body, checks = tables(timing, rss, cli, meta)
    text = body + "\n\n```\n" + "\n".join(checks) + "\n```"
    print(text)
    if args.out:
        write_out(args.out, text)
    failed = any("error" in r for r in [*timing.values(), *rss.values()])
    return 1 if failed or cli["rc"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
