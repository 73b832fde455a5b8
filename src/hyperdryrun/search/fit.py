"""The layout search behind ``hyperdryrun fit``: which layouts of a job fit the device, fastest first.

1. Enumerate the candidates of the search space (:mod:`hyperdryrun.search.space`) and drop the invalid ones (the
   layout's own rules, a global batch that does not split).
2. Estimate each one's step time (:mod:`hyperdryrun.search.roofline`) and prune those whose sharded parameters,
   gradients and optimizer states alone exceed the capacity on some rank (:mod:`hyperdryrun.search.bounds`: a
   lower bound on the dry-run peak, so nothing that fits is pruned).
3. Dry-run the rest, fastest first, one representative rank per rank class (:mod:`hyperdryrun.search.classes`),
   each through the exact shortcut where it holds (:mod:`hyperdryrun.search.extrapolate`), answered from the cache
   when the same rank of the same job ran before; with ``top`` > 0 the search stops once the ``top`` fastest layouts
   that fit are known (slower ones cannot enter the table). A layout's first class (its first pipeline stage)
   runs before its others, and one class over the capacity settles the layout as an OOM: while a first class runs,
   a free worker takes the next layout's first class rather than a class that answer may make unnecessary. A
   layout with a class within the margin cannot count towards ``top``: its other classes wait, and run only if
   fewer than ``top`` layouts fit with margin (the table then ranks layouts at risk after them).
4. Confirm on the device figure: an extrapolated class has allocated bytes only (the allocator model's reserved and
   device peaks are not affine in the layers), so every such class of a layout that fits on them and would enter the
   table is run again in full; a layout that then exceeds the capacity is an OOM, and step 3 goes on with the next.

A layout fits when its worst rank's peak is within the capacity, the peak being the allocator model's device figure
when the reports carry it, else its reserved figure, else the allocated bytes (:func:`verdict_figure` says which).
It fits *with margin* when that peak is more than ``margin_bytes`` under the capacity; within the margin it is
"at risk" (:mod:`hyperdryrun.allocator.verdict`): ranked after every layout that fits with margin, and not counted
towards ``top``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from hyperdryrun.allocator import verdict
from hyperdryrun.allocator.verdict import verdict_word
from hyperdryrun.config import ConfigError, JobConfig
from hyperdryrun.runner import BAD_INPUT
from hyperdryrun.search.bounds import StateBound, worst_state_bound
from hyperdryrun.search.cache import ResultCache, job_key, versions
from hyperdryrun.search.classes import RankClass, rank_classes
from hyperdryrun.search.executors import WAIT, SimTask, TaskResult
from hyperdryrun.search.extrapolate import EXTRAPOLATED, StepFigures
from hyperdryrun.search.roofline import Rates, StepTime, step_time
from hyperdryrun.search.space import DEFAULT_TOP, Candidate, SearchSpace, candidates

FITS, AT_RISK, OOM, INVALID, PRUNED, FAILED, SKIPPED = (
    "fits", "at_risk", "oom", "invalid", "pruned", "failed", "skipped",
)  # fmt: skip
STATUSES = (FITS, AT_RISK, OOM, INVALID, PRUNED, FAILED, SKIPPED)
RANKED = (FITS, AT_RISK)
"""The statuses of the layouts a search ranks, in that order."""


@dataclass(frozen=True)
class FitJob:
    """What a search is asked: the base job (:func:`hyperdryrun.search.space.base_job`; its parallel degrees and
    batch are searched),
    the capacity per device, the global batch in sequences, the space, the rates of the step-time estimate."""

    base: JobConfig
    capacity_bytes: int
    global_batch_seqs: int
    space: SearchSpace = SearchSpace()
    rates: Rates | None = None
    gpu: str | None = None
    top: int = DEFAULT_TOP
    """Stop once this many layouts that fit with margin, the fastest, are known (0: dry-run every candidate that
    survives)."""
    shortcut: bool = True
    margin_bytes: int = 0
    """A peak within this many bytes under the capacity is "at risk" (:mod:`hyperdryrun.allocator.verdict`)."""
    margin_source: str = ""
    """Where ``margin_bytes`` comes from (:meth:`hyperdryrun.allocator.verdict.Margin.source`)."""


@dataclass
class ClassResult:
    """One rank class of a candidate and its representative's figures (or why they are missing)."""

    rank_class: RankClass
    key: str
    figures: StepFigures | None = None
    error: str | None = None
    cached: bool = False
    seconds: float = 0.0
    confirmed: bool = False
    """Its figures were first extrapolated, then run in full for the allocator's device figure (step 4)."""


