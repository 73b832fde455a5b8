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
from hyperdryrun.search.executors import InlineExecutor, TaskResult
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
