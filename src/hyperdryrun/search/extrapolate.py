"""Exact reuse inside one rank's step: identical decoder layers, and micro batches in the same place of the schedule,
repeat the same memory pattern, so a few small runs determine the figures of the whole step.

Keys. Every allocating task of a traced step (live bytes only grow there) gets a key: its phase, op and module, the
decoder layer's place in its run of identical layers (the first and last ``EDGE`` by place, the others *middle*,
with their position ``p``), the micro batch's place in its run of alike ones (:class:`MicroBatchRegimes`: with
gradient accumulation, first / middle ``j`` / last; with 1F1B, each warm-up forward and cool-down backward by place,
the steady ones first / middle / last), and its occurrence among the tasks of that phase, module, op and micro
batch. A loop run outside the layers once per layer or per micro batch (FSDP2's reduce-scatters after the last
pipeline backward, the pipeline's receive buffers) is keyed by its unit ``u`` the same way.

Fit and check. Sample runs differ from the job only in layers (``n0 + x``, ``x = 0, 1, 2``) and, where the schedule
allows, micro batches (``m0, m0+1, m0+2``, plus the cross points ``(1, m0+1)`` and ``(1, m0+2)``). Each key's live
bytes (the total and every category) are fitted *exactly*, in rational arithmetic, by
``c0 + c1*x + c2*m + c3*p + c4*j + c5*u`` (the terms its samples vary); every sample must satisfy the fit, with
at least one sample more than unknowns (the ``k+2`` check), every key must occur in every sample, and the result must be whole bytes. The job's peak is then the
largest value over the keys at its ``(x, m)``, a middle key taken at both ends of its range (an affine function's
maximum is at an end), ties broken by time order as the tracker breaks them (the first task reaching the peak).
Where a check fails, no plan applies, or the samples would cost more than :data:`MIN_SAVING` of the full run,
:func:`hyperdryrun.search.shortcut.step_figures` runs the full simulation; :attr:`StepFigures.method` and
``detail`` say which and why.

What it reproduces: the summary's peak, its phase and op, its breakdown by category, the bytes before and after the
step and their breakdown, every phase's peak with its op and breakdown. Not the allocator model's reserved and
device peaks (segment rounding and per-stream caches are not affine in the layers; an affine fit passed its check
and missed): :mod:`hyperdryrun.search.synthesis` writes the step's blocks down from the samples for the allocator
model. Not the reports (JSON and CSV): they come from full runs.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from hyperdryrun.trace.blocks import CATEGORY_ORDER, STEP_PHASES, Category

if TYPE_CHECKING:
    from hyperdryrun.config import JobConfig

EDGE = 1
"""Layers (and micro batches) at each end of a run that are keyed by their own place, not as middle ones: the first
decoder layer (no backward prefetch below it) and the last (FSDP2 keeps it unsharded after forward) differ."""

FULL = "full"
EXTRAPOLATED = "extrapolated"

CATEGORIES = tuple(str(c) for c in CATEGORY_ORDER)

_LAYER = re.compile(r"(^|\.)layers\.(\d+)(?=\.|$)")


@dataclass(frozen=True)
class PhasePeak:
    """One phase's peak: bytes, the op there and the breakdown by category."""

    peak_bytes: int
    peak_op: str
    breakdown: dict[str, int]


@dataclass(frozen=True)
class StepFigures:
    """The memory figures of one rank's step that a layout search reads, and how they were obtained."""

    peak_bytes: int
    peak_phase: str | None
    peak_op: str | None
    breakdown_at_peak: dict[str, int]
    initial_bytes: int
    current_bytes: int
    breakdown_after_step: dict[str, int]
    phases: dict[str, PhasePeak]
    peak_reserved_bytes: int | None = None
    peak_device_bytes: int | None = None
    method: str = FULL
    """:data:`FULL` (one simulation of the whole step) or :data:`EXTRAPOLATED` (sample runs, every key checked)."""
    detail: str = ""
    """What ran: the samples of an extrapolation, or why the full simulation was used."""

    def comparable(self) -> dict[str, Any]:
        """Every figure, without how it was obtained: what an extrapolation must reproduce exactly."""
        return {
            "peak_bytes": self.peak_bytes,
            "peak_phase": self.peak_phase,
            "peak_op": self.peak_op,
            "breakdown_at_peak": self.breakdown_at_peak,
            "initial_bytes": self.initial_bytes,
            "current_bytes": self.current_bytes,
            "breakdown_after_step": self.breakdown_after_step,
            "phases": {k: (v.peak_bytes, v.peak_op, v.breakdown) for k, v in self.phases.items()},
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "peak_device_bytes": self.peak_device_bytes,
        }

    def to_dict(self) -> dict[str, Any]:
        out = self.comparable()
        out["phases"] = {
            k: {"peak_bytes": v.peak_bytes, "peak_op": v.peak_op, "breakdown_at_peak": v.breakdown}
            for k, v in self.phases.items()
        }
        return {**out, "method": self.method, "detail": self.detail}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepFigures:
        phases = {
            k: PhasePeak(v["peak_bytes"], v["peak_op"], dict(v["breakdown_at_peak"]))
            for k, v in d["phases"].items()
        }
        return cls(
            peak_bytes=d["peak_bytes"],
            peak_phase=d["peak_phase"],
            peak_op=d["peak_op"],
            breakdown_at_peak=dict(d["breakdown_at_peak"]),
            initial_bytes=d["initial_bytes"],
            current_bytes=d["current_bytes"],
            breakdown_after_step=dict(d["breakdown_after_step"]),
            phases=phases,
            peak_reserved_bytes=d.get("peak_reserved_bytes"),
            peak_device_bytes=d.get("peak_device_bytes"),
            method=d.get("method", FULL),
            detail=d.get("detail", ""),
        )