@dataclass
class CandidateResult:
    candidate: Candidate
    status: str
    reason: str = ""
    time: StepTime | None = None
    bound: StateBound | None = None
    classes: list[ClassResult] = field(default_factory=list)
    deferred: str = ""
    """Why the layout's other classes wait: a class within the margin (or over it on a figure the final verdict may
    not read) shows it cannot fit with margin, so it cannot count towards ``top``; its exact status (at risk or
    OOM) matters only if fewer than ``top`` layouts fit with margin, and is then run out at the end."""
    stopped: int = 0
    """Classes simulated before the search found it not needed (they ran beside a faster layout that then fit, or
    its other classes waited, ``deferred``, and ``top`` layouts fit with margin); its ``classes`` are cleared then,
    as no peak of the layout is known."""

    @property
    def done(self) -> bool:
        return bool(self.classes) and all(c.figures is not None or c.error for c in self.classes)

    def over(self, capacity: int) -> ClassResult | None:
        """The class known to exceed ``capacity`` by the most, on its own most complete figure (device, else
        reserved, else allocated), or None: the candidate cannot fit, whatever the others give. The verdict reads
        the figure every class has, and a layout that would enter the table is judged on the device figure of every
        class (its extrapolated classes' from written blocks or a full run, step 4), which includes the reserved
        and the allocated bytes; so one class over the capacity on any of them settles the layout as an OOM, and
        its other classes are not run (a 70B layout whose first stage fits on allocated bytes and not on the
        device figure ran its seven other stages before)."""
        over = [c for c in self.classes if c.figures is not None and verdict_bytes(c.figures) > capacity]
        return max(over, key=lambda c: (verdict_bytes(c.figures), -c.rank_class.representative), default=None)

    @property
    def basis(self) -> str:
        """The figure this candidate's verdict reads (:func:`verdict_figure` over its classes)."""
        return verdict_figure([c.figures for c in self.classes if c.figures is not None])

    @property
    def cached(self) -> bool:
        ran = [c for c in self.classes if c.figures is not None or c.error]
        return bool(ran) and all(c.cached for c in ran)

    @property
    def worst(self) -> ClassResult | None:
        """The class with the largest verdict figure."""
        ok = [c for c in self.classes if c.figures is not None]
        basis = self.basis
        return max(
            ok, key=lambda c: (verdict_bytes(c.figures, basis), -c.rank_class.representative), default=None
        )

    def peak(self, name: str) -> int | None:
        """The worst rank's ``peak_bytes`` / ``peak_reserved_bytes`` / ``peak_device_bytes``."""
        values = [getattr(c.figures, name) for c in self.classes if c.figures is not None]
        return None if not values or any(v is None for v in values) else max(values)

    @property
    def simulated_classes(self) -> list[ClassResult]:
        """The classes that have figures (all of them, unless an OOM made the rest unnecessary)."""
        return [c for c in self.classes if c.figures is not None]

    @property
    def methods(self) -> list[str]:
        return [c.figures.method for c in self.classes if c.figures is not None]

    @property
    def unconfirmed(self) -> list[ClassResult]:
        """Classes judged on extrapolated figures without the allocator's peaks (the samples' blocks did not pass
        the checks of :mod:`hyperdryrun.search.synthesis`): the device figure needs a full run."""
        return [
            c
            for c in self.classes
            if c.figures is not None
            and c.figures.method == EXTRAPOLATED
            and c.figures.peak_reserved_bytes is None
            and not c.error
        ]


def verdict_figure(figures: StepFigures | list[StepFigures]) -> str:
    """Which figure the capacity is checked against: ``device``, else ``reserved``, else ``allocated``, the first
    that every one of ``figures`` (a candidate's classes) has."""
    many = figures if isinstance(figures, list) else [figures]
    if not many:
        return "allocated"
    if all(f.peak_device_bytes is not None for f in many):
        return "device"
    return "reserved" if all(f.peak_reserved_bytes is not None for f in many) else "allocated"


def verdict_bytes(figures: StepFigures, basis: str | None = None) -> int:
    """``figures``' peak on ``basis`` (default: the most complete figure it has)."""
    name = basis or verdict_figure(figures)
    if name == "device":
        return figures.peak_device_bytes or 0
    return (figures.peak_reserved_bytes if name == "reserved" else figures.peak_bytes) or 0


