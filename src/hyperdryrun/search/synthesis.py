"""The whole step's blocks from sample runs, for the allocator model's reserved and device peaks without a full run.

The allocator model reads a step's blocks only through their events: each block's id (ties in time are broken by
it, in allocation order), the tasks that allocate and free it, its requested bytes, stream and the other streams
it is used on, whether it existed before the step and whether it is an optimizer state
(:func:`hyperdryrun.allocator.replay.steady_state_events`). So where those follow the step's repeats exactly, the
full step's blocks can be written down from a few sample runs, and the allocator replayed on them gives what a full
run would give.

Keys are :mod:`~hyperdryrun.search.extrapolate`'s, one per block instead of one per allocating task: the block's
phase, micro batch place, decoder-layer place, module, op, and, fixed per key, its stream, the other streams it is
used on and its category; the occurrence among the blocks of the same phase, micro batch, module and key. Each key's
``(id, start, end, requested, size)`` is fitted *exactly* (rational arithmetic, every sample satisfying the fit,
at least one sample more than unknowns: the same ``k+2`` check), as an affine function of the layers and micro
batches added and of the middle layer, micro batch or loop unit, with the products of the layers added and the
micro-batch variables (each micro batch runs every added layer's tasks, so times and ids move by both). The job's blocks are every key at every value of
its middle variables in the job's ranges. What would make the result wrong is then checked on the result: the ids
must be exactly ``0..n-1`` when every sample's are (no block missing, none twice), every block must end after it
starts, and the live-bytes peak of the written blocks must equal the extrapolated peak. The cuBLAS workspaces'
first tasks are fitted the same way; the NCCL and CUDA-context bytes and the allocator settings must be the same
in every sample. Any failed check raises :class:`~hyperdryrun.search.extrapolate.ShortcutFailed`, and the caller
runs the full simulation for these figures.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

from hyperdryrun.search.extrapolate import (
    _LAYER,
    EDGE,
    Plan,
    SamplePoint,
    SampleTable,
    ShortcutFailed,
    StepFigures,
    _fit_all,
    _fit_scalars,
    _layer_places,
    _Task,
    with_products,
)
from hyperdryrun.trace.blocks import PERSISTENT_END, Block, Category, Phase, live_bytes_by_task

VALUES = ("id", "start", "end", "requested", "size")


def _block_tasks(table: SampleTable, plan: Plan, point: SamplePoint) -> list[_Task]:
    """One keyed pseudo-task per block of a sample (its ``live`` holds the block's fitted values)."""
    places = _layer_places(plan, point)
    seen: dict[tuple, int] = {}
    out = []
    for bid, start, end, req, size, stream, uses, cat, phase, mb, fqn, op in table.blocks or ():
        module, p, place = fqn, None, None
        match = _LAYER.search(fqn)
        if match:
            place, p = places[int(match.group(2))]
            module = fqn[: match.start(2)] + "#" + fqn[match.end(2) :]
        mb_place, j = plan.regimes.place(phase, mb, point.m) if plan.regimes else ((mb,), None)
        what = (op, stream, tuple(uses), cat)
        scope = (phase, mb, fqn, what)
        occ = seen.get(scope, 0)
        seen[scope] = occ + 1
        out.append(
            _Task((phase, mb_place, place, module, what), occ, p, j, bid, (bid, start, end, req, size))
        )
    return out


@dataclass(frozen=True)
class Synthesized:
    """The job's blocks and the allocator stage's other inputs, written down from the samples."""

    blocks: list[Block]
    device: dict[str, Any]


def _instances(fit: Any, env: dict[str, int]) -> Iterator[tuple[int, ...]]:
    """``fit``'s values at every value of its middle variables in the job's ranges (integer coefficients: in
    integers; else :meth:`~hyperdryrun.search.extrapolate._Fit.value`, which refuses a fraction)."""
    names = list(fit.ranges)
    spans = [range(fit.ranges[v][0], fit.ranges[v][1] + 1) for v in names]
    integral = all(c.denominator == 1 for row in fit.coef for c in row)
    icoef = [[int(c) for c in row] for row in fit.coef] if integral else None
    for combo in itertools.product(*spans):
        e = with_products({**env, **dict(zip(names, combo, strict=True))})
        if icoef is not None:
            xs = [e[c] for c in fit.columns]
            yield tuple(sum(icoef[c][k] * xs[c] for c in range(len(xs))) for k in range(len(VALUES)))
            continue
        value = fit.value(e)
        if value is None:
            raise ShortcutFailed(f"a block of {fit.key[3] or '<outside>'} extrapolates to a fraction")
        yield value


def synthesize(samples: list[tuple[SamplePoint, SampleTable]], plan: Plan, peak_bytes: int) -> Synthesized:
    """The job's blocks from its samples (every check in the module docstring; :class:`ShortcutFailed` if one
    fails). ``peak_bytes``: the extrapolated live-bytes peak they must reproduce."""
    if any(t.blocks is None or t.device is None for _, t in samples):
        raise ShortcutFailed("the samples carry no blocks (not a CUDA target)")
    dev = [t.device for _, t in samples]
    for name in ("allocator", "nccl", "cuda_context"):
        if any(d[name] != dev[0][name] for d in dev):  # type: ignore[index]
            raise ShortcutFailed(f"the samples' {name} differ")
    keyed = [(pt, _block_tasks(t, plan, pt)) for pt, t in samples]
    contiguous = all([r[0] for r in t.blocks or ()] == list(range(len(t.blocks or ()))) for _, t in samples)
    fits = _fit_all(keyed, plan, cross=True)
    _check_counts(keyed, fits, plan)
    env = {"1": 1, "x": plan.target_x, "m": plan.target_m, "p": 0, "j": 0, "u": 0}
    blocks: list[Block] = []
    seen: set[int] = set()
    for fit in fits:
        phase, _, _, module, (op, stream, uses, cat) = fit.key[:5]
        for bid, start, end, req, size in _instances(fit, env):
            if bid in seen:
                raise ShortcutFailed(f"block id {bid} written twice")
            seen.add(bid)
            if end != PERSISTENT_END and end <= start:
                raise ShortcutFailed(f"block {bid} ends at {end}, not after its start {start}")
            blocks.append(
                Block(
                    id=bid,
                    size=size,
                    requested=req,
                    start=start,
                    op=op,
                    phase=Phase(phase),
                    module=module,
                    stack_id=0,
                    end=end,
                    category=Category(cat),
                    stream=stream,
                    use_streams=frozenset(uses),
                )
            )
    if contiguous and seen != set(range(len(blocks))):
        raise ShortcutFailed(f"the written block ids are not 0..{len(blocks) - 1}")
    blocks.sort(key=lambda b: b.id)
    live = _live_peak(blocks)
    if live != peak_bytes:
        raise ShortcutFailed(f"the written blocks peak at {live} B, the extrapolation at {peak_bytes} B")
    return Synthesized(blocks, {**dev[0], "cublas_workspace": _workspaces(samples, plan)})


def _check_counts(keyed: list[tuple[SamplePoint, list[_Task]]], fits: list[Any], plan: Plan) -> None:
    """Every sample has each key once per value of its middle layer and micro batch (a fit holds over the blocks
    a sample has; a block missing from a sample would go unseen). Keys of loops outside the layers (``u``) are
    covered by their own count rule (:func:`hyperdryrun.search.extrapolate._unit_loop`)."""
    for point, tasks in keyed:
        count: dict[tuple, int] = {}
        for t in tasks:
            key = (*t.group, ("o", t.occ))
            count[key] = count.get(key, 0) + 1
        for fit in fits:
            if fit.key[-1][0] != "o":
                continue
            want = 1
            if "p" in fit.ranges:
                want *= plan.run_length(fit.key[2][0], point.x) - 2 * EDGE
            if "j" in fit.ranges:
                assert plan.regimes is not None
                want *= plan.regimes.length(fit.key[1], point.m) - 2 * EDGE
            if count.get(fit.key, 0) != want:
                raise ShortcutFailed(
                    f"{fit.key[3] or '<outside>'}: a sample has {count.get(fit.key, 0)} of {want} blocks"
                )


def _live_peak(blocks: list[Block]) -> int:
    """The largest live bytes over the step's tasks (the tracker's peak: blocks alive before the step included)."""
    last = max([b.start for b in blocks] + [b.end for b in blocks if b.end != PERSISTENT_END], default=0)
    return max(live_bytes_by_task(blocks, last + 1), default=0)


def _workspaces(samples: list[tuple[SamplePoint, SampleTable]], plan: Plan) -> dict[str, Any]:
    """The samples' cuBLAS workspaces with each handle's first matmul at the job's size (fitted over the samples)."""
    ws = [t.device["cublas_workspace"] for _, t in samples]  # type: ignore[index]
    same = [(w["bytes_per_handle"], [(h["thread"], h["stream"]) for h in w["handles"]]) for w in ws]
    if any(x != same[0] for x in same):
        raise ShortcutFailed("the samples' cuBLAS handles differ")
    points = [pt for pt, _ in samples]
    firsts = [[h["first_task"] for h in w["handles"]] for w in ws]
    fitted = _fit_scalars(points, firsts, plan, "the cuBLAS handles' first matmuls") if firsts[0] else []
    handles = [{**h, "first_task": f} for h, f in zip(ws[0]["handles"], fitted, strict=True)]
    return {**ws[0], "handles": handles}


def device_peaks(syn: Synthesized, tensor_peak: int, capacity: int | None) -> tuple[int, int]:
    """(reserved, device) peaks of the synthesized step: :func:`hyperdryrun.report.build.device_memory_of` on its
    blocks, as for a full run's trace."""
    from hyperdryrun.report.build import device_memory_of

    trace = SimpleNamespace(blocks=syn.blocks, peak=tensor_peak, metadata={"cuda": syn.device})
    dm = device_memory_of(trace, capacity)
    assert dm is not None
    return dm.peak_reserved, dm.peak_device


def with_device_peaks(
    figures: StepFigures, samples: list[tuple[SamplePoint, SampleTable]], plan: Plan, capacity: int | None
) -> StepFigures:
    """``figures`` (extrapolated from ``samples``) with the allocator's reserved and device peaks of the blocks
    written down from the samples, against ``capacity``; where a check fails, without them (None), ``detail`` saying
    why (a full run is then needed for them)."""
    try:
        syn = synthesize(samples, plan, figures.peak_bytes)
        reserved, device = device_peaks(syn, figures.peak_bytes, capacity)
    except ShortcutFailed as err:
        return replace(figures, detail=f"{figures.detail}; reserved/device peaks: a full run ({err})")
    detail = (
        f"{figures.detail}; reserved/device peaks: allocator replay of the {len(syn.blocks)} blocks written"
    )
    return replace(figures, peak_reserved_bytes=reserved, peak_device_bytes=device, detail=detail)
