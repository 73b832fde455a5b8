"""``fit`` knows the model's error: a layout whose worst peak is within the margin under the capacity is "at risk",
flagged in the table, JSON and CSV, ranked after every layout that fits with margin, and not counted towards
``--top``; the exit code needs a layout that fits with margin."""

from __future__ import annotations

import csv
import io

from hyperdryrun.commands.fit import outcome_csv, outcome_dict
from hyperdryrun.search.cache import ResultCache
from hyperdryrun.search.extrapolate import FULL, PhasePeak, StepFigures
from hyperdryrun.search.fit import AT_RISK, FITS, FitJob, fit
from hyperdryrun.search.space import SearchSpace
from tests.search.test_fit_confirm import BASE_JOB

GIB = 2**30
SPACE = SearchSpace(tp=(1,), pp=(1,), micro_batch_sizes=(1, 2), ac=("none",))
CAPACITY, MARGIN = 2 * GIB, GIB // 10  # "fits" up to 1.9 GiB, "at risk" above it up to 2 GiB


class Scripted:
    """Full runs whose device figure is scripted: 1.95 GiB (inside the margin) on the layout dry-run first, the
    fastest, and 1.5 GiB (clear of it) on the other."""

    def __init__(self) -> None:
        self.first: int | None = None

    def imap(self, tasks):
        from hyperdryrun.search.executors import TaskResult

        for task in tasks:
            mbs = task.job["training"]["micro_batch_size"]
            self.first = mbs if self.first is None else self.first
            device = int(1.95 * GIB) if mbs == self.first else int(1.5 * GIB)
            phase = PhasePeak(GIB, "mm", {"Activation": GIB})
            figures = StepFigures(GIB, "forward", "mm", {"Activation": GIB}, 0, 0, {}, {"forward": phase},
                                  device, device, FULL)  # fmt: skip
            yield TaskResult(task.key, figures.to_dict(), versions={})


def _search(top: int, margin: int = MARGIN):
    executor = Scripted()
    job = FitJob(
        BASE_JOB, CAPACITY, 12, SPACE, top=top, shortcut=False, margin_bytes=margin, margin_source="test"
    )
    outcome = fit(job, executor, ResultCache(None))
    by_mbs = {r.candidate.layout.micro_batch_size: r for r in outcome.results}
    return outcome, by_mbs[executor.first], by_mbs[3 - executor.first]


def test_the_faster_layout_at_risk_ranks_after_the_slower_one_that_fits_with_margin():
    outcome, fastest, other = _search(top=0)
    assert fastest.time.total < other.time.total
    assert (fastest.status, other.status) == (AT_RISK, FITS)
    assert "within the 0.10 GiB margin" in fastest.reason
    assert outcome.ranked() == [other, fastest]
    assert outcome.fits_with_margin() == [other]
    assert outcome.counts()["at_risk"] == 1 and outcome.counts()["fits"] == 1


def test_top_counts_only_layouts_that_fit_with_margin():
    outcome, fastest, other = _search(top=1)
    assert outcome.ranked() == [other]  # the search went on past the faster layout at risk


def test_without_a_margin_the_faster_layout_fits_and_ranks_first():
    outcome, fastest, other = _search(top=0, margin=0)
    assert (fastest.status, other.status) == (FITS, FITS)
    assert outcome.ranked() == [fastest, other]


def test_json_and_csv_flag_the_layout_at_risk():
    outcome, fastest, other = _search(top=0)
    data = outcome_dict(outcome)
    assert (data["capacity_bytes"], data["margin_bytes"], data["margin_source"]) == (CAPACITY, MARGIN, "test")
    status = {row["micro_batch_size"]: row["status"] for row in data["candidates"]}
    assert status == {
        fastest.candidate.layout.micro_batch_size: "at_risk",
        other.candidate.layout.micro_batch_size: "fits",
    }
    rows = list(csv.DictReader(io.StringIO(outcome_csv(outcome))))
    assert {row["micro_batch_size"]: row["status"] for row in rows} == {str(k): v for k, v in status.items()}
    head = {row["status"]: int(row["headroom_bytes"]) for row in rows}
    assert head == {"at_risk": CAPACITY - int(1.95 * GIB), "fits": CAPACITY - int(1.5 * GIB)}