def figures_from_report(report: dict[str, Any], method: str = FULL, detail: str = "") -> StepFigures:
    """The figures of an ok JSON report (what a full simulation gives): its summary and phases, as
    :meth:`StepFigures.from_dict` reads them."""
    return StepFigures.from_dict(
        {**report["summary"], "phases": report["phases"], "method": method, "detail": detail}
    )


# ---------------------------------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class StageRun:
    """One pipeline stage of the rank (``stage`` None without pipelining): ``dense`` leading layers of another kind
    (an MoE model's dense layers), then ``run`` identical layers."""

    stage: int | None
    dense: int
    run: int


@dataclass(frozen=True)
class SamplePoint:
    x: int
    """Layers added to every stage's run over the smallest sample."""
    m: int
    """Micro batches."""


@dataclass
class Plan:
    """The sample runs of an extrapolation and the job they stand for."""

    stages: list[StageRun]
    base_run: dict[int | None, int]
    """Each stage's run length at ``x = 0``."""
    target_x: int
    target_m: int
    points: list[SamplePoint]
    varies_x: bool
    varies_m: bool
    num_stages: int = 1
    regimes: MicroBatchRegimes | None = None
    """How the step's micro batches fall into runs of alike ones (when the plan varies their number)."""
    stage_counts: Callable[[int], list[int]] | None = field(default=None, repr=False)
    """Layers of every pipeline stage of a sample (pp > 1)."""

    def run_length(self, stage: int | None, x: int) -> int:
        return self.base_run[stage] + x

    def describe(self) -> str:
        layers = sorted(
            {sum(s.dense + self.run_length(s.stage, p.x) for s in self.stages) for p in self.points}
        )
        mbs = sorted({p.m for p in self.points})
        target = sum(s.dense + s.run for s in self.stages)
        return (
            f"samples of {'/'.join(map(str, layers))} layers x {'/'.join(map(str, mbs))} micro batches "
            f"({len(self.points)} runs) for {target} layers x {self.target_m}"
        )


def _cost(layers: int, micro_batches: int) -> float:
    """Relative CPU cost of a run, in layer-micro-batches: the layers' ops dominate (405B TP8 rank, 2 to 4 layers
    at 8 and 16 micro batches: 0.19 to 0.23 s CPU each, the embedding, head and loss about half a layer more per
    micro batch), plus setup and the optimizer step, about two."""
    return (layers + 0.5) * micro_batches + 2


MIN_SAVING = 0.75
"""Use an extrapolation only when its samples cost at most this share of the full run (by :func:`_cost`)."""


def plan_for(cfg: JobConfig) -> tuple[Plan | None, str]:
    """The sample runs that determine ``cfg``'s step, or None and why the full simulation is run instead."""
    t, p = cfg.training, cfg.parallel
    if cfg.values.rules:
        return None, "value rules may single out layers"
    if cfg.values.routing == "profile":
        return None, "--routing-from gives each layer its own routing (layers differ)"
    if t.ac == "selective" and t.ac_selective != "op":
        return None, f"ac_selective={t.ac_selective} checkpoints every k-th layer (layers differ)"
    args = cfg.model.args()
    n_dense = args.n_dense_layers if cfg.model.is_moe else 0
    stages = _own_stages(cfg, n_dense)
    run_min = min(s.run for s in stages)
    base0 = 2 * EDGE + 1  # one middle layer in the smallest sample
    target_x = run_min - base0
    varies_x = target_x >= 3
    regimes = micro_batch_regimes(cfg)
    m0 = regimes.min_micro_batches if regimes else 0
    varies_m = regimes is not None and t.num_micro_batches - m0 >= 3
    if not varies_x and not varies_m:
        return None, "too few layers and micro batches to save by sampling"
    if varies_x:
        base_run = {s.stage: base0 + (s.run - run_min) for s in stages}
    else:
        base_run = {s.stage: s.run for s in stages}
        target_x = 0
    target_m = t.num_micro_batches
    xs = [0, 1, 2] if varies_x else [0]
    if varies_m:
        points = [SamplePoint(x, m0) for x in xs] + [SamplePoint(0, m0 + 1), SamplePoint(0, m0 + 2)]
        if varies_x:
            # The cross points: times move by x * m (every micro batch runs every added layer), which
            # (1, m0 + 1) determines and (1, m0 + 2) checks (hyperdryrun.search.synthesis).
            points += [SamplePoint(1, m0 + 1), SamplePoint(1, m0 + 2)]
    else:
        points = [SamplePoint(x, target_m) for x in xs]
    plan = Plan(
        stages,
        base_run,
        target_x,
        target_m,
        points,
        varies_x,
        varies_m,
        p.pp_num_stages,
        regimes if varies_m else None,
    )
    if p.pp > 1:
        counts = _stage_counts_solver(plan, n_dense)
        if counts is None:
            return None, "no pipeline split of the samples keeps this rank's dense and MoE layers in place"
        plan.stage_counts = counts
    dense = sum(s.dense for s in stages)
    sampled = sum(_cost(dense + sum(plan.run_length(s.stage, q.x) for s in stages), q.m) for q in points)
    full = _cost(dense + sum(s.run for s in stages), target_m)
    if sampled > MIN_SAVING * full:
        return None, f"samples would cost {sampled / full:.0%} of the full run"
    return plan, ""


