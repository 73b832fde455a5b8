"""Step 4 of the search: a layout is judged on the allocator model's device figure, replayed on the blocks
written down from its samples (hyperdryrun.search.synthesis), or, where they cannot be, of a second, full run; it
is an OOM if that figure is over the capacity."""

from __future__ import annotations

import pytest

import hyperdryrun.search.extrapolate as ex
from hyperdryrun.config import build_config
from hyperdryrun.recipe import run_job
from hyperdryrun.report.build import build_report
from hyperdryrun.search.cache import ResultCache
from hyperdryrun.search.executors import WAIT, InlineExecutor, TaskResult
from hyperdryrun.search.extrapolate import EXTRAPOLATED, FULL, PhasePeak, StepFigures
from hyperdryrun.search.fit import FITS, OOM, FitJob, fit
from hyperdryrun.search.space import SearchSpace, base_job

GIB = 2**30
# llama-tiny with 8 layers, 2 ranks of FSDP, 12 sequences of 64 a step: one layout, 6 micro batches of 1 a rank,
# which the shortcut extrapolates (samples of 3-5 layers x 3-5 micro batches) once the cost rule is lifted.
BASE = build_config(
    {"model": {"name": "llama-tiny", "n_layers": 8}, "world": {"world_size": 2}, "training": {"seq_len": 64}}
).model_dump()
BASE_JOB = base_job(build_config(BASE))
SPACE = SearchSpace(tp=(1,), pp=(1,), micro_batch_sizes=(1,), ac=("none",))


@pytest.fixture
def any_saving(monkeypatch):
    monkeypatch.setattr(ex, "MIN_SAVING", 100.0)


def _direct(rank: int) -> dict:
    cfg = build_config({**BASE, "world": {"world_size": 2, "rank": rank}, "training": {**BASE["training"],
                        "num_micro_batches": 6}})  # fmt: skip
    return build_report(run_job(cfg, capture_stacks=False))["summary"]


def test_an_extrapolated_layout_is_judged_on_the_device_figure_of_its_written_blocks_without_a_second_run(
    any_saving,
):
    outcome = fit(FitJob(BASE_JOB, 4 * GIB, 12, SPACE, top=1), InlineExecutor(), ResultCache(None))
    (r,) = outcome.results
    assert r.status == FITS and r.basis == "device"
    assert r.classes and all(not c.confirmed and c.figures.method == EXTRAPOLATED for c in r.classes)
    for c in r.classes:
        direct = _direct(c.rank_class.representative)
        assert (c.figures.peak_bytes, c.figures.peak_reserved_bytes, c.figures.peak_device_bytes) == (
            direct["peak_bytes"],
            direct["peak_reserved_bytes"],
            direct["peak_device_bytes"],
        )
    assert outcome.counts()["confirmed"] == 0 and outcome.counts()["extrapolated"] == len(r.classes)
    assert "device peak" in r.reason


def test_where_the_blocks_cannot_be_written_down_the_layout_is_run_again_in_full(any_saving, monkeypatch):
    import hyperdryrun.search.synthesis as synthesis

    def refuse(*args, **kwargs):
        raise ex.ShortcutFailed("refused by the test")

    monkeypatch.setattr(synthesis, "synthesize", refuse)
    outcome = fit(FitJob(BASE_JOB, 4 * GIB, 12, SPACE, top=1), InlineExecutor(), ResultCache(None))
    (r,) = outcome.results
    assert r.status == FITS and r.basis == "device"
    assert r.classes and all(c.confirmed and c.figures.method == FULL for c in r.classes)
    for c in r.classes:
        direct = _direct(c.rank_class.representative)
        assert (c.figures.peak_bytes, c.figures.peak_device_bytes) == (
            direct["peak_bytes"],
            direct["peak_device_bytes"],
        )
    assert outcome.counts()["confirmed"] == len(r.classes) == outcome.counts()["extrapolated"]
    assert "device peak" in r.reason


def test_a_layout_over_the_capacity_on_the_device_figure_is_an_oom_though_its_allocated_bytes_fit(any_saving):
    summary = _direct(0)
    allocated, device = summary["peak_bytes"], summary["peak_device_bytes"]
    assert allocated < device
    capacity = (allocated + device) // 2
    outcome = fit(FitJob(BASE_JOB, capacity, 12, SPACE, top=1), InlineExecutor(), ResultCache(None))
    (r,) = outcome.results
    assert r.status == OOM and "device peak" in r.reason
    assert outcome.ranked() == []


def _figures(method: str, device: int | None) -> dict:
    phase = PhasePeak(GIB, "mm", {"Activation": GIB})
    return StepFigures(GIB, "forward", "mm", {"Activation": GIB}, 0, 0, {}, {"forward": phase},
                       device, device, method).to_dict()  # fmt: skip


