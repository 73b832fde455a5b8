"""Issue 29's benchmark: whole commands against the floor, measured in the same run.

    PYTHONPATH=src python benchmarks/commands.py                       # all: ~20 min on 2 cores
    PYTHONPATH=src python benchmarks/commands.py --only readme,fit70   # a subset (readme, 405b, fit70, fit405)
    PYTHONPATH=src python benchmarks/commands.py --smoke               # llama-tiny: what CI runs (no times asserted)

Every measurement is a fresh process, timed from its start to its exit: CPU is the child's user + system time
(``os.wait4``), wall is ``perf_counter`` around it. Rank jobs: the floor is the bare fake step of the same rank
(``benchmarks/rank_floor.py floor-first``: same world, same fake mode, no tracker; *cold* is the first step in its
process, fake-tensor and DTensor caches empty, *cached* a second one), and the whole command is ``hyperdryrun run
... --quiet``; "x floor" is the whole command over the floor cold. Searches have no single step: their times are
given in units of the README job's floor cold measured in the same run (so two machines compare), cold (a fresh
cache directory) and cached (the same command again). The targets are issue 29's.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
PY = sys.executable

README_JOB = ["--model", "llama3-8b", "--world-size", "8", "--dp-shard", "8", "--seq-len", "8192",
              "--micro-batch-size", "1"]  # fmt: skip
RANK_405B = ["--model", "llama3-405b", "--world-size", "512", "--dp-shard", "8", "--tp", "8", "--pp", "8",
             "--pp-schedule", "1F1B", "--seq-len", "8192", "--micro-batch-size", "1", "--num-micro-batches", "16",
             "--ac", "full", "--rank", "0"]  # fmt: skip
FIT_70B = [
    "--model",
    "llama3-70b",
    "--world-size",
    "64",
    "--gpu",
    "h100-80gb",
    "--global-batch-tokens",
    "1048576",
]
FIT_405B = ["--model", "llama3-405b", "--world-size", "512", "--gpu", "h100-80gb",
            "--global-batch-tokens", "1048576"]  # fmt: skip
SMOKE_JOB = ["--model", "llama-tiny", "--world-size", "2", "--seq-len", "64"]
SMOKE_FIT = ["--model", "llama-tiny", "--world-size", "2", "--seq-len", "64", "--device-memory-gib", "4",
             "--global-batch-seqs", "4", "--tp", "1", "--pp", "1,2", "--ac", "none"]  # fmt: skip

IMPORTS = (
    "import gc\n"
    "gc.disable()\n"
    "import torch, torch.distributed.tensor, torch.distributed.fsdp\n"
    "from torch._subclasses.fake_tensor import FakeTensorMode\n"
    "FakeTensorMode()\n"
)
"""What any dry run of an FSDP2 step needs before its own work: torch, DTensor (its sympy through symbolic shapes),
FSDP2, and a FakeTensorMode, whose constructor imports ``torch._dynamo``; with the collector paused, as our own
processes import them (:mod:`hyperdryrun.startup`). A fresh process cannot go under it."""

# (what, target CPU seconds) of issue 29
TARGETS = {"readme": 3.0, "405b": 10.0, "fit70 cold": 120.0, "fit70 cached": 5.0, "fit405 cold": 600.0}


@dataclass
class Timed:
    cpu: float
    wall: float
    out: str
    code: int


def timed(argv: list[str], env: dict[str, str]) -> Timed:
    """Run ``argv`` to its end: its own CPU time (user + system) and wall time."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    out = proc.stdout.read() if proc.stdout else ""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return Timed(usage.ru_utime + usage.ru_stime, time.perf_counter() - t0, out, proc.returncode)


def floor(job: list[str], env: dict[str, str]) -> dict[str, tuple[float, float]]:
    """``rank_floor.py floor-first``'s stages: name -> (CPU s, wall s)."""
    r = timed([PY, str(HERE / "rank_floor.py"), "floor-first", "--", *job], env)
    if r.code:
        raise SystemExit(f"rank_floor.py failed ({r.code}):\n{r.out}")
    stages = {}
    for line in r.out.splitlines():
        m = re.match(r"(.+?)\s+cpu\s+([\d.]+) s\s+wall\s+([\d.]+) s", line)
        if m:
            stages[m.group(1).strip()] = (float(m.group(2)), float(m.group(3)))
    return stages


