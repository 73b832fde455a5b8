"""Hostile and broken inputs, one explicit case each (issue 13): every one is a single line on stderr naming the
file or field, exit code 2, nothing written, in bounded time and memory. The generated variety is in
tests/test_fuzz.py; these pin the cases found by hand.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import math
import os
import pickle
import resource
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from hyperdryrun.ingest.files import LIMITS
from hyperdryrun.report.schema import CSV_COLUMNS
from tests.conftest import cli
from tests.ingest.fixtures.make_fixtures import snapshot

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "ingest" / "fixtures"
LIMIT_VARS = tuple(limit.env for limit in LIMITS)


@pytest.fixture(autouse=True)
def _scratch(monkeypatch, tmp_path):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", *LIMIT_VARS):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)


def assert_bad_input(rc: int, err: str, *needles: str) -> None:
    assert rc == 2, err
    assert err.count("\n") == 1 and err.startswith("hyperdryrun: error: "), repr(err)
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, (needle, err)


def written(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


# ---------------------------------------------------------------------------------------------------------
# --config: the job file
# ---------------------------------------------------------------------------------------------------------


def run_config(text: bytes | str, capsys, tmp_path, *extra: str) -> tuple[int, str]:
    cfg = tmp_path / "job.yaml"
    cfg.write_bytes(text if isinstance(text, bytes) else text.encode())
    before = written(tmp_path)
    rc, _, err = cli(["run", "--config", str(cfg), "--output-dir", str(tmp_path / "out"), *extra], capsys)
    assert written(tmp_path) == before  # nothing written, not even a temporary file
    return rc, err


def test_non_utf8_yaml_is_one_line(capsys, tmp_path):
    rc, err = run_config(b"model: {name: \xff\xfe}\n", capsys, tmp_path)
    assert_bad_input(rc, err, "--config", "job.yaml", "not UTF-8")


def test_yaml_nested_20000_deep_is_one_line_naming_the_limit(capsys, tmp_path):
    rc, err = run_config("a: " + "[" * 20_000 + "]" * 20_000 + "\n", capsys, tmp_path)
    assert_bad_input(rc, err, "--config", "nested deeper than 64", "HYPERDRYRUN_MAX_NESTING")


def test_config_dev_zero_is_refused_by_size(capsys, tmp_path):
    rc, _, err = cli(["run", "--config", "/dev/zero", "--output-dir", str(tmp_path / "out")], capsys)
    assert_bad_input(rc, err, "--config", "/dev/zero", "1048576 B", "HYPERDRYRUN_MAX_CONFIG_BYTES")
    assert written(tmp_path) == []


def alias_bomb(levels: int = 9) -> str:
    """The billion laughs in YAML: 9 levels of 9 aliases each stand for 9**9 = 387,420,489 strings."""
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, levels):
        lines.append(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]")
    return "\n".join(lines) + f"\nmodel: {{name: *l{levels - 1}}}\n"


def test_yaml_alias_bomb_is_refused_by_node_count(capsys, tmp_path):
    text = alias_bomb()
    assert len(text) < 1024
    rc, err = run_config(text, capsys, tmp_path)
    assert_bad_input(rc, err, "--config", "100000 nodes", "aliases expanded", "HYPERDRYRUN_MAX_YAML_NODES")


def test_yaml_aliases_within_the_limit_are_fine(tmp_path):
    from hyperdryrun.config import load_yaml

    cfg = tmp_path / "job.yaml"
    cfg.write_text("shape: &s {name: llama-tiny, n_layers: 3}\nmodel: *s\n")
    assert load_yaml(cfg)["model"] == {"name": "llama-tiny", "n_layers": 3}


def test_a_yaml_limit_is_raised_by_its_variable(tmp_path, monkeypatch):
    from hyperdryrun.config import ConfigError, load_yaml

    cfg = tmp_path / "job.yaml"
    cfg.write_text("model: {name: llama-tiny}\n" + "#" * 100 + "\n")
    monkeypatch.setenv("HYPERDRYRUN_MAX_CONFIG_BYTES", "64")
    with pytest.raises(ConfigError, match=r"larger than the limit of 64 B \(HYPERDRYRUN_MAX_CONFIG_BYTES"):
        load_yaml(cfg)
    monkeypatch.setenv("HYPERDRYRUN_MAX_CONFIG_BYTES", "4096")
    assert load_yaml(cfg) == {"model": {"name": "llama-tiny"}}
    monkeypatch.setenv("HYPERDRYRUN_MAX_CONFIG_BYTES", "lots")
    with pytest.raises(ConfigError, match=r"HYPERDRYRUN_MAX_CONFIG_BYTES='lots' must be a positive integer"):
        load_yaml(cfg)


def test_duplicate_yaml_keys_are_an_error(capsys, tmp_path):
    rc, err = run_config(
        "training: {seq_len: 64}\nmodel: {name: llama-tiny}\ntraining: {seq_len: 32}\n", capsys, tmp_path
    )
    assert_bad_input(rc, err, "--config", "duplicate key 'training'", "line 3")
    rc, err = run_config("model: {name: llama-tiny, name: llama-debug}\n", capsys, tmp_path)
    assert_bad_input(rc, err, "duplicate key 'name'", "line 1")


@pytest.mark.parametrize(
    ("yaml_text", "needles"),
    [
        ("training: {seq_len: true}\n", ["training.seq_len", "valid integer", "(got True)"]),
        ("world: {world_size: 2.0}\n", ["world.world_size", "valid integer", "(got 2.0)"]),
        ('training: {seq_len: "64"}\n', ["training.seq_len", "valid integer", "(got '64')"]),
        ("parallel: {reshard_after_forward: 1}\n", ["parallel.reshard_after_forward", "valid boolean"]),
        ("device_memory_gib: true\n", ["device_memory_gib", "(got True)"]),
    ],
)
def test_yaml_values_are_strictly_typed(yaml_text, needles, capsys, tmp_path):
    rc, err = run_config("model: {name: llama-tiny}\n" + yaml_text, capsys, tmp_path)
    assert_bad_input(rc, err, *needles)


def test_yaml_numbers_of_the_right_kind_still_validate():
    from hyperdryrun.config import build_config

    cfg = build_config(
        {"model": {"name": "moe-tiny"}, "device_memory_gib": 80, "values": {"routing": "hotspot", "skew": 3}}
    )
    assert cfg.device_memory_gib == 80.0 and cfg.values.skew == 3.0


# ---------------------------------------------------------------------------------------------------------
# Ingested files: reports, CSVs, Chrome traces, snapshots (through ``compare``)
# ---------------------------------------------------------------------------------------------------------


def compare_with(path: Path, capsys) -> tuple[int, str]:
    rc, out, err = cli(["compare", str(path), str(FIXTURES / "tiny.snapshot.pickle")], capsys)
    assert rc != 2 or out == ""
    return rc, err


def fixture_report() -> dict:
    from hyperdryrun.compare import as_report
    from hyperdryrun.report.reader import load_any

    return json.loads(json.dumps(as_report(load_any(FIXTURES / "tiny.snapshot.pickle"))))


def test_the_fixture_report_itself_compares(tmp_path, capsys):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(fixture_report()))
    rc, err = compare_with(path, capsys)
    assert rc == 0, err


@pytest.mark.parametrize(
    ("mutate", "needles"),
    [
        (lambda r: r.update(metadata=5), ["metadata", "must be an object", "(got 5)"]),
        (lambda r: r["summary"].update(breakdown_at_peak=[1]), ["summary.breakdown_at_peak", "object"]),
        (lambda r: r["summary"].update(peak_task="3"), ["summary.peak_task", "integer", "(got '3')"]),
        (lambda r: r["summary"].update(peak_bytes=True), ["summary.peak_bytes", "integer", "(got True)"]),
        (lambda r: r.update(phases={"forward": 7}), ["phases.forward", "object", "(got 7)"]),
        (lambda r: r.update(modules=[{"fqn": 3}]), ["modules[0].fqn", "string", "(got 3)"]),
        (lambda r: r["peak_live_set"]["blocks"].append({"size": "big"}), ["peak_live_set.blocks[", "size"]),
        (lambda r: r["peak_live_set"].update(shown=None), ["peak_live_set.shown", "integer"]),
        (lambda r: r.update(limitations="none"), ["limitations", "list"]),
    ],
    ids=[
        "metadata-int",
        "breakdown-list",
        "peak-task-str",
        "peak-bool",
        "phase-int",
        "fqn-int",
        "block-size",
        "shown-null",
        "limitations-str",
    ],
)
def test_a_report_with_a_wrong_typed_field_is_one_line(mutate, needles, tmp_path, capsys):
    report = fixture_report()
    mutate(report)
    path = tmp_path / "r.json"
    path.write_text(json.dumps(report))
    rc, err = compare_with(path, capsys)
    assert_bad_input(rc, err, str(path), *needles)


def test_json_nested_100000_deep_is_one_line(tmp_path, capsys):
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    rc, err = compare_with(path, capsys)
    assert_bad_input(rc, err, str(path), "nested deeper than", "HYPERDRYRUN_MAX_NESTING")


def test_json_within_python_recursion_but_beyond_the_nesting_limit_is_refused(tmp_path, capsys):
    path = tmp_path / "deep.json"
    path.write_text('{"traceEvents": [' + "[" * 70 + "]" * 70 + "]}")
    rc, err = compare_with(path, capsys)
    assert_bad_input(rc, err, str(path), "nested deeper than 64 levels", "HYPERDRYRUN_MAX_NESTING")


def write_snapshot(path: Path, data: dict) -> Path:
    path.write_bytes(pickle.dumps(data))
    return path


@pytest.mark.parametrize(
    ("mutate", "needles"),
    [
        (
            lambda s: s["device_traces"][0][0].update(frames=7),
            ["device_traces[0][0].frames", "list", "(got 7)"],
        ),
        (lambda s: s["segments"][0]["blocks"][0].pop("size"), ["segments[0].blocks[0]", "lacks size"]),
        (lambda s: s["segments"][0].update(total_size="22"), ["segments[0].total_size", "integer", "'22'"]),
        (lambda s: s["device_traces"][0][0].update(frames=[{"line": "x"}]), ["frames[0].line", "integer"]),
        (lambda s: s["device_traces"][0][0].update(addr=[1]), ["device_traces[0][0].addr", "integer"]),
        (lambda s: s["segments"].append(3), ["segments[", "object", "(got 3)"]),
        (lambda s: s["segments"][0].update(blocks={"a": 1}), ["segments[0].blocks", "list"]),
        (lambda s: s["device_traces"][0][1].update(size=-512), ["device_traces[0][1].size", ">= 0", "-512"]),
    ],
    ids=[
        "frames-int",
        "block-no-size",
        "total-size-str",
        "frame-line-str",
        "addr-list",
        "segment-int",
        "blocks-dict",
        "negative-size",
    ],
)
def test_a_snapshot_with_a_wrong_typed_field_is_one_line(mutate, needles, tmp_path, capsys):
    data = snapshot()
    mutate(data)
    path = write_snapshot(tmp_path / "s.pickle", data)
    rc, err = compare_with(path, capsys)
    assert_bad_input(rc, err, str(path), *needles)


def frame_bomb(entries: int = 2000, frames: int = 20_000) -> dict:
    """A snapshot whose entries all share one long frame list: small as a pickle (the list is stored once), but
    entries x frames frame references for a reader that walks each entry's frames."""
    shared = [{"filename": "/home/u/model.py", "line": 1, "name": "forward"}] * frames
    trace = [
        {"action": "alloc", "addr": 512 * i, "size": 512, "stream": 0, "frames": shared}
        for i in range(entries)
    ]
    return {"segments": [], "device_traces": [trace]}


