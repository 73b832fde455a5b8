"""Hostile and broken inputs, one explicit case each (issue 13): every one is a single line on stderr naming the
file or field, exit code 2, nothing written, in bounded time and memory. The generated variety is in
tests/test_fuzz.py; these pin the cases found by hand.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
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