def command(verb: str, args: list[str], env: dict[str, str]) -> Timed:
    r = timed([PY, "-m", "hyperdryrun.cli", verb, *args], env)
    if r.code not in (0, 1):  # 1: the verdict (OOM / no layout fits) is an answer, not a failure
        raise SystemExit(f"hyperdryrun {verb} failed ({r.code}):\n{r.out[-2000:]}")
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--only", default="readme,405b,fit70,fit405", help="readme, 405b, fit70, fit405 (comma list)"
    )
    ap.add_argument("--smoke", action="store_true", help="llama-tiny only, every kind once (CI)")
    args = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": str(HERE.parent / "src")}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # byte-code caching on, as for an installed package
    only = {"readme", "fit70"} if args.smoke else set(args.only.split(","))
    rank_jobs = {"readme": SMOKE_JOB if args.smoke else README_JOB, "405b": RANK_405B}
    searches = {"fit70": SMOKE_FIT if args.smoke else FIT_70B, "fit405": FIT_405B}
    tag = " (llama-tiny)" if args.smoke else ""
    rows: list[str] = []
    lines: list[str] = []
    unit: float | None = None
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("readme", "405b"):
            if name not in only and not (name == "readme" and only & {"fit70", "fit405"}):
                continue
            job = rank_jobs[name]
            st = floor(job, env)
            cold, cached = st["floor cold"], st["floor cached"]
            if name == "readme":
                unit = cold[0]
            if name not in only:
                continue  # the README job's floor only, as the searches' unit
            whole = command("run", [*job, "--quiet", "--output-dir", f"{tmp}/{name}"], env)
            if name == "readme":
                imports = timed([PY, "-c", IMPORTS], env)
                if imports.code:
                    raise SystemExit(f"the imports floor failed ({imports.code}):\n{imports.out[-2000:]}")
                rows.append(
                    f"| imports any dry-run process needs (torch, DTensor, FSDP2, a FakeTensorMode) | "
                    f"{imports.cpu:.2f} | {imports.wall:.2f} | {imports.cpu / cold[0]:.2f} | "
                    f"{imports.wall / cold[1]:.2f} | the `{name}`{tag} whole command below is "
                    f"{whole.cpu / imports.cpu:.2f}x this in CPU |"
                )
            rows.append(
                f"| `{name}`{tag} whole command | {whole.cpu:.2f} | {whole.wall:.2f} | {whole.cpu / cold[0]:.2f} | "
                f"{whole.wall / cold[1]:.2f} | floor cold {cold[0]:.2f} / {cold[1]:.2f}, cached {cached[0]:.2f} / "
                f"{cached[1]:.2f}; imports + world {st['imports, world'][0]:.2f}, setup {st['setup'][0]:.2f} |"
            )
            if not args.smoke:
                lines.append(_target(name, whole.cpu))
        for name in ("fit70", "fit405"):
            if name not in only:
                continue
            assert unit is not None
            fit = [*searches[name], "--cache-dir", f"{tmp}/cache-{name}", "--quiet"]
            for how in ("cold", "cached"):
                r = command("fit", fit, env)
                rows.append(
                    f"| `{name}`{tag} {how} | {r.cpu:.2f} | {r.wall:.2f} | {r.cpu / unit:.1f} | — | "
                    f"in units of the README job's floor cold ({unit:.2f} CPU s) |"
                )
                if not args.smoke and f"{name} {how}" in TARGETS:
                    lines.append(_target(f"{name} {how}", r.cpu))
    print(f"{os.cpu_count()} CPUs; load average at end {' '.join(f'{x:.2f}' for x in os.getloadavg())}\n")
    print("| what | CPU s | wall s | x floor (CPU) | x floor (wall) | floor and stages (CPU s / wall s) |")
    print("|---|---:|---:|---:|---:|---|")
    print("\n".join(rows))
    if lines:
        print("\n```\n" + "\n".join(lines) + "\n```")


def _target(name: str, cpu: float) -> str:
    target = TARGETS[name]
    return f"{'PASS' if cpu <= target else 'FAIL'}  {name}: {cpu:.2f} CPU s (target <= {target:g})"


if __name__ == "__main__":
    main()