def test_a_snapshot_of_shared_frame_references_is_refused_by_count(tmp_path, capsys):
    path = write_snapshot(tmp_path / "bomb.pickle", frame_bomb())
    assert path.stat().st_size < 200_000
    rc, err = compare_with(path, capsys)
    assert_bad_input(rc, err, str(path), "40000000 frame references", "HYPERDRYRUN_MAX_FRAME_REFERENCES")


def test_snapshot_entries_are_limited(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HYPERDRYRUN_MAX_SNAPSHOT_ENTRIES", "5")
    rc, err = compare_with(FIXTURES / "tiny.snapshot.pickle", capsys)
    assert_bad_input(
        rc, err, "tiny.snapshot.pickle", "entries", "limit of 5", "HYPERDRYRUN_MAX_SNAPSHOT_ENTRIES"
    )


def csv_text(rows: list[dict]) -> str:
    """A memory-block CSV with the given fields set on an otherwise ordinary row."""
    base = dict.fromkeys(CSV_COLUMNS, "")
    base.update(
        start_time_stamp="0", end_time_stamp="2", start_plot_time_stamp="0", end_plot_time_stamp="2",
        device_addr="0", stream_id="0", pool_type="0", size="512", actual_used_memory="512",
        actual_peak_memory="512", type="Activation", producer_task="0", task_name="forward", node_name="mm",
        user_tasks="{}", is_persistent="0", is_small="1",
    )  # fmt: skip
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(CSV_COLUMNS)
    for r in rows:
        w.writerow([{**base, **r}[c] for c in CSV_COLUMNS])
    return buf.getvalue()


def test_an_ordinary_hand_made_csv_compares(tmp_path, capsys):
    path = tmp_path / "b.csv"
    path.write_text(csv_text([{}, {"start_time_stamp": "1", "end_time_stamp": "3", "size": "1024"}]))
    rc, out, err = cli(["compare", str(path), str(path)], capsys)
    assert rc == 0, err
    assert "1,536 B" in out  # both blocks live at task 1: 512 + 1024


@pytest.mark.parametrize(
    ("row", "needles"),
    [
        ({"size": "-512"}, ["line 2", "size", ">= 0", "-512"]),
        ({"start_time_stamp": "5", "end_time_stamp": "3"}, ["line 2", "ends at task 3", "starts", "5"]),
        ({"start_time_stamp": "-1"}, ["line 2", "start_time_stamp", ">= 0", "-1"]),
        ({"user_tasks": "{1--2}"}, ["line 2"]),
    ],
)
def test_a_csv_row_that_cannot_be_a_block_is_one_line(row, needles, tmp_path, capsys):
    path = tmp_path / "b.csv"
    path.write_text(csv_text([row]))
    rc, err = compare_with(path, capsys)
    assert_bad_input(rc, err, str(path), *needles)


def test_a_csv_row_at_task_1e8_is_refused_by_the_row_count(tmp_path, capsys):
    path = tmp_path / "b.csv"
    path.write_text(csv_text([{"start_time_stamp": "100000000", "end_time_stamp": "100000001"}]))
    assert path.stat().st_size < 600
    rc, err = compare_with(path, capsys)
    assert_bad_input(
        rc, err, str(path), "100000001 tasks", "1 rows", "1024 per row", "HYPERDRYRUN_MAX_TASKS_PER_ROW"
    )


def test_chrome_trace_with_wrong_typed_memory_fields_is_one_line(tmp_path, capsys):
    event = {"ph": "i", "name": "[memory]", "ts": 1, "pid": 1, "tid": 1, "args": {"Addr": "x", "Bytes": 512}}
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": [event]}))
    rc, err = compare_with(path, capsys)
    assert_bad_input(rc, err, str(path), "[memory] event #0", "Addr", "integer", "'x'")
    event["args"]["Addr"], event["ts"] = 7, {"a": 1}
    path.write_text(json.dumps({"traceEvents": [event]}))
    rc, err = compare_with(path, capsys)
    assert_bad_input(rc, err, str(path), "event #0", "ts", "number")


def test_gzip_decompressed_size_is_limited(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HYPERDRYRUN_MAX_DECOMPRESSED_BYTES", str(1 << 20))
    path = tmp_path / "t.json.gz"
    path.write_bytes(gzip.compress(b'{"traceEvents": [' + b" " * (4 << 20) + b"]}"))
    rc, err = compare_with(path, capsys)
    assert_bad_input(
        rc, err, str(path), "decompresses to more than 1048576 B", "HYPERDRYRUN_MAX_DECOMPRESSED_BYTES"
    )


def test_input_size_is_limited(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HYPERDRYRUN_MAX_INPUT_BYTES", "1000")
    rc, err = compare_with(FIXTURES / "tiny.snapshot.pickle", capsys)
    assert_bad_input(
        rc, err, "tiny.snapshot.pickle", "larger than the limit of 1000 B", "HYPERDRYRUN_MAX_INPUT_BYTES"
    )


# ---------------------------------------------------------------------------------------------------------
# The bombs at their real sizes, in a real process with an address-space cap and a timeout
# ---------------------------------------------------------------------------------------------------------

ADDRESS_SPACE = 3 << 30  # the interpreter with torch imported maps about 0.7 GB


def _capped() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


def run_capped(argv: list[str], tmp_path: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in LIMIT_VARS and k not in ("RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
    return subprocess.run(
        [sys.executable, "-m", "hyperdryrun.cli", *argv],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=_capped,
    )


def gzip_bomb(path: Path, expanded: int) -> None:
    """``expanded`` bytes of JSON whitespace inside a trace object, gzipped: one 64 MiB member of spaces (1000:1)
    repeated, as gzip's multi-member format allows (``cat a.gz b.gz`` is a valid gzip file)."""

    def member(data: bytes) -> bytes:
        comp = zlib.compressobj(9, zlib.DEFLATED, 31)
        return comp.compress(data) + comp.flush()

    spaces = member(b" " * (64 << 20))
    with open(path, "wb") as f:
        f.write(member(b'{"traceEvents": ['))
        for _ in range(expanded // (64 << 20)):
            f.write(spaces)
        f.write(member(b"]}"))


@pytest.mark.parametrize("kind", ["gzip", "frames", "csv", "yaml"])
def test_bombs_in_a_capped_process_are_refused_quickly(kind, tmp_path):
    if kind == "gzip":
        path = tmp_path / "bomb.json.gz"
        gzip_bomb(path, 3 << 30)
        assert path.stat().st_size < 16 << 20
        argv = ["compare", str(path), str(path)]
        needle = "HYPERDRYRUN_MAX_DECOMPRESSED_BYTES"
    elif kind == "frames":
        path = write_snapshot(tmp_path / "bomb.pickle", frame_bomb(4000, 50_000))
        argv = ["compare", str(path), str(path)]
        needle = "HYPERDRYRUN_MAX_FRAME_REFERENCES"
    elif kind == "csv":
        path = tmp_path / "bomb.csv"
        path.write_text(csv_text([{"start_time_stamp": "100000000", "end_time_stamp": "100000001"}]))
        argv = ["compare", str(path), str(path)]
        needle = "HYPERDRYRUN_MAX_TASKS_PER_ROW"
    else:
        path = tmp_path / "bomb.yaml"
        path.write_text(alias_bomb())
        argv = ["run", "--config", str(path), "--output-dir", str(tmp_path / "out")]
        needle = "HYPERDRYRUN_MAX_YAML_NODES"
    proc = run_capped(argv, tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1 and needle in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "out").exists()


def test_a_multi_member_gzip_file_reads_whole(tmp_path):
    from hyperdryrun.ingest.files import read_json

    path = tmp_path / "t.json.gz"
    path.write_bytes(gzip.compress(b'{"a": ') + gzip.compress(b"[1, 2]}") + b"\0" * 8)
    assert read_json(path, path.read_bytes()) == {"a": [1, 2]}
    path.write_bytes(gzip.compress(b'{"a": 1}') + b"junk")
    with pytest.raises(Exception, match="trailing bytes"):
        read_json(path, path.read_bytes())


def test_a_yaml_file_with_a_nul_byte_is_one_line(capsys, tmp_path):
    # found by tests/test_fuzz.py: PyYAML's reader refuses the character while the loader is being made
    rc, err = run_config(b"\x00", capsys, tmp_path)
    assert_bad_input(rc, err, "--config", "is not valid YAML", "#x0000")


# ---------------------------------------------------------------------------------------------------------
# issue 23: the twelve defects of the hostile-input probe, each repro command as a test (in-process where the
# check happens before any simulation; the closed pipe and the TP warning need a real process or step)
# ---------------------------------------------------------------------------------------------------------

T = ["--model", "llama-tiny", "--seq-len", "64"]
FIT = [*T, "--gpu", "h100-80gb", "--global-batch-seqs", "8", "--no-cache"]


class Simulated(BaseException):
    """Raised instead of simulating or searching (a BaseException: no handler of the CLI eats it)."""


@pytest.fixture
def no_simulation(monkeypatch):
    """``run``/``fit`` reach their simulation or search: stop there (every check of this section comes before)."""
    import hyperdryrun.runner as runner
    import hyperdryrun.search.fit as search

    def stop(*args, **kwargs):
        raise Simulated

    for module, name in ((runner, "run_rank"), (runner, "run_ranks"), (search, "fit")):
        monkeypatch.setattr(module, name, stop)


def good_report(out: Path, ranks=(0,)) -> dict[str, bytes]:
    """Files standing for a good earlier report under ``out``: what must stay byte for byte."""
    files = {}
    for r in ranks:
        for name in ("memory.json", "memory.csv", "segments.csv"):
            p = out / f"rank_{r}" / f"rank_{r}_{name}"
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(f"good {r} {name}\n".encode())
            files[str(p)] = p.read_bytes()
    return files


def unchanged(files: dict[str, bytes]) -> bool:
    return all(Path(p).read_bytes() == data for p, data in files.items()) and not any(
        p.name.endswith(".tmp") for f in files for p in Path(f).parent.iterdir()
    )


@pytest.mark.parametrize(
    "ranks", [[], ["--ranks", "0,1", "--jobs", "2", "--world-size", "2"]], ids=["one", "ranks"]
)
def test_1_a_bad_alloc_conf_variable_is_refused_up_front_and_keeps_the_report(
    ranks, tmp_path, capsys, monkeypatch, no_simulation
):
    out = tmp_path / "out"
    kept = good_report(out, (0, 1))
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "@@@")
    rc, stdout, err = cli(["run", *T, *ranks, "--output-dir", str(out)], capsys)
    assert_bad_input(rc, err, "$PYTORCH_CUDA_ALLOC_CONF", "'@@@'")
    assert stdout == "" and unchanged(kept)
    # --alloc-conf gives the settings: the variable is not read, as in the step
    with pytest.raises(Simulated):
        cli(["run", *T, "--alloc-conf", "expandable_segments:True", "--output-dir", str(out)], capsys)


def test_2_a_bad_alloc_conf_variable_stops_fit_before_the_search(
    tmp_path, capsys, monkeypatch, no_simulation
):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "@@@")
    rc, stdout, err = cli(["fit", *FIT, "--world-size", "2"], capsys)
    assert_bad_input(rc, err, "$PYTORCH_CUDA_ALLOC_CONF", "'@@@'")
    assert stdout == ""


def test_2_a_candidate_failing_on_bad_input_stops_the_search():
    """Bad input inside a candidate's step (every candidate passed the job's checks) is not the layout's: the search
    stops with it instead of counting it as a failed layout and answering "no layout fits"."""
    from hyperdryrun.cli import build_parser
    from hyperdryrun.commands.fit import fit_job_from_args
    from hyperdryrun.config import ConfigError
    from hyperdryrun.search.cache import ResultCache
    from hyperdryrun.search.executors import TaskResult
    from hyperdryrun.search.fit import fit

    class Refusing:
        def imap(self, tasks):
            for task in tasks:
                yield TaskResult(task.key, error="ValueRuleError: no rule", error_kind="bad input")

    args = build_parser().parse_args(["fit", *FIT, "--world-size", "2"])
    with pytest.raises(ConfigError, match=r"rank \d+: ValueRuleError: no rule"):
        fit(fit_job_from_args(args), Refusing(), ResultCache(None))


def test_4_report_checks_every_output_before_writing_any(tmp_path, capsys):
    run_dir = FIXTURES / "tiny_step.trace.json.gz"
    keep = tmp_path / "keep.html"
    keep.write_text("keep\n")
    (tmp_path / "FILE").write_text("a file\n")
    rc, _, err = cli(["report", str(run_dir), "--html", str(keep), "--plot", str(tmp_path / "FILE")], capsys)
    assert_bad_input(rc, err, "--plot", "FILE", "not a directory")
    assert keep.read_text() == "keep\n" and written(tmp_path) == ["FILE", "keep.html"]


def test_9_report_html_naming_a_directory_is_one_line_without_a_temporary_name(tmp_path, capsys):
    rc, _, err = cli(["report", str(FIXTURES / "tiny_step.trace.json.gz"), "--html", str(tmp_path)], capsys)
    assert_bad_input(rc, err, "--html", "is a directory")
    assert ".tmp" not in err


@pytest.mark.parametrize("flag", ["--json", "--csv"])
def test_9_fit_outputs_are_checked_before_the_search(flag, tmp_path, capsys, no_simulation):
    rc, _, err = cli(["fit", *FIT, "--world-size", "2", flag, str(tmp_path)], capsys)
    assert_bad_input(rc, err, flag, "is a directory")


def huge_int_cases(tmp_path: Path) -> dict[str, Path]:
    memory = {
        "ph": "i",
        "name": "[memory]",
        "ts": 1,
        "pid": 1,
        "tid": 1,
        "args": {"Addr": 1, "Bytes": "BYTES"},
    }
    trace = json.dumps({"traceEvents": [memory]})
    paths = {
        "bytes 10**400": trace.replace('"BYTES"', str(10**400)),
        "100,000 digits": trace.replace('"BYTES"', "9" * 100_000),
    }
    out = {}
    for name, text in paths.items():
        out[name] = tmp_path / f"{len(out)}.json"
        out[name].write_text(text)
    rows = [dict.fromkeys(CSV_COLUMNS, "0")]
    rows[0].update(end_time_stamp="1", size=str(10**400), type="Activation", task_name="forward",
                   user_tasks="{}", is_persistent="False", is_small="True", python_stack="")  # fmt: skip
    out["csv size 10**400"] = tmp_path / "big.csv"
    out["csv size 10**400"].write_text(csv_text(rows))
    return out


@pytest.mark.parametrize("command", ["compare", "snapshot"])
def test_5_6_integers_no_step_has_are_refused_on_one_line(command, tmp_path, capsys):
    for name, path in huge_int_cases(tmp_path).items():
        argv = ["compare", str(path), str(path)] if command == "compare" else ["snapshot", str(path)]
        rc, _, err = cli(argv, capsys)
        assert_bad_input(rc, err, str(path), "out of range")
        assert len(err) < 400, (name, err)  # the number is not echoed whole


def shared_pickle(path: Path, segments: bool) -> Path:
    """220 KB that unpickles into 10,000 references to one 100,000-entry list (issue 23, item 7)."""
    if segments:
        blocks = [{"address": 1, "size": 512, "state": "active_allocated"}] * 100_000
        data = {"segments": [{"device": 0, "address": 1, "total_size": 512, "blocks": blocks}] * 10_000,
                "device_traces": [[]]}  # fmt: skip
    else:
        entries = [{"action": "alloc", "addr": 1, "size": 512, "frames": []}] * 100_000
        data = {"segments": [], "device_traces": [entries] * 10_000}
    path.write_bytes(pickle.dumps(data))
    return path


@pytest.mark.parametrize("segments", [False, True], ids=["traces", "segments"])
def test_7_shared_references_are_counted_before_anything_is_walked(segments, tmp_path, capsys):
    import time

    path = shared_pickle(tmp_path / "shared.pickle", segments)
    assert path.stat().st_size < 300_000
    t0 = time.perf_counter()
    rc, _, err = cli(["compare", str(path), str(path)], capsys)
    assert_bad_input(rc, err, "more than the limit of 5000000")
    assert time.perf_counter() - t0 < 5  # was 33-43 s and a MemoryError


def hf_config(tmp_path: Path, **changes) -> str:
    from hyperdryrun.models.hf import CONFIG_DIR

    data = json.loads((CONFIG_DIR / "llama-3.1-8b.json").read_text())
    data.update(changes)
    d = tmp_path / "hf"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({k: v for k, v in data.items() if v is not None}))
    return f"hf:{d}"


@pytest.mark.parametrize(
    ("changes", "needles"),
    [
        ({"model_type": "potato"}, ["field model_type", "'potato'"]),
        ({"hidden_size": -64}, ["field hidden_size", "-64"]),
        ({"hidden_size": None}, ["field hidden_size: missing"]),
        ({"num_attention_heads": 7}, ["field num_attention_heads", "must divide hidden_size=4096"]),
    ],
    ids=["model-type", "negative", "missing", "heads"],
)
@pytest.mark.parametrize("command", ["run", "fit"])
def test_10_a_bad_hf_config_names_the_file_and_field(
    command, changes, needles, tmp_path, capsys, no_simulation
):
    pytest.importorskip("transformers")
    model = hf_config(tmp_path, **changes)
    argv = (
        ["run", "--model", model, "--seq-len", "64"]
        if command == "run"
        else ["fit", "--model", model, *FIT[2:], "--world-size", "2"]
    )
    rc, _, err = cli(argv, capsys)
    assert_bad_input(rc, err, "config.json", *needles)


@pytest.mark.parametrize(
    ("env", "config"), [({"WORLD_SIZE": "2"}, None), ({}, "world: {world_size: 2}\n")], ids=["env", "config"]
)
def test_11_fit_takes_the_world_size_from_the_variable_or_the_config(
    env, config, tmp_path, capsys, monkeypatch, no_simulation
):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    argv = ["fit", *FIT]
    if config:
        (tmp_path / "job.yaml").write_text(config)
        argv += ["--config", str(tmp_path / "job.yaml")]
    with pytest.raises(Simulated):
        cli(argv, capsys)


def test_11_fit_names_a_bad_world_size_variable_and_a_contradiction(capsys, monkeypatch, no_simulation):
    monkeypatch.setenv("WORLD_SIZE", "abc")
    assert_bad_input(*cli(["fit", *FIT], capsys)[::2], "WORLD_SIZE='abc'")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert_bad_input(*cli(["fit", *FIT, "--world-size", "2"], capsys)[::2], "--world-size 2", "WORLD_SIZE=4")


@pytest.mark.parametrize(
    ("argv", "needles", "absent"),
    [
        (
            ["fit", *FIT, "--world-size", "2", "--peak-tflops", "-1"],
            ["--peak-tflops", "(got -1.0)"],
            "--peak-flops",
        ),
        (["fit", *FIT, "--world-size", "2", "--gpu", "potato"], ["'potato'", "h100-80gb"], "mi300x"),
        (
            ["run", *T, "--alloc-conf", "max_split_size_mb:99999999999999999999999"],
            ["max_split_size_mb", "out of range"],
            "Traceback",
        ),
    ],
    ids=["peak-tflops", "gpu", "huge-alloc-conf"],
)
def test_messages_name_the_right_flag_and_value(argv, needles, absent, capsys, no_simulation):
    rc, _, err = cli(argv, capsys)
    assert_bad_input(rc, err, *needles)
    assert absent not in err


def test_an_empty_config_file_is_refused_not_run_as_the_default_job(tmp_path, capsys, no_simulation):
    for text in ("", "# nothing\n"):
        rc, err = run_config(text, capsys, tmp_path)
        assert_bad_input(rc, err, "is empty", "gives no job")


def test_output_directory_errors_come_before_the_simulation(tmp_path, capsys, no_simulation):
    (tmp_path / "a-file").write_text("x\n")
    (tmp_path / "out" / "rank_0" / "rank_0_memory.json").mkdir(parents=True)
    for out, needle in (
        (tmp_path / "a-file" / "out", "is not a directory"),
        (tmp_path / "out", "is a directory"),
    ):
        rc, _, err = cli(["run", *T, "--output-dir", str(out)], capsys)
        assert_bad_input(rc, err, "--output-dir", needle)


def test_fit_cache_dir_that_is_a_file_is_refused(tmp_path, capsys, no_simulation):
    (tmp_path / "FILE").write_text("x\n")
    rc, _, err = cli(["fit", *FIT[:-1], "--world-size", "2", "--cache-dir", str(tmp_path / "FILE")], capsys)
    assert_bad_input(rc, err, "--cache-dir", "not a directory")


def test_12_torch_warnings_of_the_step_go_to_the_limitations_once_with_their_count(tmp_path, capsys):
    out = tmp_path / "out"
    rc, _, err = cli(
        ["run", *T, "--world-size", "2", "--tp", "2", "--quiet", "--output-dir", str(out)], capsys
    )
    assert rc == 0 and err == "", err  # nothing from torch on the terminal
    limitations = json.loads((out / "rank_0" / "rank_0_memory.json").read_text())["limitations"]
    warned = [line for line in limitations if line.startswith("warned during the simulated step")]
    # FSDP2's check in _register_pre_backward_hook (torch 2.13 _fsdp_state.py): the embedding returns a view, once
    # per forward of the FSDP-wrapped embedding (one micro batch)
    assert warned == [w for w in warned if "FSDP2-wrapped module (FSDPEmbedding) returned a view tensor" in w]
    assert len(warned) == 1 and warned[0].startswith(
        "warned during the simulated step (1 time): UserWarning:"
    )


# ---------------------------------------------------------------------------------------------------------
# issue 30: the second round (numbers are the items)
# ---------------------------------------------------------------------------------------------------------

HYPERDRYRUN = [sys.executable, "-m", "hyperdryrun"]


def hdr(args: list[str], tmp_path: Path, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    """``hyperdryrun ARGS`` as a new user runs it: a process of its own, in ``tmp_path``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", *LIMIT_VARS):
        env.pop(var, None)
    env.update(kwargs.pop("env", {}))
    return subprocess.run(
        [*kwargs.pop("wrap", []), *HYPERDRYRUN, *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        **kwargs,
    )


@pytest.fixture(scope="module")
def a_run(tmp_path_factory) -> Path:
    """One real ``run --model llama-tiny`` output directory (made once for this module)."""
    out = tmp_path_factory.mktemp("a_run") / "out"
    proc = hdr(["run", *T, "--quiet", "--output-dir", str(out)], out.parent)
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.fixture
def good_run(a_run, tmp_path) -> tuple[Path, dict[str, bytes]]:
    """A copy of :func:`a_run` under ``tmp_path/out``, and its files' bytes (what must stay)."""
    import shutil

    out = tmp_path / "out"
    shutil.copytree(a_run, out)
    return out, {str(p): p.read_bytes() for p in out.rglob("*") if p.is_file()}


G = "out/rank_0/rank_0_memory.json"


@pytest.mark.parametrize(
    "argv",
    [
        ["snapshot", G, "-o", G],
        ["snapshot", G, "-o", "out/rank_0/rank_0_memory.csv"],
        ["snapshot", G, "-o", "out/rank_0/../rank_0/rank_0_memory.csv"],
        ["snapshot", "out/rank_0/rank_0_memory.csv", "-o", G],
        ["snapshot", G, "-o", "link.json"],
        ["snapshot", G, "-o", "hard.json"],
        ["report", G, "--html", G],
        ["report", "out", "--html", "out/rank_0/rank_0_memory.csv"],
        ["report", "other.json", "--compare", "out", "--html", "link.json"],
        ["report", "out", "--html", "hard.json"],
    ],
    ids=["snap-self", "snap-csv", "snap-dotdot", "snap-from-csv", "snap-symlink", "snap-hardlink", "report-self",
         "report-dir-csv", "report-compare-link", "report-hardlink"],
)  # fmt: skip
def test_30_1_an_output_never_replaces_its_own_input(argv, good_run, tmp_path, capsys):
    out, files = good_run
    (tmp_path / "link.json").symlink_to(out / "rank_0" / "rank_0_memory.json")
    os.link(out / "rank_0" / "rank_0_memory.json", tmp_path / "hard.json")
    rc, _, err = cli(argv, capsys)
    assert_bad_input(rc, err, "is an input of this command", "name another file")
    assert unchanged(files)


def test_30_1_fit_outputs_are_not_its_config(tmp_path, capsys, no_simulation):
    (tmp_path / "job.yaml").write_text("model: {name: llama-tiny}\n")
    before = (tmp_path / "job.yaml").read_bytes()
    for flag in ("--json", "--csv"):
        rc, _, err = cli(
            ["fit", *FIT[2:], "--world-size", "2", "--config", "job.yaml", flag, "./job.yaml"], capsys
        )
        assert_bad_input(rc, err, flag, "job.yaml", "is an input")
    assert (tmp_path / "job.yaml").read_bytes() == before


@pytest.mark.parametrize(
    ("argv", "where", "needle"),
    [
        (["run", "--config", "out/rank_0/rank_0_memory.csv", "--output-dir", "out"], "csv", "--config"),
        (["run", "--config", "./out/rank_0/rank_0_memory.csv", "--output-dir", "out", "--ranks", "0"], "csv",
         "--config"),
        (["measure", "--config", "out/rank_0/rank_0_memory.csv", "--output-dir", "out"], "csv", "--config"),
        (["run", "--model", "hf:out/rank_0", "--output-dir", "out"], "config", "--model"),
        (["run", "--model", "hf:out/rank_0/rank_0_memory.json", "--output-dir", "out"], "json", "--model"),
        (["run", "--config", "hf.yaml", "--output-dir", "out"], "config", "--model"),
        (["script", "out/rank_0/rank_0_memory.json:hyperdryrun_job", "--output-dir", "out"], "json", "SCRIPT"),
        (["script", "out/rank_0/rank_0_error.json", "--output-dir", "out", "--ranks", "0"], "error", "SCRIPT"),
    ],
    ids=["run-config", "run-ranks-config", "measure-config", "run-hf-dir", "run-hf-file", "run-hf-in-yaml",
         "script", "script-ranks-error-report"],
)  # fmt: skip
def test_30_1_a_runs_outputs_are_not_its_inputs(argv, where, needle, tmp_path, capsys):
    """run, measure and script read a job file (--config, an HF config.json, the script) that a rank's output may
    name: refused up front, naming the flag, and the input stays."""
    rank = tmp_path / "out" / "rank_0"
    rank.mkdir(parents=True)
    hf = (ROOT / "src/hyperdryrun/models/hf_configs/qwen2.5-7b.json").read_text()
    text = {
        "csv": "model: {name: llama-tiny}\n",
        "json": hf if argv[0] == "run" else SCRIPT,
        "config": hf,
        "error": SCRIPT,
    }[where]
    path = rank / {"csv": "rank_0_memory.csv", "json": "rank_0_memory.json", "config": "config.json",
                   "error": "rank_0_error.json"}[where]  # fmt: skip
    path.write_text(text)
    if where == "config":  # an HF config directory whose config.json is the rank's JSON by another name
        os.link(path, rank / "rank_0_memory.json")
    (tmp_path / "hf.yaml").write_text("model: {name: 'hf:out/rank_0'}\n")
    rc, _, err = cli(argv, capsys)
    assert_bad_input(rc, err, "--output-dir 'out'", needle, "an input of this command")
    assert path.read_text() == text


def test_30_1_an_output_beside_the_input_is_still_fine(good_run, tmp_path, capsys):
    rc, out, err = cli(["snapshot", G, "-o", "out/rank_0/snap.pickle"], capsys)
    assert rc == 0, err
    assert pickle.loads((tmp_path / "out/rank_0/snap.pickle").read_bytes())["segments"]


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["run", *T, "--output-dir", "a" * 300], "--output-dir"),
        (["fit", *FIT[2:], "--world-size", "2", "--json", "j" * 256 + ".json"], "--json"),
        (["fit", *FIT[2:], "--world-size", "2", "--csv", "x/" * 2100 + "c.csv"], "--csv"),
        (["snapshot", G, "-o", "s" * 300], "--output"),
        (["fit", *FIT[2:], "--world-size", "2", "--json", "-"], "--json"),
    ],
    ids=["output-dir", "fit-json", "fit-csv-path", "snapshot", "fit-json-dash"],
)
def test_30_3_an_output_name_the_file_system_cannot_take_is_bad_input(
    argv, flag, good_run, capsys, no_simulation
):
    rc, _, err = cli(argv, capsys)
    assert_bad_input(rc, err, flag)
    assert len(err) < 400
    assert not Path("-").exists()


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["run", *T, "--output-dir", "D/out"], "--output-dir"),
        (["fit", *FIT[2:-1], "--world-size", "1", "--json", "D/x.json"], "--json"),
        (["fit", *FIT[2:-1], "--world-size", "1", "--cache-dir", "D/c"], "--cache-dir"),
    ],
    ids=["output-dir", "fit-json", "fit-cache-dir"],
)
def test_30_3_a_directory_without_permission_is_bad_input_naming_the_flag(args, flag, tmp_path):
    """As a user that is not root (root may write anywhere): a process of its own, run as nobody (util-linux's
    setpriv) when the tests run as root."""
    import shutil

    if os.geteuid() == 0:
        if not shutil.which("setpriv"):
            pytest.skip("runs as root without setpriv to drop to another user")
        kwargs = {"wrap": ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]}
        tmp_path.chmod(0o777)
        for p in tmp_path.parents:
            if p == Path(tmp_path.anchor):
                break
            p.chmod(p.stat().st_mode | 0o005)  # nobody may reach tmp_path
    else:
        kwargs = {}
    (tmp_path / "D").mkdir()
    (tmp_path / "D").chmod(0)
    proc = hdr(args, tmp_path, **kwargs)
    assert_bad_input(proc.returncode, proc.stderr, flag, "Permission denied")