@dataclass(frozen=True)
class MicroBatchRegimes:
    """The runs of alike micro batches in a step (what the micro-batch count stretches), for the schedules whose
    shape is known for any count. ``warmup`` 0: gradient accumulation without pipelining, one run of forward +
    backward per micro batch (the first allocates the gradients, the last is followed by the optimizer). Else
    torch 2.13 ``Schedule1F1B`` on this rank's stage: forwards 0..w-1 (``w = num_stages - stage``, each with one more
    micro batch in flight) are keyed one by one, then forward ``j`` follows backward ``j - w`` (``w - 1`` in flight),
    backwards ``0..m-w`` run with ``w`` in flight, the last ``w - 1`` (cool-down) are keyed one by one. The
    forwards are split where their own backward is: ``w..m-w`` (a steady backward) form the stretching run, the last
    ``w - 1`` (whose backward is a cool-down one) are keyed one by one, and there are enough micro batches that
    every warm-up forward's backward is a middle steady one, as in the job: so that what a forward allocates is
    freed at a time that moves with it (:mod:`hyperdryrun.search.synthesis`). Each stretching run keys its first and
    last ``EDGE`` micro batches by place and the middle ones by index."""

    warmup: int = 0
    num_stages: int = 1

    @property
    def min_micro_batches(self) -> int:
        """The fewest micro batches with ``2 * EDGE + 1`` in every stretching run (and enough for the schedule)."""
        if not self.warmup:
            return max(self.num_stages, 2 * EDGE + 1)
        return max(self.num_stages, 2 * self.warmup + 2 * EDGE)

    def place(self, phase: str, mb: int, m: int) -> tuple[tuple, int | None]:
        """(key, middle index or None) of micro batch ``mb`` of ``m`` in a task of ``phase``."""
        if phase == "optimizer":
            return ("opt",), None
        w = self.warmup
        if not w:
            place, j = _place(mb, m, EDGE)
            return ("mb", *place), j
        if phase == "forward":
            if mb < w:
                return ("warm", mb), None
            if mb > m - w:
                return ("late", m - mb), None
            place, j = _place(mb - w, m - 2 * w + 1, EDGE)
            return ("F", *place), j
        if mb <= m - w:
            place, j = _place(mb, m - w + 1, EDGE)
            return ("B", *place), j
        return ("cool", m - mb), None

    def length(self, key: tuple, m: int) -> int:
        """Micro batches in the run of ``key`` for a step of ``m``."""
        return {"mb": m, "F": m - 2 * self.warmup + 1, "B": m - self.warmup + 1}[key[0]]


def micro_batch_regimes(cfg: JobConfig) -> MicroBatchRegimes | None:
    """The micro-batch runs of ``cfg``'s step, or None where the schedule's shape changes with their number in a
    way not modelled here (GPipe holds every micro batch in flight; the multi-stage schedules reorder by rounds)."""
    p = cfg.parallel
    if p.pp == 1:
        return MicroBatchRegimes()
    if p.pp_schedule == "1F1B":
        (stage,) = cfg.dims.coordinates(cfg.world.rank).stages
        return MicroBatchRegimes(p.pp_num_stages - stage, p.pp_num_stages)
    return None


def _own_stages(cfg: JobConfig, n_dense: int) -> list[StageRun]:
    """The rank's stages (or the whole model) as dense prefix + run of identical layers."""
    args = cfg.model.args()
    if cfg.parallel.pp == 1:
        d = min(n_dense, args.n_layers)
        return [StageRun(None, d, args.n_layers - d)]
    from hyperdryrun.parallel.pipeline import stage_layer_ranges

    ranges = stage_layer_ranges(cfg.model.args().n_layers, cfg.dims)
    out = []
    for s in cfg.dims.coordinates(cfg.world.rank).stages:
        r = ranges[s]
        d = sum(1 for i in r if i < n_dense)  # global indices below n_dense: a prefix of the stage
        out.append(StageRun(s, d, len(r) - d))
    return out


def _stage_counts_solver(plan: Plan, n_dense: int) -> Callable[[int], list[int]] | None:
    """Layers of every pipeline stage of sample ``x``: this rank's stages as planned, placed so their dense layers
    keep global indices below ``n_dense`` (and their MoE layers above); every other stage as small as allowed."""
    own = {s.stage: s for s in plan.stages}
    n = plan.num_stages

    def counts(x: int) -> list[int] | None:
        out: list[int] = []
        for s in range(n):
            if s not in own:
                out.append(0 if s in (0, n - 1) else 1)
                continue
            st, start = own[s], sum(out)
            need = n_dense - st.dense if st.dense else n_dense
            if start < need:  # make room below with the stages of other ranks
                free = [i for i in range(s) if i not in own]
                if not free:
                    return None
                out[free[-1]] += need - start
            elif st.dense and start != need:
                return None
            out.append(st.dense + plan.run_length(s, x))
        return out

    if any(counts(q.x) is None for q in plan.points):
        return None
    return lambda x: counts(x)  # type: ignore[return-value]