class Scripted:
    """An executor whose simulations are scripted: every rank's extrapolated figures are 1 GiB allocated; a full
    run gives 3 GiB device on the layout dry-run first (the fastest) and 1.5 GiB on the others."""

    def __init__(self) -> None:
        self.first: int | None = None
        self.runs: list[tuple[int, bool]] = []

    def imap(self, tasks):
        for task in tasks:
            mbs = task.job["training"]["micro_batch_size"]
            self.first = mbs if self.first is None else self.first
            self.runs.append((mbs, task.shortcut))
            device = None if task.shortcut else (3 if mbs == self.first else 1.5) * GIB
            yield TaskResult(task.key, _figures(EXTRAPOLATED if task.shortcut else FULL, device),
                             versions={})  # fmt: skip


def test_when_the_fastest_layout_fails_its_confirmation_the_search_goes_on_to_the_next():
    space = SearchSpace(tp=(1,), pp=(1,), micro_batch_sizes=(1, 2), ac=("none",))
    executor = Scripted()
    outcome = fit(FitJob(BASE_JOB, 2 * GIB, 12, space, top=1), executor, ResultCache(None))
    by_mbs = {r.candidate.layout.micro_batch_size: r for r in outcome.results}
    first, second = executor.first, 3 - executor.first
    assert by_mbs[first].status == OOM and by_mbs[second].status == FITS
    assert [r.candidate.layout.micro_batch_size for r in outcome.ranked()] == [second]
    # Each layout: its classes extrapolated, then the same classes in full.
    for mbs in (first, second):
        n = len(by_mbs[mbs].classes)
        assert executor.runs.count((mbs, True)) == n and executor.runs.count((mbs, False)) == n


def test_progress_names_the_simulations_in_flight():
    space = SearchSpace(tp=(1,), pp=(1,), micro_batch_sizes=(1, 2), ac=("none",))
    seen: list[dict] = []
    outcome = fit(FitJob(BASE_JOB, 2 * GIB, 12, space, top=1), Scripted(), ResultCache(None),
                  on_progress=lambda o: seen.append(dict(o.running)))  # fmt: skip
    doing = {v for s in seen for v in s.values()}
    assert "dp2 1x6 none: rank 0" in doing and "dp2 2x3 none: rank 0 in full" in doing
    assert outcome.running == {}


def test_the_time_left_is_the_layouts_in_flight_unanswered_classes_at_the_mean_class_time():
    from hyperdryrun.search.fit import CandidateResult, ClassResult, FitOutcome, eta_in_flight

    fig = StepFigures.from_dict(_figures(EXTRAPOLATED, None))

    def cls(key, seconds=0.0, done=False, cached=False):
        return ClassResult(None, key, fig if done else None, cached=cached, seconds=seconds)

    # Layout 1 in flight: two classes simulated (10 s, 30 s), two left (one of them running); layout 2: one class
    # from the cache (its 5 s not a simulation's), one left but not in flight (the search may stop before it).
    one = CandidateResult(None, "", classes=[cls("a", 10, True), cls("b", 30, True), cls("c"), cls("d")])
    two = CandidateResult(None, "", classes=[cls("e", 5, True, cached=True), cls("f")])
    outcome = FitOutcome(None, [one, two], running={"c": "rank 1"})
    assert eta_in_flight(outcome, workers=2) == 2 * 20 / 2
    assert eta_in_flight(FitOutcome(None, [two], running={"f": "rank 0"}), workers=2) is None
    # A layout that cannot fit with margin (deferred): only its class in flight is left, not the waiting ones.
    three = CandidateResult(
        None, "", classes=[cls("g", 20, True), cls("h"), cls("i")], deferred="within margin"
    )
    outcome = FitOutcome(None, [one, three], running={"c": "rank 1", "h": "rank 2"})
    assert eta_in_flight(outcome, workers=2) == (2 + 1) * 20 / 2


class OverOnDevice:
    """Scripted: rank 0 is extrapolated at 1 GiB allocated with a 3 GiB device figure from its written blocks;
    every other rank at 1 GiB on both."""

    def __init__(self) -> None:
        self.ranks: list[int] = []

    def imap(self, tasks):
        for task in tasks:
            rank = task.job["world"]["rank"]
            self.ranks.append(rank)
            yield TaskResult(task.key, _figures(EXTRAPOLATED, (3 if rank == 0 else 1) * GIB), versions={})