# item 8: closed and full standard streams (a process of its own: the shell closes them)


@pytest.mark.parametrize(
    ("args", "redirect", "code"),
    [
        (["--version"], ">&-", 0),
        (["run", "--help"], ">&-", 0),
        (["compare", G, G], ">&-", 0),
        (["run", *T, "--quiet", "--output-dir", "out2"], ">&-", 0),
        (["run", *T, "--output-dir", "out2"], "2>&- >&- <&-", 0),
        (["run", "--model", "potato"], "2>/dev/full", 2),
        (["--version"], ">/dev/full", 2),
        (["run", *T, "--output-dir", "out2"], ">/dev/full", 2),
    ],
    ids=[
        "version",
        "help",
        "compare",
        "run",
        "all-closed",
        "bad-input-stderr-full",
        "version-full",
        "run-full",
    ],
)
def test_30_8_closed_or_full_standard_streams(args, redirect, code, good_run, tmp_path):
    import shlex

    line = " ".join(map(shlex.quote, [*HYPERDRYRUN, *args])) + " " + redirect
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run(
        ["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == code, proc.stderr
    assert "Traceback" not in proc.stderr
    if "2>" not in redirect and code == 2:
        assert_bad_input(proc.returncode, proc.stderr, "stdout", "No space left on device")
    if "out2" in args:
        assert (tmp_path / "out2" / "rank_0" / "rank_0_memory.json").is_file()
    assert not any(p.name.isdigit() for p in tmp_path.iterdir())  # no stray file took a closed descriptor


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (
            ["--ac", "none", "--ac-selective", "op"],
            "training.ac_selective='op' has no effect with training.ac='none'",
        ),
        (
            ["--ac", "full", "--ac-selective", "op"],
            "training.ac_selective='op' has no effect with training.ac='full'",
        ),
        (["--model", "moe-tiny", "--hot-expert", "0"], "values.hot_expert=0 has no effect"),
        # --skew alone chooses hotspot routing; with another routing given it is ignored, so refused
        (["--model", "moe-tiny", "--routing", "balanced", "--skew", "2.0"], "values.skew=2.0 has no effect"),
        (["--model", "moe-tiny", "--routing", "hotspot", "--routing-counts", "1,2"], "values.counts=[1, 2]"),
        (["--routing", "balanced"], "values.routing='balanced' has no effect: 'llama-tiny' is a dense model"),
    ],
    ids=["ac-none", "ac-full", "hot-expert-0", "skew-2", "counts", "routing-dense"],
)
def test_30_9_a_field_given_but_ignored_is_refused_even_at_its_default(argv, needle, capsys, no_simulation):
    rc, _, err = cli(["run", *T, *argv], capsys)
    assert_bad_input(rc, err, needle)


