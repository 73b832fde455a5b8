"""One rank of any built-in job: its bare fake step (the floor: same world, same fake mode, no tracker) against the
tracked step, cold (the first step in the process: fake-tensor and DTensor caches empty) and cached (a second step),
CPU and wall. Used for docs/PERFORMANCE.md's whole-command and 405B-rank lines (issue 29)::

    PYTHONPATH=src python benchmarks/rank_floor.py floor-first -- --model llama3-8b --world-size 8 --seq-len 8192
    PYTHONPATH=src python benchmarks/rank_floor.py tracked-first -- --model llama3-8b --world-size 8 --seq-len 8192

``floor-first``: floor cold, floor cached, tracked cached; ``tracked-first``: tracked cold, tracked cached, floor
cached. The arguments after ``--`` are ``hyperdryrun run``'s job flags.
"""

from __future__ import annotations

import os
import sys
import time


def main() -> None:
    order, args = sys.argv[1], sys.argv[sys.argv.index("--") + 1 :]
    t0 = time.process_time(), time.perf_counter()
    import argparse

    from hyperdryrun.commands.job import config_from_args
    from hyperdryrun.commands.run import register
    from hyperdryrun.engine import PatchSet, _batches, dtensor_speedups, prepare, traced_step
    from hyperdryrun.recipe import plan as make_plan

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    cfg = config_from_args(parser.parse_args(["run", *args]))
    plan = make_plan(cfg)
    world = plan.world()
    out: list[str] = []

    def lap(name: str, start: tuple[float, float]) -> tuple[float, float]:
        now = time.process_time(), time.perf_counter()
        out.append(f"{name:16s} cpu {now[0] - start[0]:7.2f} s  wall {now[1] - start[1]:7.2f} s")
        return now

    with world, PatchSet(dtensor_speedups()):
        t = lap("imports, world", t0)
        model, optimizer = prepare(world, plan)
        t = lap("setup", t)
        with world.fake():
            steps = (
                ["floor", "floor", "tracked"] if order == "floor-first" else ["tracked", "tracked", "floor"]
            )
            seen: set[str] = set()
            for kind in steps:
                if kind == "floor":
                    plan.step_fn(
                        model, optimizer, _batches(plan.batch_fn, plan.num_micro_batches, world.device)
                    )
                else:
                    tracker, _ = traced_step(
                        world, model, optimizer, plan.step_fn, plan.batch_fn, plan.num_micro_batches
                    )
                    world.tracker = world.fake_mode.tracker = None
                    del tracker
                t = lap(f"{kind} {'cached' if seen else 'cold'}", t)
                seen.add(kind)
    r = os.times()
    print("\n".join(out), f"\nprocess cpu {r.user + r.system:.2f} s", sep="")


if __name__ == "__main__":
    main()