def test_one_stage_over_the_capacity_on_the_device_figure_settles_the_layout_without_its_other_stages():
    # Two pipeline stages, two rank classes (0 and 1). Allocated bytes (1 GiB) fit the 2 GiB; rank 0's device
    # figure (3 GiB) does not, and every figure the verdict can read includes it: the layout is an OOM on rank 0,
    # and rank 1 is never simulated (before, a layout was only cut short on allocated bytes).
    space = SearchSpace(tp=(1,), pp=(2,), micro_batch_sizes=(1,), ac=("none",))
    executor = OverOnDevice()
    outcome = fit(FitJob(BASE_JOB, 2 * GIB, 12, space, top=1), executor, ResultCache(None))
    (r,) = outcome.results
    assert [c.rank_class.representative for c in r.classes] == [0, 1]
    assert executor.ranks == [0]
    assert r.status == OOM and r.reason == "rank 0: device peak 3.00 GiB > 2.00 GiB"
    assert outcome.ranked() == []


def _first_layouts_first_stage_over(first: bool, rank: int) -> float:
    return 3 if (first, rank) == (True, 0) else 1


class TwoAtOnce:
    """A pool of two workers, scripted: it starts what the search hands it until two tasks are in flight (or the
    search yields WAIT or has nothing left), then answers the oldest one. ``gib(first, rank)``: the peak (allocated
    and device) of ``rank`` of the first layout dry-run (``first``) or of another, in GiB (default: the first
    layout's rank 0 at 3 GiB, every other rank at 1 GiB)."""

    def __init__(self, gib=None) -> None:
        # (micro batch size, rank), in the order the search started them
        self.started: list[tuple[int, int]] = []
        self.events: list[tuple[str, int, int]] = []  # ("start" | "answer", micro batch size, rank)
        self.first: int | None = None
        self.gib = gib or _first_layouts_first_stage_over

    def imap(self, tasks):
        pending, flight, exhausted = iter(tasks), [], False
        while True:
            while not exhausted and len(flight) < 2:
                task = next(pending, None)
                if task is None:
                    exhausted = True
                elif task is WAIT:
                    break
                else:
                    mbs, rank = task.job["training"]["micro_batch_size"], task.job["world"]["rank"]
                    self.first = mbs if self.first is None else self.first
                    self.started.append((mbs, rank))
                    self.events.append(("start", mbs, rank))
                    flight.append(task)
            if not flight:
                return
            task = flight.pop(0)
            mbs, rank = task.job["training"]["micro_batch_size"], task.job["world"]["rank"]
            peak = int(self.gib(mbs == self.first, rank) * GIB)
            self.events.append(("answer", mbs, rank))
            yield TaskResult(task.key, _figures(EXTRAPOLATED, peak) | {"peak_bytes": peak}, versions={})


def _two_stage_layouts(gib, top: int = 1, margin: int = 0):
    """The two 2-stage layouts (micro batches of 1 and 2) searched at 2 GiB on a :class:`TwoAtOnce` pool scripted
    by ``gib``: the pool, the outcome, the micro batch sizes of the layout dry-run first and of the other, and the
    results by micro batch size."""
    space = SearchSpace(tp=(1,), pp=(2,), micro_batch_sizes=(1, 2), ac=("none",))
    pool = TwoAtOnce(gib)
    outcome = fit(FitJob(BASE_JOB, 2 * GIB, 12, space, top=top, margin_bytes=margin), pool, ResultCache(None))
    by_mbs = {r.candidate.layout.micro_batch_size: r for r in outcome.results}
    return pool, outcome, pool.first, 3 - pool.first, by_mbs


def test_while_a_layouts_first_stage_runs_a_free_worker_takes_the_next_layouts_first_stage():
    # Two 2-stage layouts, two workers. The fastest layout's first stage is over the capacity: it is the only class
    # of that layout simulated; the second worker took the next layout's first stage meanwhile, and that layout's
    # last stage started once its first was known to fit. Before, the second worker ran the first layout's last
    # stage, which its first stage's answer made unnecessary.
    pool, outcome, first, second, by_mbs = _two_stage_layouts(_first_layouts_first_stage_over)
    assert pool.started == [(first, 0), (second, 0), (second, 1)]
    assert by_mbs[first].status == OOM and by_mbs[first].reason == "rank 0: device peak 3.00 GiB > 2.00 GiB"
    assert by_mbs[second].status == FITS
    assert outcome.ranked() == [by_mbs[second]] and outcome.running == {}