def test_30_9_the_yaml_form_too_and_a_dump_still_rebuilds(tmp_path, capsys, no_simulation):
    from hyperdryrun.config import build_config

    rc, err = run_config(
        "model: {name: llama-tiny}\ntraining: {ac: full, ac_selective: op}\n", capsys, tmp_path
    )
    assert_bad_input(rc, err, "training.ac_selective='op' has no effect")
    for data in (
        {"model": {"name": "llama-tiny"}},
        {"model": {"name": "moe-tiny"}},
        {"model": {"name": "moe-tiny"}, "values": {"routing": "hotspot", "hot_expert": 0, "skew": 2.0}},
        {"model": {"name": "llama-tiny"}, "training": {"ac": "selective", "ac_selective": "op"}},
    ):
        cfg = build_config(data)
        assert build_config(cfg.model_dump()) == cfg  # the runner's workers rebuild a config from its dump
        assert build_config(json.loads(cfg.model_dump_json())) == cfg


BIG = "1" + "0" * 400


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["run", *T, "--world-size", BIG], ["--world-size", "16777216", "about 401 digits"]),
        (["run", *T, "--device-memory-gib", "1e300"], ["--device-memory-gib", "1048576", "1e+300"]),
        (["run", *T, "--gpu", "h100-80gb", "--margin-gib", "1e308"], ["--margin-gib", "1e+308"]),
        (["run", *T, "--gpu", "h100-80gb", "--margin-gib", "80"], ["--margin-gib 80", "less than the capacity"]),
        (["run", *T, "--margin-gib", "1"], ["margin_gib=1 has no effect without a capacity"]),
        (["run", *T, "--target-device", "cpu", "--gpu", "h100-80gb"], ["cuda.gpu='h100-80gb' has no effect"]),
        (["run", *T, "--target-device", "cpu", "--alloc-conf", "expandable_segments:True"], ["cuda.alloc_conf"]),
        (["fit", *FIT[2:], "--world-size", "1", "--margin-gib", "1e308"], ["--margin-gib", "1,048,576"]),
        (["fit", *FIT[2:], "--world-size", "1", "--device-memory-gib", "1e300"], ["--device-memory-gib", "1e+300"]),
        (["fit", *FIT[2:-3], "--world-size", "1", "--global-batch-tokens", str(2**64)], ["--global-batch-tokens"]),
        (["fit", *FIT[2:], "--world-size", "1", "--micro-batch-size", "1" + "0" * 23], ["--micro-batch-size"]),
        (["fit", *FIT[2:], "--world-size", "1", "--tp", "1" + "0" * 23], ["--tp", "16,777,216"]),
        (["fit", *FIT[2:], "--world-size", "100000"], ["--world-size 100000", "65536", "HYPERDRYRUN_MAX_WORLD_SIZE"]),
    ],
    ids=["world-size", "device-gib", "margin-gib", "margin-over-capacity", "margin-no-capacity", "gpu-on-cpu",
         "alloc-conf-on-cpu", "fit-margin", "fit-device-gib", "fit-tokens", "fit-mbs", "fit-tp", "fit-world"],
)  # fmt: skip
def test_30_4_huge_numbers_are_bad_input_naming_the_flag(argv, needles, capsys, no_simulation):
    rc, _, err = cli(argv, capsys)
    assert_bad_input(rc, err, *needles)
    assert len(err) < 300  # a 401-digit number is not echoed whole