@dataclass
class FitOutcome:
    job: FitJob
    results: list[CandidateResult]
    seconds: float = 0.0
    running: dict[str, str] = field(default_factory=dict)
    """The simulations handed to the executor and not yet answered: cache key -> what it is (for progress)."""

    def counts(self) -> dict[str, int]:
        out = {"enumerated": len(self.results)}
        out.update({s: sum(r.status == s for r in self.results) for s in STATUSES})
        ran = [r for r in self.results if r.classes and r.status in (FITS, AT_RISK, OOM, FAILED)]
        out["simulated"] = sum(not r.cached for r in ran)
        out["cached"] = sum(r.cached for r in ran)
        confirmed = sum(c.confirmed for r in ran for c in r.classes)
        out["extrapolated"] = sum(1 for r in ran for m in r.methods if m == EXTRAPOLATED) + confirmed
        out["confirmed"] = confirmed
        out["rank_classes"] = sum(len(r.simulated_classes) for r in ran)
        out["cached_classes"] = sum(c.cached for r in ran for c in r.simulated_classes)
        out["stopped_classes"] = sum(r.stopped for r in self.results)
        return out

    def ranked(self) -> list[CandidateResult]:
        """The layouts that fit with margin, fastest first, then those at risk, fastest first (at most ``top`` in
        all when it is set)."""
        out = [
            r
            for status in RANKED
            for r in sorted((r for r in self.results if r.status == status), key=_order)
        ]
        return out[: self.job.top] if self.job.top else out

    def fits_with_margin(self) -> list[CandidateResult]:
        """The ranked layouts that fit with margin (what exit code 0 needs)."""
        return [r for r in self.ranked() if r.status == FITS]


def _order(r: CandidateResult) -> tuple[float, int]:
    return (r.time.total if r.time else float("inf"), r.candidate.index)


Progress = Callable[[FitOutcome], None]


def fit(job: FitJob, executor: Any, cache: ResultCache, on_progress: Progress | None = None) -> FitOutcome:
    """Run the search (see the module docstring) with ``executor`` (``imap(tasks)``) and ``cache``."""
    from hyperdryrun.search.roofline import rates_for

    t0 = time.perf_counter()
    rates = job.rates or rates_for(job.gpu)
    outcome = FitOutcome(job, [])
    survivors: list[CandidateResult] = []
    for cand in candidates(job.base, job.space, job.global_batch_seqs):
        if cand.cfg is None:
            outcome.results.append(CandidateResult(cand, INVALID, cand.problem or ""))
            continue
        classes = rank_classes(cand.cfg)
        bound = worst_state_bound(cand.cfg, [c.representative for c in classes])
        result = CandidateResult(cand, "", time=step_time(cand.cfg, rates, bound.param_elements), bound=bound)
        outcome.results.append(result)
        if bound.bytes > job.capacity_bytes:
            result.status, result.reason = (
                PRUNED,
                (
                    f"rank {bound.rank}: sharded parameters + gradients + optimizer states alone are "
                    f"{bound.bytes / 2**30:.2f} GiB > {job.capacity_bytes / 2**30:.2f} GiB"
                ),
            )
            continue
        # The stage with the most micro batches in flight (the first), then the others: an OOM there settles it.
        ordered = sorted(classes, key=lambda c: (c.pp, c.representative))
        result.classes = [ClassResult(c, _key(cand.cfg, c, job.shortcut)) for c in ordered]
        survivors.append(result)
    survivors.sort(key=_order)
    if on_progress:
        on_progress(outcome)
    by_key = {c.key: (r, c) for r in survivors for c in r.classes}
    started: set[int] = set()
    defer = bool(job.top)  # with top 0 every layout is run out anyway

    def settle(r: CandidateResult) -> None:
        _settle(r, job.capacity_bytes, job.margin_bytes)
        if defer and not r.status and not r.deferred:
            r.deferred = _no_margin(r, job.capacity_bytes, job.margin_bytes)

    def tasks() -> Iterator[SimTask | Any]:
        while not _enough(survivors, job.top):
            picked = _next_class(survivors, outcome.running, job.capacity_bytes, every=not job.top)
            if picked is None:
                if not outcome.running:
                    return
                yield WAIT  # what comes next depends on an answer in flight
                continue
            r, c = picked
            started.add(id(r))
            hit = cache.get("figures", c.key)
            if hit is not None:
                c.figures, c.cached = StepFigures.from_dict(hit), True
                settle(r)
                if on_progress:
                    on_progress(outcome)
                continue
            outcome.running[c.key] = _doing(r, c, "")
            if on_progress:
                on_progress(outcome)
            yield SimTask(c.key, _rank_job(r.candidate, c.rank_class), job.shortcut, _dir(cache))

    def confirmations(todo: list[CandidateResult]) -> Iterator[SimTask]:
        for r in todo:
            for c in r.unconfirmed:
                if r.over(job.capacity_bytes):
                    break  # as in tasks(): one class over the capacity settles the layout
                key = _key(r.candidate.cfg, c.rank_class, shortcut=False)
                hit = cache.get("figures", key)
                if hit is not None:
                    _confirm(c, StepFigures.from_dict(hit), cached=True)
                    continue
                by_key[key] = (r, c)
                outcome.running[key] = _doing(r, c, " in full")
                if on_progress:
                    on_progress(outcome)
                yield SimTask(key, _rank_job(r.candidate, c.rank_class), False, _dir(cache))
            _settle(r, job.capacity_bytes, job.margin_bytes)
            if on_progress:
                on_progress(outcome)

    def run(batch: Iterator[SimTask]) -> None:
        with contextlib.closing(executor.imap(batch)) as results:  # closed: its workers stop at once
            for res in results:
                outcome.running.pop(res.key, None)
                r, c = by_key[res.key]
                if res.error and res.error_kind == BAD_INPUT:
                    # every candidate passed the job's checks: bad input now is not the layout's, it stops the search
                    raise ConfigError(
                        f"{r.candidate.layout.label()}, rank {c.rank_class.representative}: {res.error}"
                    )
                _take(res, c, cache)
                settle(r)
                if on_progress:
                    on_progress(outcome)

    while True:
        run(tasks())
        todo = [r for r in outcome.ranked() if r.unconfirmed]
        if todo:
            run(confirmations(todo))
            continue
        waiting = [r for r in survivors if r.deferred and not r.status]
        if not waiting or _enough(survivors, job.top):
            break
        # Fewer than top fit with margin: the table ranks layouts at risk after them, so they are run out now.
        defer = False
        for r in waiting:
            r.deferred = ""
    for r in survivors:
        if id(r) not in started:
            r.status, r.reason, r.classes = SKIPPED, f"not needed: {job.top} faster layouts fit", []
        elif not r.status:  # it ran beside a faster layout that then fit, or cannot fit with margin
            r.stopped = sum(not c.cached for c in r.simulated_classes)
            ran = f"{r.stopped} of its {len(r.classes)} rank classes"
            if r.deferred:
                r.reason = (
                    f"not needed: {r.deferred}; {job.top} layouts fit with margin (stopped after {ran})"
                )
            else:
                r.reason = f"not needed: {job.top} faster layouts fit" + (
                    f" (stopped after {ran})" if r.stopped else ""
                )
            r.status, r.classes = SKIPPED, []
    outcome.seconds = time.perf_counter() - t0
    return outcome