def test_once_a_layouts_first_stage_fits_its_other_stages_run_and_nothing_of_a_slower_layout():
    # The same two layouts, all of whose ranks fit: the second worker took the slower layout's first stage while the
    # fastest layout's ran; once that fit, the fastest layout's last stage ran, not the slower one's. The fastest
    # fits, so the slower is not needed: stopped after one class, no peak of its own in the results.
    pool, outcome, first, second, by_mbs = _two_stage_layouts(lambda first, rank: 1)
    assert pool.started == [(first, 0), (second, 0), (first, 1)]
    assert by_mbs[first].status == FITS and outcome.ranked() == [by_mbs[first]]
    slower = by_mbs[second]
    assert slower.status == "skipped" and slower.classes == [] and slower.stopped == 1
    assert slower.reason == "not needed: 1 faster layouts fit (stopped after 1 of its 2 rank classes)"
    counts = outcome.counts()
    assert counts["rank_classes"] == 2 and counts["stopped_classes"] == 1 and counts["skipped"] == 1


def test_a_layout_within_the_margin_on_one_stage_waits_while_another_fits_with_margin():
    # 2 GiB, 1 GiB margin. The fastest layout's first stage is at 1.5 GiB: at risk or worse, it cannot count
    # towards --top 1, so its last stage waits; the slower layout fits with margin (0.5 GiB everywhere) and the
    # search ends without the waiting stage (before, it ran, to rank a layout at risk the table does not show).
    pool, outcome, first, second, by_mbs = _two_stage_layouts(
        lambda first, rank: 1.5 if (first, rank) == (True, 0) else 0.5, margin=GIB
    )
    assert pool.started == [(first, 0), (second, 0), (second, 1)]
    assert by_mbs[second].status == FITS and outcome.ranked() == [by_mbs[second]]
    waited = by_mbs[first]
    assert waited.status == "skipped" and waited.classes == [] and waited.stopped == 1
    assert waited.reason == (
        "not needed: rank 0's device peak 1.50 GiB is within the 1.00 GiB margin under 2.00 GiB; 1 layouts fit "
        "with margin (stopped after 1 of its 2 rank classes)"
    )


def test_when_fewer_layouts_fit_with_margin_than_top_the_waiting_layouts_are_run_out_and_ranked_at_risk():
    # Every layout's first stage is within the margin: none fits with margin, so the table ranks those at risk,
    # and each needs its every class: the same statuses as a search that runs every layout out (--top 0).
    def gib(first, rank):
        return 1.5 if rank == 0 else (1.75 if first else 0.5)

    results = {}
    for top in (1, 0):
        pool, outcome, *_ = _two_stage_layouts(gib, top=top, margin=GIB)
        assert sorted(pool.started) == [(1, 0), (1, 1), (2, 0), (2, 1)]
        results[top] = [(r.status, r.reason) for r in outcome.ranked()]
    # Fastest first: the first layout dry-run, whose worst rank is its last stage, then the other.
    assert results[0] == [
        ("at_risk", "rank 1: device peak 1.75 GiB <= 2.00 GiB, within the 1.00 GiB margin"),
        ("at_risk", "rank 0: device peak 1.50 GiB <= 2.00 GiB, within the 1.00 GiB margin"),
    ]
    assert results[1] == results[0][:1]


def test_the_live_line_counts_the_layouts_waiting_within_the_margin():
    from hyperdryrun.commands.fit import progress_state
    from hyperdryrun.search.fit import CandidateResult, ClassResult, FitOutcome

    fig = StepFigures.from_dict(_figures(EXTRAPOLATED, GIB))
    waiting = CandidateResult(None, "", classes=[ClassResult(None, "a", fig, seconds=10), ClassResult(None, "b")],
                              deferred="rank 0 within the margin")  # fmt: skip
    running = CandidateResult(None, "", classes=[ClassResult(None, "c")])
    state = progress_state(
        FitOutcome(None, [waiting, running], running={"c": "dp2 1x6 none: rank 0"}), workers=1
    )
    assert state == (
        "fit 0 · 1 within the margin (waiting) · ~10 s left for the layouts in flight · dp2 1x6 none: rank 0"
    )
    # the other statuses once they occur, in a fixed order; nothing running: no time left nor layout
    done = [CandidateResult(None, status) for status in ("failed", "oom", "fits", "oom", "pruned")]
    assert progress_state(FitOutcome(None, done), workers=1) == "fit 1 · oom 2 · pruned 1 · failed 1"


def test_with_top_0_a_free_worker_goes_on_to_the_next_layout_once_a_first_stage_fits():
    # Every layout is run out with --top 0: nothing is speculative, so no worker waits.
    pool, outcome, f, s, _ = _two_stage_layouts(lambda first, rank: 1, top=0)
    # the slower layout's last stage starts while the faster one's runs (with --top 1 it would wait for it)
    assert pool.events == [("start", f, 0), ("start", s, 0), ("answer", f, 0), ("start", f, 1),
                           ("answer", s, 0), ("start", s, 1), ("answer", f, 1), ("answer", s, 1)]  # fmt: skip
    assert [r.status for r in outcome.results] == [FITS, FITS]