def test_30_4_a_yaml_number_past_pythons_digit_limit(capsys, tmp_path, no_simulation):
    rc, err = run_config(
        "model: {name: llama-tiny}\ntraining: {seq_len: " + "9" * 5000 + "}\n", capsys, tmp_path
    )
    assert_bad_input(rc, err, "--config", "job.yaml", "an integer of more than 4300 digits")


def test_30_12_fit_executor_ray_without_ray_is_bad_input(capsys, monkeypatch, no_simulation):
    monkeypatch.setitem(
        sys.modules, "ray", None
    )  # ``import ray`` raises ImportError, as without it installed
    rc, _, err = cli(["fit", *FIT[2:], "--world-size", "2", "--executor", "ray"], capsys)
    assert_bad_input(rc, err, "--executor ray needs Ray", "pip install 'hyperdryrun[ray]'")


def test_30_13_measure_keeps_the_terminal_clean_as_run_does(tmp_path):
    """Kineto's C++ ``USDT: ... profiler_start/stop`` lines and FSDP2's FSDPEmbedding UserWarning went to stderr."""
    proc = hdr(["measure", *T, "--world-size", "2", "--tp", "2", "--quiet", "--output-dir", "out"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    limitations = json.loads((tmp_path / "out/rank_0/rank_0_memory.json").read_text())["limitations"]
    assert any("FSDPEmbedding" in line and line.startswith("warned during") for line in limitations)


def test_30_13_measure_refuses_a_bad_alloc_conf_variable_as_the_flag(tmp_path):
    proc = hdr(["measure", *T, "--output-dir", "out"], tmp_path, env={"PYTORCH_CUDA_ALLOC_CONF": "bogus:1"})
    assert_bad_input(proc.returncode, proc.stderr, "$PYTORCH_CUDA_ALLOC_CONF", "'bogus'")
    assert not (tmp_path / "out").exists()


def bert_config(tmp_path: Path) -> str:
    d = tmp_path / "bert"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": ["BertModel"], "model_type": "bert", "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "intermediate_size": 128, "vocab_size": 100, "max_position_embeddings": 128,
    }))  # fmt: skip
    return f"hf:{d}"