def eta_in_flight(outcome: FitOutcome, workers: int) -> float | None:
    """Seconds until the layouts being simulated have every rank class answered: their classes without an answer
    times the mean time of the classes simulated so far (cached ones left out), over ``workers``; None before any
    class has been simulated. The layouts after them are not counted: the search stops once ``top`` fit; nor the
    waiting classes of a layout that cannot fit with margin (deferred: they run only if too few layouts fit)."""
    done = [
        c.seconds
        for r in outcome.results
        for c in r.classes
        if (c.figures is not None or c.error) and not c.cached and c.seconds > 0
    ]
    if not done:
        return None
    keys = set(outcome.running)
    live = [r for r in outcome.results if any(c.key in keys for c in r.classes)]
    left = sum(
        1
        for r in live
        for c in r.classes
        if c.figures is None and not c.error and (not r.deferred or c.key in keys)
    )
    return left * (sum(done) / len(done)) / max(workers, 1)


def _no_margin(r: CandidateResult, capacity: int, margin: int) -> str:
    """Why ``r`` cannot fit with margin, whatever its other classes give ("" if it still may): a class whose own
    most complete figure is within ``margin`` under the capacity. The verdict of a layout that fits is read on the
    device figure of every class, which includes each class's reserved and allocated bytes."""
    for c in r.classes:
        if c.figures is not None:
            basis = verdict_figure(c.figures)
            peak = verdict_bytes(c.figures, basis)
            word = verdict_word(peak, capacity, margin)
            if word != verdict.FITS:
                where = (
                    f"over {capacity / 2**30:.2f} GiB"
                    if word == verdict.OOM
                    else f"within the {margin / 2**30:.2f} GiB margin under {capacity / 2**30:.2f} GiB"
                )
                return f"rank {c.rank_class.representative}'s {basis} peak {peak / 2**30:.2f} GiB is {where}"
    return ""


