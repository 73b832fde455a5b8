"""How far a rank's step repeats itself layer by layer: the evidence an in-run layer replay (issue 29) would rest on.

Usage: ``python scripts/layer_repeat.py hyperdryrun_out/rank_0/rank_0_memory.csv``

Reads a run's block CSV and groups its blocks by decoder layer (``layers.N`` in the module). For each layer it
prints its blocks, whether its blocks in time order have the same (category, bytes, phase, module without the layer
index) sequence as the second layer's (the first middle one), and between consecutive middle layers the shifts of
their blocks' start tasks, by category and phase: a constant shift per kind means one layer's events, moved, are
the next one's.
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from collections import Counter, defaultdict

LAYER = re.compile(r"(^|\.)layers\.(\d+)(?=\.|$)")
Block = tuple[int, int, str, int, str, str]
"""start task, end task, category, bytes, phase, module with the layer index replaced by ``*``."""


def blocks_by_layer(path: str) -> dict[int | None, list[Block]]:
    csv.field_size_limit(sys.maxsize)
    out: dict[int | None, list[Block]] = defaultdict(list)
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            module = r["graph_name"]
            m = LAYER.search(module)
            layer = int(m.group(2)) if m else None
            relative = LAYER.sub(r"\1layers.*", module)
            start, end = int(r["start_time_stamp"]), int(r["end_time_stamp"])
            out[layer].append((start, end, r["type"], int(r["size"]), r["task_name"], relative))
    return out


def report(path: str) -> list[str]:
    by = blocks_by_layer(path)
    layers = sorted(k for k in by if k is not None)
    total = sum(len(v) for v in by.values())
    lines = [f"{path}: {total:,} blocks, {len(by.get(None, [])):,} outside the decoder layers"]
    if len(layers) < 3:
        return lines + [f"{len(layers)} decoder layers: too few to compare"]
    seq = {n: [b[2:] for b in sorted(by[n])] for n in layers}
    reference = layers[1]
    lines.append("layer  blocks  same sequence as layer " + str(reference))
    for n in layers:
        lines.append(f"{n:>5}  {len(by[n]):>6}  {'yes' if seq[n] == seq[reference] else 'no'}")
    middles = [n for n in layers[1:-1] if seq[n] == seq[reference]]
    shifts: set[tuple] = set()
    for a, b in zip(middles, middles[1:], strict=False):
        kinds: dict[int, Counter] = defaultdict(Counter)
        for x, y in zip(sorted(by[a]), sorted(by[b]), strict=True):
            kinds[y[0] - x[0]][(x[2], x[4])] += 1
        shifts.add(tuple(sorted((d, tuple(sorted(c.items()))) for d, c in kinds.items())))
    lines.append(
        f"start shifts between consecutive middle layers ({middles[0]}..{middles[-1]}): "
        f"{'the same for every pair' if len(shifts) == 1 else f'{len(shifts)} different patterns'}"
    )
    for d, kinds in next(iter(shifts)) if shifts else ():
        what = ", ".join(f"{cat} {phase} {n}" for (cat, phase), n in kinds)
        lines.append(f"  {d:+d} tasks: {what}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", help="a run's block CSV (rank_<r>/rank_<r>_memory.csv)")
    print("\n".join(report(parser.parse_args().csv)))


if __name__ == "__main__":
    main()