@pytest.mark.parametrize(
    ("make", "needles"),
    [
        (lambda p: hf_config(p, rms_norm_eps=math.nan), ["field rms_norm_eps", "finite number"]),
        (
            lambda p: hf_config(p, rope_scaling={"rope_type": "llama3"}),
            ["transformers cannot build", "factor"],
        ),
        (bert_config, ["field model_type", "BertLMHeadModel", "'bert'", "not 'model.layers'"]),
    ],
    ids=["nan", "rope-scaling-keys", "bert"],
)
@pytest.mark.parametrize("command", ["run", "fit"])
def test_30_5_a_config_transformers_cannot_build_as_a_decoder_is_bad_input_and_keeps_the_report(
    command, make, needles, tmp_path, capsys, no_simulation
):
    pytest.importorskip("transformers")
    model = make(tmp_path)
    files = good_report(tmp_path / "out")
    argv = (
        ["run", "--model", model, "--seq-len", "64", "--output-dir", "out"]
        if command == "run"
        else ["fit", "--model", model, *FIT[2:], "--world-size", "2"]
    )
    rc, _, err = cli(argv, capsys)
    assert_bad_input(rc, err, "config", *needles)
    assert unchanged(files)


def test_30_an_hf_job_keeps_the_terminal_clean_where_torchao_is_installed(tmp_path):
    """transformers' model modules import torchao when it is installed; on a CPU torch it logged two "Failed to
    load ..." lines and two pytree warnings before bad input's one line, and the pytree one after a good run's."""
    hf = ["run", "--model", "hf:qwen2.5-7b", "--n-layers", "1", "--seq-len", "32", "--quiet"]
    bad = hdr([*hf, "--dim", "64", "--output-dir", "out"], tmp_path)
    assert_bad_input(bad.returncode, bad.stderr, "num_attention_heads")
    good = hdr([*hf, "--output-dir", "out"], tmp_path)
    assert good.returncode == 0 and good.stderr == "", good.stderr