def sample_config(cfg: JobConfig, plan: Plan, point: SamplePoint) -> JobConfig:
    """``cfg`` with the sample's layers and micro batches (same rank, same layout otherwise)."""
    changes: dict[str, dict[str, Any]] = {"training": {"num_micro_batches": point.m}}
    if plan.stage_counts is not None:
        counts = plan.stage_counts(point.x)
        changes["parallel"] = {"pp_stage_layers": counts}
        changes["model"] = {"n_layers": sum(counts)}
    else:
        st = plan.stages[0]
        changes["model"] = {"n_layers": st.dense + plan.run_length(None, point.x)}
    return cfg.with_changes(**changes)


# ---------------------------------------------------------------------------------------------- samples as data
def block_rows(trace: Any) -> list[tuple]:
    """What synthesis reads of a trace's blocks, in id order: (id, start, end, requested, size, stream, other
    streams, category, phase, micro batch, module, op)."""
    out = []
    for b in sorted(trace.blocks, key=lambda b: b.id):
        out.append(
            (
                b.id,
                b.start,
                b.end,
                b.requested,
                b.size,
                b.stream,
                sorted(b.use_streams),
                str(b.category or Category.OTHER),
                str(b.phase),
                b.micro_batch,
                b.module,
                b.op,
            )
        )
    return out


def device_inputs(trace: Any) -> dict[str, Any] | None:
    """The part of ``metadata.cuda`` that :func:`hyperdryrun.report.build.device_memory_of` reads besides the
    blocks (allocator settings, cuBLAS handles, NCCL and CUDA-context bytes), or None (not a CUDA target)."""
    cuda = (trace.metadata or {}).get("cuda")
    if not cuda:
        return None
    ws = cuda["cublas_workspace"]
    return {
        "allocator": {k: cuda["allocator"][k] for k in ("settings", "source")},
        "cublas_workspace": {
            "bytes_per_handle": ws["bytes_per_handle"],
            "handles": [{k: h[k] for k in ("thread", "stream", "first_task")} for h in ws["handles"]],
        },
        "nccl": {k: cuda["nccl"][k] for k in ("bytes", "formula")},
        "cuda_context": {k: cuda["cuda_context"][k] for k in ("bytes", "source")},
    }


