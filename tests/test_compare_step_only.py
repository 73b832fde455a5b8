"""compare against a side that lacks the memory that existed before its record began (a CPU profiler trace): it
compares what both sides see, the allocations made during the step per category, and reports the baseline apart.

A: the fixture's real CPU profiler trace of one TinyNet step (tests/ingest/fixtures/make_fixtures.py: the model,
its AdamW states and the batch exist before profiling starts). B: the dry run of the same step, whose step function
is the fixture's (the loss is alive until the step returns)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from hyperdryrun.cli import main
from hyperdryrun.compare import DEFAULT_TOLERANCE, Side, as_report, compare
from hyperdryrun.report.reader import load_any
from tests.ingest.fixtures.make_fixtures import BATCH, DIM, HIDDEN, OUT, TinyNet, adamw, make_batch

TRACE = Path(__file__).resolve().parent / "ingest" / "fixtures" / "tiny_step.trace.json.gz"
FP32 = 4
# TinyNet: two blocks (fc1 DIM->HIDDEN, fc2 HIDDEN->DIM) and a head DIM->OUT, each with a bias
PARAMS = 2 * (DIM * HIDDEN + HIDDEN + HIDDEN * DIM + DIM) + DIM * OUT + OUT


def fixture_step(model, optimizer, batches) -> None:
    """make_fixtures.chrome_trace's step: the loss stays alive until the step returns."""
    for x in batches:
        loss = model(x).sum()
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@pytest.fixture(scope="module")
def dry():
    import hyperdryrun

    return hyperdryrun.simulate(
        TinyNet,
        make_batch,
        step_fn=fixture_step,
        optimizer_fn=adamw,
        target_device="cpu",
        capture_stacks=False,
    )


def trace_peak() -> int:
    """The profiler's own figure: the most its 'Total Allocated' counter reached during the step."""
    events = json.loads(gzip.decompress(TRACE.read_bytes()))["traceEvents"]
    return max(e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]")


def test_step_only_agrees_within_compares_tolerance_and_the_baseline_is_apart(dry):
    loaded = load_any(TRACE)
    trace = Side("trace", "chrome_trace", as_report(loaded), loaded)
    res = compare(trace, Side("dry", "dry-run", as_report(dry), dry))
    assert res["a"]["initial_bytes"] == 0 and res["b"]["initial_bytes"] == dry.initial > 0
    step = res["step_only"]
    # the dry run's step-made bytes at its peak: the peak less the residents (all alive then) and the batch
    batch = BATCH * DIM * FP32
    assert step["peak"]["a"] == trace_peak()
    assert step["peak"]["b"] == dry.peak - dry.initial - batch
    assert step["input_data"] == {"a": 0, "b": batch, "diff": batch, "rel_error": None}
    assert abs(step["peak"]["rel_error"]) <= DEFAULT_TOLERANCE, step["peak"]
    for category, row in step["categories_at_peak"].items():
        assert row["a"] > 0 and abs(row["rel_error"]) <= DEFAULT_TOLERANCE, (category, row)
    assert res["judged_on"] == "step_only" and res["within_tolerance"]
    # whole-step figures still differ by the residents, which stand apart as the baseline
    assert res["peak"]["rel_error"] > DEFAULT_TOLERANCE
    base = step["baseline"]
    assert base["bytes"] == {"a": 0, "b": 3 * FP32 * PARAMS, "diff": 3 * FP32 * PARAMS, "rel_error": None}
    assert {c: r["b"] for c, r in base["categories"].items()} == {
        "Parameter": FP32 * PARAMS,
        "Optstate": 2 * FP32 * PARAMS,  # exp_avg, exp_avg_sq; the foreach step counts are host scalars
    }


def test_the_command_prints_the_step_only_comparison_and_the_baseline_apart(dry, tmp_path, capsys):
    import hyperdryrun

    hyperdryrun.save_reports(dry, tmp_path)
    report = next(tmp_path.rglob("*_memory.json"))
    rc = main(["compare", str(TRACE), str(report)])
    out = " ".join(capsys.readouterr().out.split())
    assert rc == 0
    assert "within tolerance 1% on the step only" in out
    assert "no relative figures for the whole step: A has no baseline" in out
    assert "step only: its peak and the categories there <- judged" in out
    assert "baseline, apart: bytes alive when each record began" in out
    assert f"+{3 * FP32 * PARAMS:,} B" in out


def test_both_sides_with_a_baseline_are_judged_on_the_whole_peak(dry):
    side = Side("dry", "dry-run", as_report(dry), dry)
    res = compare(side, side)
    assert res["judged_on"] == "peak" and res["step_only"]["peak"]["diff"] == 0