# items 2, 6, 7: the script contract (a user's mistake is the user's: exit 2 naming the callback and what it returned)

SCRIPT = """
import os, sys, torch
from torch import nn
def model_fn():
    return "model" if os.environ.get("MODE", "") == "model_str" else nn.Linear(16, 16)
def batch_fn(i, device):
    return "batch" if os.environ.get("MODE", "") == "batch_str" else torch.randn(4, 16, device=device)
def loss_fn(model, batch):
    if os.environ.get("MODE", "").startswith("loss_exit"):
        sys.exit(int(os.environ.get("MODE", "")[-1]))
    if os.environ.get("MODE", "") == "print":
        for _ in range(5000):
            print("x" * 80)
    if os.environ.get("MODE", "") == "loss_kbi":
        raise KeyboardInterrupt
    if os.environ.get("MODE", "") == "loss_kill":
        os.kill(os.getpid(), 9)
    if os.environ.get("MODE", "") == "loss_raise":
        raise ValueError("my own bug")
    return {"loss_none": None, "loss_float": 1.0, "loss_vec": model(batch).sum(0)}.get(os.environ.get("MODE", ""), model(batch).sum())
def optimizer_fn(params):
    return None if os.environ.get("MODE", "") == "opt_none" else torch.optim.SGD(params, lr=0.1)
def hyperdryrun_job(launch):
    if os.environ.get("MODE", "") == "job_exit0":
        sys.exit(0)
    job = dict(model_fn=model_fn, batch_fn=batch_fn, loss_fn=loss_fn, optimizer_fn=optimizer_fn)
    if os.environ.get("MODE", "") == "mesh":
        job["mesh_shape"] = (3, 5)
    if os.environ.get("MODE", "") == "step_noop":
        job["step_fn"] = lambda model, batches, optimizer: None
        del job["loss_fn"]
    if os.environ.get("MODE", "") == "nmb_huge":
        job["num_micro_batches"] = 10**400
    if os.environ.get("MODE", "") == "tpu":
        job["target_device"] = "tpu"
    return job
if os.environ.get("MODE", "") == "kbi":
    raise KeyboardInterrupt
if os.environ.get("MODE", "") == "print_top":
    for _ in range(5000):
        print("line")
"""


@pytest.mark.parametrize(
    ("mode", "needles"),
    [
        ("model_str", ["model_fn() returned a str, not a torch.nn.Module"]),
        ("batch_str", ["batch_fn(0, device) returned a str holding no tensor"]),
        ("loss_none", ["loss_fn(model, batch) returned None, not a scalar"]),
        ("loss_float", ["loss_fn(model, batch) returned a float"]),
        ("loss_vec", ["loss_fn(model, batch) returned a tensor of shape [16]"]),
        ("opt_none", ["optimizer_fn(params) returned None, not a torch.optim.Optimizer"]),
        ("loss_exit0", ["sys.exit(0) was called by the job's own code"]),
        ("loss_exit1", ["sys.exit(1) was called by the job's own code"]),
        ("job_exit0", ["hyperdryrun_job(launch)", "called sys.exit(0)"]),
        ("mesh", ["mesh_shape=(3, 5) has 15 ranks, world_size=1"]),
        ("tpu", ["target_device='tpu'", "--target-device"]),
        ("loss_raise", ["loss_fn() of", "raised ValueError: my own bug (job.py:"]),
        ("step_noop", ["the step ran no tensor operation"]),
        (
            "nmb_huge",
            ["num_micro_batches: must be an integer from 1 to 10,000 (got an integer of about 401 digits)"],
        ),
    ],
)
def test_30_6_a_callbacks_mistake_is_bad_input_naming_it(mode, needles, tmp_path, capsys, monkeypatch):
    """--in-process (sys.exit(0) there exited 0 with nothing done; sys.exit(1) read as an OOM)."""
    (tmp_path / "job.py").write_text(SCRIPT)
    monkeypatch.setenv("MODE", mode)
    spec = str(tmp_path / "job.py")  # its own spec: a loaded script is cached by it in this process
    rc, out, err = cli(["script", spec, "--in-process", "--quiet", "--output-dir", "out"], capsys)
    assert_bad_input(rc, err, *needles)
    assert "peak" not in out


def test_30_6_the_same_in_a_child_process(tmp_path):
    (tmp_path / "job.py").write_text(SCRIPT)
    for mode, needle in (
        ("loss_exit0", "sys.exit(0)"),
        ("loss_none", "returned None"),
        ("mesh", "mesh_shape"),
    ):
        proc = hdr(["script", "job.py", "--quiet", "--output-dir", "out"], tmp_path, env={"MODE": mode})
        assert_bad_input(proc.returncode, proc.stderr, needle)


@pytest.mark.parametrize("in_process", [False, True], ids=["child", "in-process"])
def test_30_6_keyboard_interrupt_at_the_scripts_top_level_is_an_interrupt(in_process, tmp_path):
    """As Python answers an uncaught KeyboardInterrupt: 130 and one line (it was exit 3 "KeyboardInterrupt:;")."""
    (tmp_path / "job.py").write_text(SCRIPT)
    extra = ["--in-process"] if in_process else []
    proc = hdr(["script", "job.py", *extra, "--output-dir", "out"], tmp_path, env={"MODE": "kbi"})
    assert proc.returncode == 130 and proc.stderr == "hyperdryrun: interrupted (SIGINT)\n", proc.stderr


