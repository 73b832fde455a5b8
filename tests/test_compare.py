"""``hyperdryrun compare``: zero error against itself, a known error against a hand-modified copy, exit codes,
JSON keys, and one-line errors (exit 2, nothing written) on bad input."""

from __future__ import annotations

import csv
import gzip
import io
import json
import pickle
import re
import shutil
from pathlib import Path

import pytest

from hyperdryrun.cli import OneLineParser
from hyperdryrun.commands.compare import register
from hyperdryrun.compare import Side, as_report, compare, norm_op, unmatched_blocks
from hyperdryrun.report import blocks_csv, build_report, write_reports
from hyperdryrun.report.reader import load_any
from hyperdryrun.report.schema import CSV_COLUMNS, SUMMARY_DEVICE_KEYS
from tests.conftest import dry_run

FIXTURES = Path(__file__).parent / "ingest" / "fixtures"
SIZE, START, END = (
    CSV_COLUMNS.index("size"),
    CSV_COLUMNS.index("start_time_stamp"),
    CSV_COLUMNS.index("end_time_stamp"),
)
TYPE = CSV_COLUMNS.index("type")
KEYS = {
    "a",
    "b",
    "peak",
    "allocated",
    "peak_without_kernel_scratch",
    "judged_on",
    "tolerance",
    "within_tolerance",
    "step_only",
    "categories_at_peak",
    "phases",
    "modules",
    "reserved",
    "blocks",
}


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory) -> Path:
    """A dry-run report of llama-tiny (rank 0 of 1) written as the CLI writes it."""
    out = tmp_path_factory.mktemp("dry")
    trace = dry_run()
    write_reports(build_report(trace), blocks_csv(trace), out, 0)
    return out / "rank_0"


def cli(argv: list[str], capsys) -> tuple[int, str, str]:
    parser = OneLineParser(prog="hyperdryrun")
    register(parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser))
    try:
        args = parser.parse_args(["compare", *argv])
        rc = args.func(args)
    except SystemExit as exc:
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, err


def modified_csv(src: Path, dst: Path, extra: int) -> tuple[int, dict[str, str]]:
    """Copy the CSV, growing the largest block alive at the report's peak by ``extra`` bytes; returns its old
    size and category."""
    report = json.loads(src.with_suffix(".json").read_text())
    peak_task = report["summary"]["peak_task"]
    rows = list(csv.reader(io.StringIO(src.read_text())))
    alive = [r for r in rows[1:] if int(r[START]) <= peak_task < int(r[END])]
    target = max(alive, key=lambda r: int(r[SIZE]))
    old = int(target[SIZE])
    target[SIZE] = str(old + extra)
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(rows)
    dst.write_text(buf.getvalue())
    return old, {"category": target[TYPE]}


def test_a_report_against_itself_has_zero_error(report_dir, capsys):
    path = str(report_dir / "rank_0_memory.json")
    rc, out, err = cli([path, path, "--json"], capsys)
    assert (rc, err) == (0, "")
    res = json.loads(out)
    assert set(res) == KEYS
    assert res["allocated"] is None  # no CUDA snapshot side: the tensor peaks are compared
    assert res["peak"]["diff"] == 0 and res["peak"]["rel_error"] == 0.0
    assert all(c["diff"] == 0 for c in res["categories_at_peak"].values())
    assert all(p["diff"] == 0 for p in res["phases"].values())
    assert res["modules"] and all(
        m["forward_peak_bytes"]["diff"] == 0 and m["backward_peak_bytes"]["diff"] == 0 for m in res["modules"]
    )
    assert res["blocks"]["only_in_a"]["count"] == res["blocks"]["only_in_b"]["count"] == 0
    assert res["blocks"]["live_sets_complete"] is True


def test_a_report_saved_with_a_byte_order_mark_reads_as_the_report(report_dir, tmp_path, capsys):
    """An editor that saves UTF-8 with a BOM leaves the JSON a JSON (json reads it): the same report, zero error."""
    shutil.copytree(report_dir, tmp_path / "bom")
    bom = tmp_path / "bom" / "rank_0_memory.json"
    bom.write_bytes(b"\xef\xbb\xbf" + bom.read_bytes())
    rc, out, err = cli([str(bom), str(report_dir / "rank_0_memory.json"), "--json"], capsys)
    assert (rc, err) == (0, "")
    assert json.loads(out)["peak"]["diff"] == 0