@dataclass
class SampleTable:
    """One sample run as plain data, all an extrapolation reads (so that it can be cached): every allocating
    task's (index, phase, micro batch, module, op, live bytes: total then per category), the phases that ran, and
    the step's scalars (bytes before and after it, after it by category)."""

    rows: list[tuple[int, str, int, str, str, tuple[int, ...]]]
    phases: list[str]
    scalars: list[int]
    blocks: list[tuple] | None = None
    """Every block (:func:`block_rows`), for the allocator's figures (:mod:`hyperdryrun.search.synthesis`)."""
    device: dict[str, Any] | None = None
    """The allocator stage's other inputs (:func:`device_inputs`; None: not a CUDA target)."""

    @classmethod
    def from_trace(cls, trace: Any) -> SampleTable:
        live = _live_by_category(trace)
        first: dict[int, Any] = {}
        for b in trace.blocks:
            first.setdefault(b.start, b)
        rows = []
        for t in sorted(first):
            b = first[t]
            rows.append(
                (t, str(trace.task_phase[t]), b.micro_batch, b.module, trace.task_op[t], tuple(live[t]))
            )
        after = dict.fromkeys(CATEGORIES, 0)
        for b in trace.blocks:
            if b.persistent:
                after[str(b.category or "Other")] += b.size
        phases = sorted({str(ph) for ph in trace.task_phase})
        device = device_inputs(trace)
        blocks = block_rows(trace) if device is not None else None
        return cls(rows, phases, [trace.initial, trace.current, *after.values()], blocks, device)

    def to_dict(self) -> dict[str, Any]:
        return {
            "rows": [list(r[:5]) + [list(r[5])] for r in self.rows],
            "phases": self.phases,
            "scalars": self.scalars,
            "blocks": self.blocks,
            "device": self.device,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SampleTable:
        rows = [(r[0], r[1], r[2], r[3], r[4], tuple(r[5])) for r in d["rows"]]
        blocks = None if d.get("blocks") is None else [tuple(r) for r in d["blocks"]]
        return cls(rows, list(d["phases"]), list(d["scalars"]), blocks, d.get("device"))


def _live_by_category(trace: Any) -> list[list[int]]:
    """Live bytes at every task: [total, per category...] (a sweep over block lifetimes)."""
    n = trace.num_tasks
    index = {c: i + 1 for i, c in enumerate(CATEGORIES)}
    width = len(CATEGORIES) + 1
    delta = [[0] * width for _ in range(n + 1)]
    for b in trace.blocks:
        if b.start > n:
            continue
        c = index[str(b.category or "Other")]
        row = delta[b.start]
        row[0] += b.size
        row[c] += b.size
        if b.end <= n:
            row = delta[b.end]
            row[0] -= b.size
            row[c] -= b.size
    out, cur = [], [0] * width
    for t in range(n):
        cur = [a + b for a, b in zip(cur, delta[t], strict=True)]
        out.append(cur)
    return out


# ---------------------------------------------------------------------------------------------- keys
@dataclass
class _Task:
    group: tuple
    """(phase, micro batch place, layer place, module with the layer index as ``#``, op)."""
    occ: int
    """Occurrence among the tasks of the same phase, micro batch, module (with its layer index) and op."""
    p: int | None
    """Middle layer: its position in the run."""
    j: int | None
    """Middle micro batch: its index."""
    index: int
    """Task index in its run (time order)."""
    live: tuple[int, ...]
    """Total live bytes, then per category."""
    u: int | None = None
    """In a loop outside the layers that repeats per layer or per micro batch: the loop's unit."""


def _place(i: int, count: int, edge: int) -> tuple[tuple, int | None]:
    """``i`` of ``count`` in a run: ('f', i) near the front, ('b', k) near the back, ('m',) and ``i`` between."""
    if i < edge:
        return ("f", i), None
    if count - 1 - i < edge:
        return ("b", count - 1 - i), None
    return ("m",), i


def _layer_places(plan: Plan, point: SamplePoint) -> dict[int, tuple[tuple, int | None]]:
    """Global decoder-layer index -> (its place in the sample's stage, middle position or None)."""
    out: dict[int, tuple[tuple, int | None]] = {}
    if plan.stage_counts is None:
        starts = {None: 0}
    else:
        counts = plan.stage_counts(point.x)
        starts = {s.stage: sum(counts[: s.stage]) for s in plan.stages}
    for st in plan.stages:
        start = starts[st.stage]
        for q in range(st.dense):
            out[start + q] = ((st.stage, "d", q), None)
        run = plan.run_length(st.stage, point.x)
        for i in range(run):
            place, pos = _place(i, run, EDGE)
            out[start + st.dense + i] = ((st.stage, *place), pos)
    return out


def _tasks(table: SampleTable, plan: Plan, point: SamplePoint) -> list[_Task]:
    """The keyed allocating tasks of one sample run, in time order."""
    places = _layer_places(plan, point)
    seen: dict[tuple, int] = {}
    out = []
    for t, phase, mb, fqn, op, live in table.rows:
        module, p = fqn, None
        match = _LAYER.search(fqn)
        if match:
            place, p = places[int(match.group(2))]
            module = fqn[: match.start(2)] + "#" + fqn[match.end(2) :]
        else:
            place = None
        mb_place, j = plan.regimes.place(phase, mb, point.m) if plan.regimes else ((mb,), None)
        scope = (phase, mb, fqn, op)
        occ = seen.get(scope, 0)
        seen[scope] = occ + 1
        out.append(_Task((phase, mb_place, place, module, op), occ, p, j, t, live))
    return out


# ---------------------------------------------------------------------------------------------- exact fitting
def _solve(rows: list[list[int]], values: list[tuple[int, ...]]) -> list[list[Fraction]] | None:
    """Coefficients ``c`` with ``rows @ c == values`` exactly (every row), or None: the least-squares solution
    ``(A^T A)^-1 A^T v`` in rational arithmetic (:func:`_projector`, once per design), then every row checked.
    Needs full column rank and one row more than columns."""
    ncol = len(rows[0])
    if len(rows) < ncol + 1:
        return None
    proj = _projector(tuple(map(tuple, rows)))
    if proj is None:
        return None
    num_rows, den = proj
    out: list[list[Fraction]] = [[] for _ in range(ncol)]
    for k in range(len(values[0])):
        vk = [v[k] for v in values]
        num = [sum(n * x for n, x in zip(row, vk, strict=True)) for row in num_rows]
        for r, x in zip(rows, vk, strict=True):  # every row, in integers: times the common denominator
            if sum(a * b for a, b in zip(r, num, strict=True)) != x * den:
                return None
        for c in range(ncol):
            out[c].append(Fraction(num[c], den))
    return out


@functools.lru_cache(maxsize=4096)
def _projector(design: tuple[tuple[int, ...], ...]) -> tuple[list[list[int]], int] | None:
    """``(N, D)`` with ``(A^T A)^-1 A^T == N / D`` for the design ``A`` (integers), or None when its columns are
    dependent. Many keys share a design (the same samples, layers and micro batches): it is inverted once."""
    ncol = len(design[0])
    ata = [[Fraction(sum(r[a] * r[b] for r in design)) for b in range(ncol)] for a in range(ncol)]
    inv = [[Fraction(int(a == b)) for b in range(ncol)] for a in range(ncol)]
    for col in range(ncol):
        pivot = next((r for r in range(col, ncol) if ata[r][col] != 0), None)
        if pivot is None:
            return None
        ata[col], ata[pivot] = ata[pivot], ata[col]
        inv[col], inv[pivot] = inv[pivot], inv[col]
        f = 1 / ata[col][col]
        ata[col] = [a * f for a in ata[col]]
        inv[col] = [a * f for a in inv[col]]
        for r in range(ncol):
            if r != col and ata[r][col] != 0:
                g = ata[r][col]
                ata[r] = [a - g * b for a, b in zip(ata[r], ata[col], strict=True)]
                inv[r] = [a - g * b for a, b in zip(inv[r], inv[col], strict=True)]
    proj = [[sum((inv[c][a] * r[a] for a in range(ncol)), Fraction(0)) for r in design] for c in range(ncol)]
    den = math.lcm(*(x.denominator for row in proj for x in row))
    return [[int(x * den) for x in row] for row in proj], den


@dataclass
class _Fit:
    key: tuple
    columns: tuple[str, ...]
    coef: list[list[Fraction]]
    reference: list[_Task]
    """The key's tasks in the reference sample (the largest): where each end of a middle range sits in time."""
    ranges: dict[str, tuple[int, int]]
    """The job's range of each middle variable (``p``, ``j``, ``u``) the key has."""

    def value(self, env: dict[str, int]) -> tuple[int, ...] | None:
        out = []
        for k in range(len(self.coef[0])):
            v = sum(self.coef[c][k] * env[name] for c, name in enumerate(self.columns))
            if v.denominator != 1:
                return None
            out.append(int(v))
        return tuple(out)

    def time(self, corner: dict[str, bool]) -> int:
        """Task index in the reference sample of a corner (each middle variable at its low or high end):
        inserting middle layers or micro batches keeps every other task's order relative to it."""
        want = {}
        for var, high in corner.items():
            values = sorted({getattr(t, var) for t in self.reference})
            want[var] = values[-1 if high else 0]
        return next(t.index for t in self.reference if all(getattr(t, v) == w for v, w in want.items()))


class ShortcutFailed(Exception):
    """A check of the extrapolation failed: the full simulation is needed."""


def _fit_all(samples: list[tuple[SamplePoint, list[_Task]]], plan: Plan, cross: bool = False) -> list[_Fit]:
    """One exact fit per key (``cross``: with the products of the layers added and the micro-batch variables as
    further unknowns, which times need: every micro batch runs every added layer's tasks)."""
    groups: dict[tuple, list[tuple[SamplePoint, _Task]]] = {}
    for point, tasks in samples:
        for task in tasks:
            groups.setdefault(task.group, []).append((point, task))
    points = [pt for pt, _ in samples]
    fits: list[_Fit] = []
    for group, members in groups.items():
        fits.extend(_fit_group(group, members, points, plan, cross))
    return fits


def _fit_group(
    group: tuple,
    members: list[tuple[SamplePoint, _Task]],
    points: list[SamplePoint],
    plan: Plan,
    cross: bool = False,
) -> list[_Fit]:
    """Fits of one group's occurrences: one key per occurrence when every sample has as many. When the count grows
    by ``k`` per layer or per micro batch (a loop run outside the layers: FSDP2's gradient reduce-scatters after
    the last pipeline backward, the pipeline's receive buffers), the occurrences are units of ``k``: the ones near
    each end keyed by place, the middle ones by their offset in the unit, the unit index being a middle variable."""
    counts: dict[tuple, int] = {}
    for pt, t in members:
        counts[(pt, t.j)] = max(counts.get((pt, t.j), 0), t.occ + 1)
    per_point = {pt: {c for (q, _), c in counts.items() if q == pt} for pt in points}
    if any(len(c) != 1 for c in per_point.values()):
        raise ShortcutFailed(f"{_show(group)} is missing from some samples or micro batches")
    count = {pt: next(iter(c)) for pt, c in per_point.items()}
    if len(set(count.values())) == 1:
        return _fit_keys(group, [(pt, t, ("o", t.occ)) for pt, t in members], points, plan, None, cross)
    axis, k, fixed, units = _unit_loop(group, count, plan)
    for front in range(fixed + 1):
        placed = []
        for pt, t in members:
            c, o = count[pt], t.occ
            if o < front + EDGE * k:
                placed.append((pt, t, ("f", o)))
            elif c - 1 - o < (fixed - front) + EDGE * k:
                placed.append((pt, t, ("b", c - 1 - o)))
            else:
                unit, offset = divmod(o - front, k)
                placed.append((pt, replace(t, u=unit), ("u", offset)))
        try:
            return _fit_keys(group, placed, points, plan, (EDGE, units - 1 - EDGE), cross)
        except ShortcutFailed:
            continue
    if k > 1:
        # Not interleaved: k loops one after the other (torch's context_parallel copies, then shards, then
        # restores every layer's RoPE table), with the fixed tasks before, between and after them.
        for parts in _compositions(fixed, k + 1, MAX_SPLITS):
            placed = []
            for pt, t in members:
                per_loop = (count[pt] - fixed) // k
                place, unit = _sequential_place(t.occ, parts, per_loop)
                placed.append((pt, t if unit is None else replace(t, u=unit), place))
            try:
                return _fit_keys(group, placed, points, plan, (EDGE, units - 1 - EDGE), cross)
            except ShortcutFailed:
                continue
    raise ShortcutFailed(f"{_show(group)}: a loop over the {axis} that no alignment fits")


MAX_SPLITS = 4096
"""At most this many ways of placing the fixed tasks around sequential loops are tried."""


def _compositions(total: int, parts: int, limit: int) -> Iterator[tuple[int, ...]]:
    """Ways of writing ``total`` as an ordered sum of ``parts`` non-negative integers (the first ``limit``)."""

    def rec(left: int, n: int) -> Iterator[tuple[int, ...]]:
        if n == 1:
            yield (left,)
            return
        for first in range(left + 1):
            for rest in rec(left - first, n - 1):
                yield (first, *rest)

    yield from itertools.islice(rec(total, parts), limit)


def _sequential_place(occ: int, parts: tuple[int, ...], per_loop: int) -> tuple[tuple, int | None]:
    """(key place, unit or None) of occurrence ``occ`` when ``len(parts) - 1`` loops of ``per_loop`` tasks run one
    after the other, ``parts[i]`` fixed tasks before loop ``i`` (the last part after the last loop): the fixed ones
    and each loop's first and last ``EDGE`` keyed by place, a loop's middle ones by the loop and their unit."""
    pos = 0
    for i, fixed in enumerate(parts):
        if occ < pos + fixed:
            return ("F", i, occ - pos), None
        pos += fixed
        if i == len(parts) - 1:
            break
        if occ < pos + per_loop:
            t = occ - pos
            if t < EDGE:
                return ("L", i, "f", t), None
            if per_loop - 1 - t < EDGE:
                return ("L", i, "b", per_loop - 1 - t), None
            return ("u", i), t
        pos += per_loop
    raise ShortcutFailed(f"occurrence {occ} lies past the loops")


def _unit_loop(group: tuple, count: dict[SamplePoint, int], plan: Plan) -> tuple[str, int, int, int]:
    """(what it loops over, tasks per unit ``k``, tasks outside the loop, the job's units) of a group whose count is
    ``fixed + k * units`` with one unit per layer (one stage) or per micro batch."""
    if group[2] is None:
        # A loop over the layers may run in every micro batch (context parallel's per-layer RoPE buffers); one
        # over the micro batches only outside them.
        if plan.varies_x and len(plan.stages) == 1:
            stage = plan.stages[0]
            found = _loop_rule(count, lambda q: plan.run_length(stage.stage, q.x))
            if found is not None:
                return ("layers", *found, stage.run)
        if plan.varies_m and group[1][-1:] != ("m",):
            found = _loop_rule(count, lambda q: q.m)
            if found is not None:
                return ("micro batches", *found, plan.target_m)
    raise ShortcutFailed(f"{_show(group)} occurs a different number of times in the samples")


def _loop_rule(count: dict[SamplePoint, int], units: Callable[[SamplePoint], int]) -> tuple[int, int] | None:
    """(k, fixed) with ``count == fixed + k * units`` at every sample, k >= 1, or None."""
    pts = list(count)
    a = pts[0]
    b = next((q for q in pts if units(q) != units(a)), None)
    if b is None:
        return None
    k, rem = divmod(count[b] - count[a], units(b) - units(a))
    fixed = count[a] - k * units(a)
    if rem or k < 1 or fixed < 0 or any(count[q] != fixed + k * units(q) for q in pts):
        return None
    return k, fixed


def _fit_keys(
    group: tuple,
    placed: list[tuple[SamplePoint, _Task, tuple]],
    points: list[SamplePoint],
    plan: Plan,
    unit_range: tuple[int, int] | None,
    cross: bool = False,
) -> list[_Fit]:
    by_key: dict[tuple, list[tuple[SamplePoint, _Task]]] = {}
    for pt, t, occ_place in placed:
        by_key.setdefault((*group, occ_place), []).append((pt, t))
    ref_point = points[-1]
    runs = {s.stage: s.run for s in plan.stages}
    out = []
    for key, members in by_key.items():
        if len({(pt.x, pt.m) for pt, _ in members}) != len(points):
            raise ShortcutFailed(f"{_show(key)} is missing from some samples")
        ranges: dict[str, tuple[int, int]] = {}
        if group[2] is not None and group[2][1] == "m":
            ranges["p"] = (EDGE, runs[group[2][0]] - 1 - EDGE)
        if group[1][-1:] == ("m",):
            assert plan.regimes is not None
            ranges["j"] = (EDGE, plan.regimes.length(group[1], plan.target_m) - 1 - EDGE)
        if key[-1][0] == "u":
            assert unit_range is not None
            ranges["u"] = unit_range
        columns = (
            ("1",) + (("x",) if plan.varies_x else ()) + (("m",) if plan.varies_m else ()) + tuple(ranges)
        )
        if cross and plan.varies_x:
            columns += tuple(f"x*{v}" for v in columns if v in ("m", "j", "u"))
        rows = [[_env(pt, task)[c] for c in columns] for pt, task in members]
        coef = _solve(rows, [task.live for _, task in members])
        if coef is None:
            raise ShortcutFailed(f"{_show(key)} is not affine over the samples")
        reference = [task for pt, task in members if pt == ref_point]
        for var in ranges:
            if len({getattr(t, var) for t in reference}) < 2:
                raise ShortcutFailed(f"{_show(key)}: the reference sample has a single middle {var}")
        out.append(_Fit(key, columns, coef, reference, ranges))
    return out


def _env(point: SamplePoint, task: _Task) -> dict[str, int]:
    return with_products(
        {"1": 1, "x": point.x, "m": point.m, "p": task.p or 0, "j": task.j or 0, "u": task.u or 0}
    )


def with_products(env: dict[str, int]) -> dict[str, int]:
    """``env`` with the cross columns of a ``cross`` fit (:func:`_fit_all`)."""
    return {**env, **{f"x*{v}": env["x"] * env[v] for v in ("m", "j", "u")}}


def _show(key: tuple) -> str:
    phase, mb, place, module, op, *occ = key
    where = f", occurrence {occ[0]}" if occ else ""
    return f"task ({phase}, micro batch {mb}, layer {place}, {module or '<outside>'}, {op}{where})"


Candidate = tuple[int, int, tuple[int, ...], tuple]
"""(total live bytes, time in the reference sample, live vector, key)."""


def _candidates(fits: list[_Fit], plan: Plan) -> list[Candidate]:
    """Every fixed key and every corner of a middle range, at the job's size (an affine function's maximum over a
    range is at one of its ends; all ends are kept so that ties can be broken by time)."""
    out = []
    env = {"1": 1, "x": plan.target_x, "m": plan.target_m}
    for fit in fits:
        corners: list[dict[str, bool]] = [{}]
        for var in fit.ranges:
            corners = [{**c, var: high} for c in corners for high in (False, True)]
        for corner in corners:
            at = {var: fit.ranges[var][1 if high else 0] for var, high in corner.items()}
            if any(fit.ranges[v][0] > fit.ranges[v][1] for v in at):
                raise ShortcutFailed(f"{_show(fit.key)}: the job has no middle {next(iter(at))}")
            value = fit.value({**env, "p": 0, "j": 0, "u": 0, **at})
            if value is None:
                raise ShortcutFailed(f"{_show(fit.key)} extrapolates to a fraction of a byte")
            out.append((value[0], fit.time(corner), value, fit.key))
    return out


def _best(cands: list[Candidate]) -> Candidate:
    """The largest total, the earliest in time among equals (the tracker keeps the first peak)."""
    return min(cands, key=lambda c: (-c[0], c[1]))


def extrapolate(samples: list[tuple[SamplePoint, SampleTable]], plan: Plan) -> StepFigures:
    """The job's figures from its sample runs (raises :class:`ShortcutFailed` when a check fails), without the
    allocator's reserved and device peaks (:func:`hyperdryrun.search.synthesis.with_device_peaks` adds them)."""
    keyed = [(pt, _tasks(table, plan, pt)) for pt, table in samples]
    cands = _candidates(_fit_all(keyed, plan), plan)
    total, _, vec, key = _best(cands)
    phases: dict[str, PhasePeak] = {}
    for phase in STEP_PHASES:
        mine = [c for c in cands if c[3][0] == str(phase)]
        if mine:
            ptotal, _, pvec, pkey = _best(mine)
            phases[str(phase)] = PhasePeak(ptotal, pkey[4], dict(zip(CATEGORIES, pvec[1:], strict=True)))
    for _, table in samples:
        if not set(table.phases) & {str(ph) for ph in STEP_PHASES} <= set(phases):
            raise ShortcutFailed("a phase has no allocating task")
    width = len(CATEGORIES)
    points = [pt for pt, _ in samples]
    rows = [t.scalars for _, t in samples]
    after = _fit_scalars(points, [row[: 2 + width] for row in rows], plan)
    # The allocator model's reserved and device peaks are not fitted (segment rounding and the per-stream cache
    # need not follow the blocks' pattern: an affine fit of them over the samples passed its check and still missed
    # the full run, llama-tiny, 8 layers x 6 micro batches, AC full: 73,400,320 vs 75,497,472 reserved).
    return StepFigures(
        peak_bytes=total,
        peak_phase=key[0],
        peak_op=key[4],
        breakdown_at_peak=dict(zip(CATEGORIES, vec[1:], strict=True)),
        initial_bytes=after[0],
        current_bytes=after[1],
        breakdown_after_step=dict(zip(CATEGORIES, after[2 : 2 + width], strict=True)),
        phases=phases,
        method=EXTRAPOLATED,
        detail=plan.describe(),
    )


def _fit_scalars(
    points: list[SamplePoint],
    rows: list[list[int]],
    plan: Plan,
    what: str = "the bytes before or after the step",
) -> list[int]:
    """Each column of ``rows`` (one row per sample) fitted exactly over the layers and micro batches, at the job's."""
    columns = ("1",) + (("x",) if plan.varies_x else ()) + (("m",) if plan.varies_m else ())
    design = [[{"1": 1, "x": pt.x, "m": pt.m}[c] for c in columns] for pt in points]
    coef = _solve(design, [tuple(r) for r in rows])
    if coef is None:
        raise ShortcutFailed(f"{what} are not affine over the samples")
    env = {"1": 1, "x": plan.target_x, "m": plan.target_m}
    out = []
    for k in range(len(rows[0])):
        v = sum(coef[c][k] * env[name] for c, name in enumerate(columns))
        if v.denominator != 1:
            raise ShortcutFailed("a figure extrapolates to a fraction of a byte")
        out.append(int(v))
    return out


# ---------------------------------------------------------------------------------------------- entry points
def run_sample(cfg: JobConfig) -> SampleTable:
    """Simulate one sample (or any job) and keep what an extrapolation reads."""
    from hyperdryrun.recipe import run_job

    return SampleTable.from_trace(run_job(cfg, capture_stacks=False))


def full_figures(cfg: JobConfig, detail: str = "") -> StepFigures:
    """One full simulation of ``cfg``'s rank, as figures."""
    from hyperdryrun.recipe import run_job
    from hyperdryrun.report.build import build_report

    trace = run_job(cfg, capture_stacks=False)
    return figures_from_report(build_report(trace, cfg.target), FULL, detail)


SampleSource = Callable[["JobConfig"], SampleTable]
"""How a sample is obtained (default :func:`run_sample`; a cache may answer first)."""


def compare_figures(a: StepFigures, b: StepFigures) -> list[str]:
    """The figures where ``a`` and ``b`` differ (empty when they agree exactly)."""
    ca, cb = a.comparable(), b.comparable()
    return [k for k in ca if ca[k] != cb[k]]