def _next_class(
    survivors: list[CandidateResult], running: dict[str, str], capacity: int, every: bool = False
) -> tuple[CandidateResult, ClassResult] | None:
    """The next rank class to simulate, or None: nothing to start until an answer comes.

    Candidates go fastest first, and a candidate's first class (its first pipeline stage, which holds the most
    micro batches in flight) before its others: over the capacity there, the candidate is settled and its other
    classes are not needed. While a first class runs, the next candidate's first class is taken (it is needed if
    this one does not fit, which its first stage decides more often than not). Once a candidate's first class
    fits, its other classes are taken, and nothing of a slower candidate: it is needed only if this one still turns
    out not to fit, and the search's end waits on this one's classes anyway. With ``every`` (no ``top``: every
    candidate is run out) a slower candidate's classes are taken then too."""
    for r in survivors:
        if r.status or r.deferred or r.over(capacity):
            continue
        first, *rest = r.classes
        if first.figures is None and not first.error:
            if first.key in running:
                continue
            return r, first
        for c in rest:
            if c.figures is None and not c.error and c.key not in running:
                return r, c
        if not every:
            return None
    return None


def _doing(r: CandidateResult, c: ClassResult, how: str) -> str:
    lay = r.candidate.layout
    return (
        f"{lay.label()} {lay.micro_batch_size}x{lay.num_micro_batches} {lay.ac}: "
        f"rank {c.rank_class.representative}{how}"
    )


def _key(cfg: Any, c: RankClass, shortcut: bool) -> str:
    data = cfg.model_dump()
    data["world"] = {**data["world"], "rank": c.representative}
    return job_key(data, "figures", shortcut=shortcut)


def _rank_job(cand: Candidate, c: RankClass) -> dict[str, Any]:
    assert cand.cfg is not None
    data = cand.cfg.model_dump()
    data["world"] = {**data["world"], "rank": c.representative}
    return data


def _dir(cache: ResultCache) -> str | None:
    return None if cache.directory is None else str(cache.directory)


def _take(res: TaskResult, c: ClassResult, cache: ResultCache) -> None:
    c.seconds = res.seconds
    if res.error:
        c.error = res.error
        return
    if res.versions and res.versions != versions():
        c.error = f"computed with {res.versions}, this process has {versions()}: install the same versions"
        return
    assert res.figures is not None
    figures = StepFigures.from_dict(res.figures)
    if res.key != c.key:  # a confirmation: the class's full run, under its own key
        cache.put("figures", res.key, res.figures)
        _confirm(c, figures, cached=False)
        return
    c.figures = figures
    cache.put("figures", c.key, res.figures)


def _confirm(c: ClassResult, full: StepFigures, cached: bool) -> None:
    """Replace ``c``'s extrapolated figures by the full run's (the same allocated bytes, plus the device figure)."""
    c.figures, c.confirmed, c.cached = full, True, c.cached and cached


def _settle(r: CandidateResult, capacity: int, margin: int) -> None:
    """Give ``r`` its status once every class has an answer, or once one class is over the capacity (the classes
    not run then stay without figures)."""
    over = r.over(capacity)
    if over is not None and not any(c.error for c in r.classes):
        _verdict(r, over, capacity, margin, basis=verdict_figure(over.figures))
        return
    if not r.done:
        return
    failed = [c for c in r.classes if c.error]
    if failed:
        c = failed[0]
        r.status, r.reason = FAILED, f"rank {c.rank_class.representative}: {c.error}"
        return
    worst = r.worst
    assert worst is not None
    _verdict(r, worst, capacity, margin)


def _verdict(
    r: CandidateResult, worst: ClassResult, capacity: int, margin: int, basis: str | None = None
) -> None:
    """``r``'s status and reason from ``worst``'s peak on ``basis`` (default: the figure every class has)."""
    assert worst.figures is not None
    basis = basis or r.basis
    peak = verdict_bytes(worst.figures, basis)
    word = verdict_word(peak, capacity, margin)
    r.status = {verdict.FITS: FITS, verdict.AT_RISK: AT_RISK, verdict.OOM: OOM}[word]
    r.reason = (
        f"rank {worst.rank_class.representative}: {basis} peak "
        f"{peak / 2**30:.2f} GiB {'<=' if peak <= capacity else '>'} {capacity / 2**30:.2f} GiB"
    )
    if r.status == AT_RISK:
        r.reason += f", within the {margin / 2**30:.2f} GiB margin"


def _enough(ordered: list[CandidateResult], top: int) -> bool:
    """Whether the ``top`` fastest layouts that fit with margin are known: that many among the fastest that are
    finished or known not to fit with margin (deferred)."""
    if not top:
        return False
    fits = 0
    for r in ordered:
        if not r.status and not r.deferred:
            return False
        fits += r.status == FITS
        if fits >= top:
            return True
    return False