def test_report_and_its_csv_alone_agree_on_peak_live_set_and_categories(report_dir, capsys):
    rc, out, _ = cli(
        [str(report_dir / "rank_0_memory.json"), str(report_dir / "rank_0_memory.csv"), "--json"], capsys
    )
    res = json.loads(out)
    assert rc == 0 and res["peak"]["diff"] == 0
    assert all(c["diff"] == 0 for c in res["categories_at_peak"].values())
    assert res["blocks"]["only_in_a"]["count"] == res["blocks"]["only_in_b"]["count"] == 0
    assert res["modules"] == []  # a CSV has no module statistics


def test_a_hand_modified_copy_shows_the_known_error(report_dir, tmp_path, capsys):
    src = report_dir / "rank_0_memory.csv"
    peak = json.loads(src.with_suffix(".json").read_text())["summary"]["peak_bytes"]
    extra = 64 * 1024
    old, info = modified_csv(src, tmp_path / "modified.csv", extra)
    rc, out, _ = cli([str(src.with_suffix(".json")), str(tmp_path / "modified.csv"), "--json"], capsys)
    res = json.loads(out)
    assert res["peak"] == {"a": peak, "b": peak + extra, "diff": extra, "rel_error": round(extra / peak, 9)}
    assert extra / peak > 0.01 and rc == 1 and res["within_tolerance"] is False
    cats = res["categories_at_peak"]
    assert cats[info["category"]]["diff"] == extra
    assert all(c["diff"] == 0 for name, c in cats.items() if name != info["category"])
    only_a, only_b = res["blocks"]["only_in_a"], res["blocks"]["only_in_b"]
    assert (only_a["count"], only_a["bytes"]) == (1, old)
    assert (only_b["count"], only_b["bytes"]) == (1, old + extra)
    rc, _, _ = cli(
        [str(src.with_suffix(".json")), str(tmp_path / "modified.csv"), "--tolerance", "0.5"], capsys
    )
    assert rc == 0


def test_json_output_is_deterministic(report_dir, capsys):
    argv = [str(FIXTURES / "tiny_step.trace.json.gz"), str(report_dir / "rank_0_memory.json"), "--json"]
    first = cli(argv, capsys)
    assert first == cli(argv, capsys)


def test_human_table_is_the_default(report_dir, capsys):
    path = str(report_dir / "rank_0_memory.json")
    rc, out, _ = cli([path, path], capsys)
    assert rc == 0
    assert "peak A" in out and "categories at each side's peak" in out and "phase peaks" in out


def test_trace_snapshot_and_report_compare_with_each_other(report_dir, capsys):
    trace = str(FIXTURES / "tiny_step.trace.json.gz")
    snap = str(FIXTURES / "tiny.snapshot.pickle")
    rc, out, _ = cli([trace, snap, "--json"], capsys)
    res = json.loads(out)
    assert rc == 1
    assert res["a"]["kind"] == "chrome_trace" and res["b"]["kind"] == "cuda_snapshot"
    assert res["peak"]["a"] == load_any(trace).peak and res["peak"]["b"] == 14 * (1 << 20) + 1024


def test_blocks_pair_by_op_and_module_before_size_alone():
    a = [
        {"size": 10, "op": "aten::mm", "module": "x", "id": 0},
        {"size": 10, "op": "aten::add", "module": "y", "id": 1},
        {"size": 7, "op": "aten::mm", "module": "x", "id": 2},
    ]
    b = [
        {"size": 10, "op": "add", "module": "z", "id": 5},
        {"size": 10, "op": "mm.default", "module": "x", "id": 6},
        {"size": 8, "op": "mm", "module": "x", "id": 7},
    ]
    only_a, only_b = unmatched_blocks(a, b)
    assert [x["id"] for x in only_a] == [2] and [x["id"] for x in only_b] == [7]
    assert norm_op("aten::mm") == norm_op("aten.mm.default") == norm_op("mm") == "mm"


def test_zero_reference_peak_has_no_relative_error_and_fails(report_dir):
    rep = as_report(load_any(report_dir / "rank_0_memory.json"))
    zero = json.loads(json.dumps(rep))
    zero["summary"]["peak_bytes"] = 0
    res = compare(Side("z", "report", zero), Side("r", "report", rep))
    assert res["peak"]["rel_error"] is None and res["within_tolerance"] is False