@pytest.mark.parametrize("mode", ["print", "print_top"], ids=["in-loss-fn", "top-level"])
@pytest.mark.parametrize("in_process", [False, True], ids=["child", "in-process"])
def test_30_7_the_scripts_own_prints_into_a_closed_pipe_exit_141_quietly(mode, in_process, tmp_path):
    (tmp_path / "job.py").write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "MODE": mode}
    extra = ["--in-process"] if in_process else []
    proc = subprocess.Popen(
        [*HYPERDRYRUN, "script", "job.py", *extra, "--output-dir", "out"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    proc.stdout.close()  # the reader is gone before the first line
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141, err
    assert err == ""


@pytest.mark.parametrize("many", [["--ranks", "0"], ["--all-ranks"]], ids=["ranks", "all-ranks"])
def test_30_7_the_same_from_the_runners_workers(many, good_run, tmp_path):
    """Under --ranks/--all-ranks the step runs in the runner's worker processes: their prints into a closed pipe
    are 141 (they were exit 3, an internal error), a KeyboardInterrupt the job raises is 130, as in one process,
    and the earlier good report stays."""
    out, files = good_run
    (tmp_path / "job.py").write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "MODE": "print"}
    proc = subprocess.Popen(
        [*HYPERDRYRUN, "script", "job.py", *many, "--output-dir", "out"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141, err
    assert err == ""
    proc = hdr(["script", "job.py", *many, "--output-dir", "out"], tmp_path, env={"MODE": "loss_kbi"})
    assert proc.returncode == 130 and proc.stderr == "hyperdryrun: interrupted (SIGINT)\n", proc.stderr
    assert unchanged(files)


@pytest.mark.parametrize("many", [[], ["--ranks", "0"]], ids=["child", "ranks"])
def test_30_an_internal_failure_writes_its_error_report_beside_a_good_report(many, good_run, tmp_path):
    """No good file is replaced by something else: a crash's error report (exit 3, the evidence for a bug report)
    went over an earlier good report; it now goes beside it, named in the one line, and the good files stay."""
    out, files = good_run
    (tmp_path / "job.py").write_text(SCRIPT)
    proc = hdr(
        ["script", "job.py", *many, "--quiet", "--output-dir", "out"], tmp_path, env={"MODE": "loss_kill"}
    )
    beside = "out/rank_0/rank_0_error.json"
    assert proc.returncode == 3 and proc.stderr.count("\n") == 1 and f"(report: {beside})" in proc.stderr
    assert json.loads((tmp_path / beside).read_text())["error"]["type"] == "ChildDied"
    assert unchanged(files)


# the smaller items of issue 30


def _csv_rows(out: Path) -> list[list[str]]:
    return list(csv.reader(io.StringIO((out / "rank_0" / "rank_0_memory.csv").read_text())))


def test_30_a_csv_cell_that_is_not_an_integer_names_its_column(good_run, tmp_path, capsys):
    out, _ = good_run
    rows = _csv_rows(out)
    rows[1][CSV_COLUMNS.index("size")] = "abc"
    buf = io.StringIO()
    csv.writer(buf).writerows(rows)
    (tmp_path / "bad.csv").write_text(buf.getvalue())
    rc, _, err = cli(["compare", "bad.csv", "out/rank_0/rank_0_memory.csv"], capsys)
    assert_bad_input(rc, err, "bad.csv", "line 2", "size: 'abc' is not an integer")


def test_30_a_csv_with_a_byte_order_mark_is_read(good_run, tmp_path, capsys):
    (tmp_path / "bom.csv").write_bytes(
        b"\xef\xbb\xbf" + (tmp_path / "out/rank_0/rank_0_memory.csv").read_bytes()
    )
    rc, out, err = cli(["compare", "bom.csv", "out/rank_0/rank_0_memory.csv"], capsys)
    assert rc == 0, err


@pytest.mark.parametrize("value", ["١", "1_0", "²", " 1 2"])
def test_30_rank_takes_ascii_digits_only(value, capsys, monkeypatch, no_simulation):
    """Python's int() reads '١' (an Arabic-Indic one) and '1_0' as numbers; torchrun writes ASCII digits."""
    monkeypatch.setenv("RANK", value)
    rc, _, err = cli(["run", *T], capsys)
    assert_bad_input(rc, err, "RANK=", "is not an integer")


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["run", *T, "--world-size", "١"], "--world-size"),
        (["run", *T, "--seq-len", "6_4"], "--seq-len"),
        (["run", *T, "--lr", "١.5"], "--lr"),
        (["run", *T, "--device-memory-gib", "٨٠"], "--device-memory-gib"),
        (["fit", *FIT, "--world-size", "2", "--tp", "1,٢"], "--tp"),
        (["fit", *FIT, "--world-size", "2", "--global-batch-tokens", "1_000"], "--global-batch-tokens"),
        (["compare", "a.json", "b.json", "--tolerance", "٠.1"], "--tolerance"),
        (["script", "job.py", "--jobs", "٢"], "--jobs"),
        (["torchtitan", "--fit-tp", "١"], "--fit-tp"),
        (["torchtitan", "--margin-gib", "١"], "--margin-gib"),
    ],
)
def test_30_a_number_flag_takes_ascii_digits_only(argv, flag, capsys, no_simulation):
    """As RANK=: Python's int() and float() read '١' and '1_0'; a flag's number is ASCII digits (they ran)."""
    rc, _, err = cli(argv, capsys)
    assert_bad_input(rc, err, f"argument {flag}: invalid")


def test_30_snapshot_to_a_gz_name_is_gzip_compressed_and_reads_back(good_run, tmp_path, capsys):
    rc, _, err = cli(["snapshot", G, "-o", "s.pickle.gz"], capsys)
    assert rc == 0, err
    raw = (tmp_path / "s.pickle.gz").read_bytes()
    assert raw[:2] == b"\x1f\x8b"  # the gzip magic
    assert pickle.loads(gzip.decompress(raw))["segments"]
    rc, _, err = cli(["snapshot", G, "-o", "s2.pickle.gz"], capsys)
    assert (tmp_path / "s2.pickle.gz").read_bytes() == raw  # deterministic (no time in the gzip header)


def test_30_compare_replay_of_a_snapshot_hyperdryrun_wrote_says_it_holds_tensors_only(
    good_run, tmp_path, capsys
):
    assert cli(["snapshot", G, "-o", "s.pickle"], capsys)[0] == 0
    rc, _, err = cli(["compare", "--replay", "s.pickle"], capsys)
    assert_bad_input(rc, err, "s.pickle", "HyperDryRun wrote from a report", "tensors only")


def test_30_a_scripts_syntax_error_is_located_in_the_script(tmp_path, capsys):
    (tmp_path / "syn.py").write_text("import torch\nx = (\n")
    rc, _, err = cli(["script", str(tmp_path / "syn.py"), "--in-process"], capsys)
    assert_bad_input(rc, err, "SyntaxError", "(syn.py:2)")
    assert "frozen" not in err


def test_30_a_process_the_users_script_starts_does_not_outlive_sigterm(tmp_path):
    import signal
    import time

    (tmp_path / "job.py").write_text(
        "import subprocess, time, torch\n"
        "from torch import nn\n"
        "child = subprocess.Popen(['sleep', '300'])\n"
        "open('sleep.pid', 'w').write(str(child.pid))\n"
        "def hyperdryrun_job(launch):\n"
        "    time.sleep(300)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen(
        [*HYPERDRYRUN, "script", "job.py", "--output-dir", "out"], cwd=tmp_path, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    pid_file = tmp_path / "sleep.pid"
    for _ in range(600):
        if pid_file.exists() and pid_file.read_text():
            break
        time.sleep(0.1)
    sleep_pid = int(pid_file.read_text())
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    for _ in range(50):  # the kill is immediate; its reaping by init may take a moment
        try:
            os.kill(sleep_pid, 0)
        except ProcessLookupError:
            break
        if (
            Path(f"/proc/{sleep_pid}/stat").exists()
            and Path(f"/proc/{sleep_pid}/stat").read_text().split()[2] == "Z"
        ):
            break  # a zombie: dead, waiting for init
        time.sleep(0.1)
    else:
        os.kill(sleep_pid, signal.SIGKILL)
        pytest.fail("the script's subprocess outlived SIGTERM")


@pytest.mark.parametrize(
    ("cuda", "needle"),
    [("context_mib: 1.0e+300", "cuda.context_mib"), ("nccl_buffsize: " + BIG, "cuda.nccl_buffsize"),
     ("nccl_channels: 100000", "cuda.nccl_channels")],
    ids=["context", "buffsize", "channels"],
)  # fmt: skip
def test_30_4_the_cuda_runtimes_numbers_are_bounded_too(cuda, needle, capsys, tmp_path, no_simulation):
    rc, err = run_config(f"model: {{name: llama-tiny}}\ncuda: {{{cuda}}}\n", capsys, tmp_path)
    assert_bad_input(rc, err, needle, "less than or equal to")
    assert len(err) < 300