def _bad_inputs(tmp: Path, report_dir: Path) -> dict[str, tuple[Path, str]]:
    full = (report_dir / "rank_0_memory.json").read_text()
    cases = {
        "missing": (tmp / "nope.json", "no such file"),
        "truncated": (tmp / "trunc.json", "invalid or truncated JSON"),
        "foreign": (tmp / "foreign.json", "neither a HyperDryRun report nor a Chrome trace"),
        "not_snapshot": (tmp / "list.pickle", "no 'segments'"),
        "object_pickle": (tmp / "obj.pickle", "not a CUDA memory snapshot pickle"),
        "empty_trace": (tmp / "empty.json", "no \\[memory\\] events"),
        "empty_file": (tmp / "empty.csv", "empty file"),
        "blank_file": (tmp / "blank.csv", "empty file"),
        "foreign_csv": (tmp / "other.csv", "not a memory-block CSV"),
        "garbage": (
            tmp / "damaged.pickle",
            "unrecognised file \\(not JSON, CSV or a snapshot pickle\\): starts 'no",
        ),
        "error_report": (tmp / "err.json", "an error report"),
        "gz_garbage": (tmp / "g.json.gz", "corrupt gzip"),
    }
    cases["truncated"][0].write_text(full[: len(full) // 2])
    cases["foreign"][0].write_text(json.dumps({"hello": [1, 2]}))
    cases["not_snapshot"][0].write_bytes(pickle.dumps([1, 2, 3]))
    cases["object_pickle"][0].write_bytes(pickle.dumps(Path("/")))
    cases["empty_trace"][0].write_text(json.dumps({"traceEvents": []}))
    cases["empty_file"][0].write_text("")
    cases["blank_file"][0].write_text(" \n\n")
    cases["foreign_csv"][0].write_text("a,b,c\n1,2,3\n")
    cases["garbage"][0].write_text("not a pickle\n")
    cases["error_report"][0].write_text(
        json.dumps(
            {"schema_version": "1.0", "status": "error", "stage": "step", "error": {"message": "boom"}}
        )
    )
    cases["gz_garbage"][0].write_bytes(gzip.compress(b"{}")[:6])
    return cases


def test_bad_input_is_one_line_exit_2_and_writes_nothing(report_dir, tmp_path, capsys, monkeypatch):
    inputs = tmp_path / "in"
    inputs.mkdir()
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    good = str(report_dir / "rank_0_memory.json")
    for name, (path, message) in _bad_inputs(inputs, report_dir).items():
        before = sorted(p.name for p in inputs.iterdir())
        for argv in ([str(path), good], [good, str(path)]):
            rc, out, err = cli(argv, capsys)
            assert rc == 2, name
            assert out == "", name
            assert err.startswith(f"hyperdryrun: error: {path}: ") and err.count("\n") == 1, (name, err)
            assert "Traceback" not in err
            assert re.search(message, err), (name, err)
        assert sorted(p.name for p in inputs.iterdir()) == before
    assert list(cwd.iterdir()) == []


@pytest.mark.parametrize("flag", [["--tolerance", "-1"], ["--tolerance", "nan"], ["--top", "-2"]])
def test_bad_flags_are_one_line_exit_2(report_dir, capsys, flag):
    path = str(report_dir / "rank_0_memory.json")
    rc, out, err = cli([path, path, *flag], capsys)
    assert rc == 2 and out == "" and err.startswith("hyperdryrun: error: ") and err.count("\n") == 1


def test_csv_that_disagrees_with_its_json_is_refused(report_dir, tmp_path, capsys):
    dst = tmp_path / "rank_0"
    shutil.copytree(report_dir, dst)
    modified_csv(report_dir / "rank_0_memory.csv", dst / "rank_0_memory.csv", 512)
    rc, _, err = cli([str(dst / "rank_0_memory.json"), str(report_dir / "rank_0_memory.json")], capsys)
    assert rc == 2 and "is not the CSV its report was written with" in err and err.count("\n") == 1
    # a report from before the pair named its CSV: the blocks alive at the peak must still sum to the peak
    report = json.loads((dst / "rank_0_memory.json").read_text())
    del report["csv_file"]
    (dst / "rank_0_memory.json").write_text(json.dumps(report))
    rc, _, err = cli([str(dst / "rank_0_memory.json"), str(report_dir / "rank_0_memory.json")], capsys)
    assert rc == 2 and "the report's peak is" in err and err.count("\n") == 1


def test_cpu_trace_and_dry_run_of_the_same_step_differ_only_by_what_the_trace_cannot_see():
    """The fixture trace profiles a real CPU step of TinyNet; the dry run of the same step (target cpu) must hold the
    same storages at its peak, except the ones created before the profiled window (parameters, optimizer states,
    the batch: the CPU profiler does not report them) and 0-dim host scalars the dry run leaves out."""
    from hyperdryrun.engine import simulate
    from tests.ingest.fixtures.make_fixtures import BATCH, DIM, TinyNet, adamw, make_batch

    dry = simulate(
        TinyNet, make_batch, loss_fn=lambda m, x: m(x).sum(), optimizer_fn=adamw, target_device="cpu"
    )
    trace = Side("trace", "chrome_trace", as_report(load_any(FIXTURES / "tiny_step.trace.json.gz")))
    res = compare(trace, Side("dry", "dry-run", as_report(dry)), top=1000)
    only_trace, only_dry = res["blocks"]["only_in_a"], res["blocks"]["only_in_b"]
    assert only_dry["bytes"] == dry.initial + BATCH * DIM * 4
    assert {b["phase"] for b in only_dry["largest"]} == {"initialization", "forward"}
    assert all(b["size"] <= 8 for b in only_trace["largest"])
    assert res["peak"]["diff"] == only_dry["bytes"] - only_trace["bytes"]


def _without_num_tasks(phases: dict) -> dict:
    return {p: {k: v for k, v in d.items() if k != "num_tasks"} for p, d in phases.items()}


@pytest.mark.parametrize(
    "over",
    [
        {},
        {"world__world_size": 4, "parallel__tp": 2, "training__ac": "full", "training__num_micro_batches": 2},
    ],
    ids=["single", "tp2-fsdp2-ac-full-2mb"],
)
def test_a_csv_alone_rebuilds_the_reports_peak_and_phase_peaks(tmp_path, over):
    """Peak, its task, op, phase and breakdown, and every phase peak come back exactly from the CSV; only what the
    CSV does not hold differs (the peak's micro batch; tasks per phase, as use-only tasks take the phase before)."""
    trace = dry_run(**over)
    write_reports(build_report(trace), blocks_csv(trace), tmp_path, trace.metadata["rank"])
    json_path = next(tmp_path.rglob("*.json"))
    orig = json.loads(json_path.read_text())
    rebuilt = build_report(load_any(json_path.with_suffix(".csv")))
    # the CSV holds neither the peak's micro batch nor the runtime figures of metadata.cuda (cuBLAS, NCCL, context)
    skip = {"peak_micro_batch", *SUMMARY_DEVICE_KEYS}
    assert {k: v for k, v in rebuilt["summary"].items() if k not in skip} == {
        k: v for k, v in orig["summary"].items() if k not in skip
    }
    assert _without_num_tasks(rebuilt["phases"]) == _without_num_tasks(orig["phases"])


def test_a_report_without_its_csv_compares_with_a_partial_live_set(report_dir, tmp_path, capsys):
    alone = tmp_path / "rank_0_memory.json"
    shutil.copy(report_dir / "rank_0_memory.json", alone)
    rc, out, _ = cli([str(alone), str(report_dir / "rank_0_memory.json"), "--json"], capsys)
    res = json.loads(out)
    shown = json.loads(alone.read_text())["peak_live_set"]
    assert rc == 0 and res["peak"]["diff"] == 0
    assert res["blocks"]["live_sets_complete"] is (shown["shown"] == shown["num_blocks"])
    assert res["blocks"]["only_in_a"]["count"] == 0
    assert res["blocks"]["only_in_b"]["bytes"] == shown["rest_bytes"]


def test_a_measured_side_is_judged_without_its_kernel_scratch_unless_asked(report_dir):
    # A copy of the dry-run report posing as a measured one whose full peak holds 5% of kernel workspace: the
    # scratch-free peak equals the dry run's, so the verdict passes; judged on the full peak it fails.
    rep = as_report(load_any(report_dir / "rank_0_memory.json"))
    peak = rep["summary"]["peak_bytes"]
    measured = json.loads(json.dumps(rep))
    measured["summary"]["peak_bytes"] = peak + peak // 20
    measured["metadata"]["kernel_scratch"] = {"peak_bytes_excluding": peak}
    res = compare(Side("m", "report", measured), Side("d", "report", rep))
    assert res["judged_on"] == "peak_without_kernel_scratch"
    assert res["peak_without_kernel_scratch"] == {"a": peak, "b": peak, "diff": 0, "rel_error": 0.0}
    assert res["peak"]["diff"] == -(peak // 20) and res["within_tolerance"] is True
    full = compare(Side("m", "report", measured), Side("d", "report", rep), with_kernel_scratch=True)
    assert full["judged_on"] == "peak" and full["within_tolerance"] is False
    plain = compare(Side("d", "report", rep), Side("d", "report", rep))
    assert plain["peak_without_kernel_scratch"] is None and plain["judged_on"] == "peak"
