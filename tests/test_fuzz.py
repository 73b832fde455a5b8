"""Generated hostile inputs (hypothesis) for every file the command line reads: YAML job files (``run
--config``) and each ingested format (report JSON, memory-block CSV, Chrome trace ``.json``/``.json.gz``, CUDA
snapshot pickle, arbitrary bytes) through ``compare``.

The property, for every input: the command either accepts it or refuses it with exit code 2 and exactly one line
``hyperdryrun: error: ...`` on stderr (never an internal error, a traceback or exit 1 for unreadable input), and
writes nothing. In-process for speed (derandomized, so CI sees the same examples every run); one real process
under an address-space cap and a timeout replays a sample of them, so time and memory stay bounded too.
The whole file runs in well under a minute on two cores (see ``BUDGET``).
"""

from __future__ import annotations

import contextlib
import copy
import csv
import gzip
import io
import json
import os
import pickle
import resource
import stat
import subprocess
import sys
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hyperdryrun.cli import main
from hyperdryrun.commands.job import RUN_FLAGS, WORLD_SIZE
from hyperdryrun.ingest.files import LIMITS
from hyperdryrun.report.schema import CSV_COLUMNS
from tests.ingest.fixtures.make_fixtures import snapshot

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "ingest" / "fixtures"
REFERENCE = FIXTURES / "tiny.snapshot.pickle"
BUDGET = settings(
    max_examples=150,
    deadline=timedelta(seconds=5),  # one example is milliseconds; this only catches a runaway input
    derandomize=True,
    database=None,  # nothing written under the repository
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


ENV_VARS = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "PYTORCH_CUDA_ALLOC_CONF", "CUBLAS_WORKSPACE_CONFIG", "NCCL_BUFFSIZE",
    *(limit.env for limit in (*LIMITS, WORLD_SIZE)),
)  # fmt: skip
"""Every environment variable a command reads (issue 23)."""
SMALL_BUDGET = settings(BUDGET, max_examples=60)
"""For the properties whose examples build a job (tens of milliseconds each)."""


class Accepted(BaseException):
    """Raised instead of simulating: the job file was valid (a BaseException, so no handler of the CLI eats it)."""


@pytest.fixture(autouse=True)
def _no_simulation(monkeypatch):
    """``run`` validates, then would simulate: stop it there; and no ambient identity or limit."""
    import hyperdryrun.runner as runner

    def accepted(*args: Any, **kwargs: Any) -> Any:
        raise Accepted

    import hyperdryrun.search.fit as search

    monkeypatch.setattr(runner, "run_rank", accepted)
    monkeypatch.setattr(runner, "run_ranks", accepted)
    monkeypatch.setattr(search, "fit", accepted)  # fit validates everything, then would search
    for var in list(os.environ):
        if (
            var in ENV_VARS
            or var == "LOCAL_WORLD_SIZE"
            or var.startswith("PYTORCH_")
            or var.startswith("HYPERDRYRUN_MAX_")
        ):
            monkeypatch.delenv(var)


def call(argv: list[str]) -> tuple[int | None, str, str]:
    """``hyperdryrun <argv>`` in-process: (exit code, stdout, stderr); exit code None when ``run`` accepted."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc: int | None = main(argv)
        except SystemExit as exc:
            rc = int(exc.code or 0)
        except Accepted:
            rc = None
    return rc, out.getvalue(), err.getvalue()


def check_refused_or_read(rc: int | None, out: str, err: str, allowed: set[int | None]) -> None:
    assert rc in allowed | {2}, (rc, err[-2000:])
    if rc == 2:
        assert err.count("\n") == 1 and err.startswith("hyperdryrun: error: "), err[-2000:]
        assert "Traceback" not in err and out == ""


@contextlib.contextmanager
def scratch() -> Any:
    """A fresh directory per example (hypothesis runs many examples in one test call)."""
    with tempfile.TemporaryDirectory() as tmp:
        yield Path(tmp)


def files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


# ---------------------------------------------------------------------------------------------------------
# values: what a hostile file may put where a field is expected
# ---------------------------------------------------------------------------------------------------------

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 2, 8, 64, 2**31, 2**63, 2**64]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(
        ["op", "full", "none", "selective", "llama-tiny", "moe-tiny", "bf16", "hotspot", "inf", "1e20"]
    ),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
json_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=12),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def paths_of(data: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path (keys and indices) into nested dicts and lists, the root included."""
    out = [prefix]
    if isinstance(data, dict):
        for k, v in data.items():
            out += paths_of(v, (*prefix, k))
    elif isinstance(data, list):
        for i, v in enumerate(data[:6]):
            out += paths_of(v, (*prefix, i))
    return out


def replaced(data: Any, path: tuple, value: Any, delete: bool = False) -> Any:
    """A copy of ``data`` with the value at ``path`` replaced (or deleted)."""
    if not path:
        return value
    out = copy.deepcopy(data)
    node = out
    for key in path[:-1]:
        node = node[key]
    if delete:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return out


@st.composite
def mutated(draw: Any, base: Any, new_values: Any) -> Any:
    """``base`` with one to three fields replaced by drawn values (or removed)."""
    data = base
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(paths_of(data)))
        delete = bool(path) and draw(st.booleans()) and draw(st.booleans())
        data = replaced(data, path, draw(new_values), delete=delete)
    return data


# ---------------------------------------------------------------------------------------------------------
# YAML job files
# ---------------------------------------------------------------------------------------------------------

VALID_JOB = {
    "model": {"name": "llama-tiny", "n_layers": 2},
    "parallel": {"dp_shard": 2, "tp": 1, "reshard_after_forward": True},
    "training": {"seq_len": 64, "micro_batch_size": 1, "ac": "selective", "ac_selective": "op"},
    "world": {"world_size": 2, "rank": 1},
    "values": {"rules": [{"module": "gate", "op": "aten.nonzero*", "handler": "size", "value": 4}]},
    "device_memory_gib": 80,
}


def _yaml_dump(data: Any) -> str:
    try:
        return yaml.safe_dump(data, sort_keys=False, allow_unicode=True)
    except yaml.YAMLError:  # a float('nan') key and such: any text will do
        return repr(data)


yaml_files = st.one_of(
    mutated(VALID_JOB, values).map(lambda d: _yaml_dump(d).encode()),
    st.text(alphabet=st.sampled_from(list("abc:-[]{}&*!|>'\"#%@`,?\n \t0123456789.")), max_size=200).map(
        str.encode
    ),
    st.binary(max_size=200),
)


def test_the_valid_job_file_is_accepted(tmp_path):
    cfg = tmp_path / "job.yaml"
    cfg.write_text(_yaml_dump(VALID_JOB))
    assert call(["run", "--config", str(cfg), "--output-dir", str(tmp_path / "out")])[0] is None


@BUDGET
@given(raw=yaml_files)
def test_any_yaml_job_file_is_accepted_or_refused_on_one_line(raw):
    with scratch() as tmp:
        cfg = tmp / "job.yaml"
        cfg.write_bytes(raw)
        rc, out, err = call(["run", "--config", str(cfg), "--output-dir", str(tmp / "out")])
        check_refused_or_read(rc, out, err, {None})
        assert files(tmp) == ["job.yaml"]


# ---------------------------------------------------------------------------------------------------------
# ingested files, through compare
# ---------------------------------------------------------------------------------------------------------


def compare_file(path: Path) -> tuple[int | None, str, str]:
    return call(["compare", str(path), str(REFERENCE)])


def reference_report() -> dict:
    from hyperdryrun.compare import as_report
    from hyperdryrun.report.reader import load_any

    return json.loads(json.dumps(as_report(load_any(REFERENCE))))


REPORT = reference_report()


@BUDGET
@given(report=mutated(REPORT, json_values))
def test_any_report_json_is_read_or_refused_on_one_line(report):
    with scratch() as tmp:
        path = tmp / "r.json"
        path.write_text(json.dumps(report))
        check_refused_or_read(*compare_file(path), {0, 1})
        assert files(tmp) == ["r.json"]


cells = st.one_of(
    st.integers(min_value=-5, max_value=40).map(str),
    st.sampled_from(
        ["", "{}", "{1-2}", "{-1}", "nan", "9" * 30, "Activation", "forward", "x", "\x00", '"', "a\nb"]
    ),
    st.text(max_size=8),
)


@st.composite
def block_csvs(draw: Any) -> str:
    """A memory-block CSV: ordinary rows (so most are readable), some cells replaced by drawn text."""
    rows = []
    for _ in range(draw(st.integers(0, 4))):
        start = draw(st.integers(0, 6))
        row = dict.fromkeys(CSV_COLUMNS, "")
        row.update(
            start_time_stamp=str(start), end_time_stamp=str(start + draw(st.integers(1, 5))),
            start_plot_time_stamp="0", end_plot_time_stamp="1", device_addr="0", stream_id="0", pool_type="0",
            size=str(draw(st.integers(0, 4096))), actual_used_memory="0", actual_peak_memory="0",
            type=draw(st.sampled_from(["Activation", "Temp", "Parameter"])), producer_task=str(start),
            task_name=draw(st.sampled_from(["forward", "backward", "initialization"])), node_name="mm",
            user_tasks="{}", is_persistent="0", is_small="1",
        )  # fmt: skip
        for _ in range(draw(st.integers(0, 2))):
            row[draw(st.sampled_from(CSV_COLUMNS))] = draw(cells)
        rows.append([row[c] for c in CSV_COLUMNS])
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    header = list(CSV_COLUMNS) if draw(st.integers(0, 9)) else list(CSV_COLUMNS[:-1])
    w.writerow(header)
    w.writerows(rows)
    return buf.getvalue()


@BUDGET
@given(text=block_csvs())
def test_any_block_csv_is_read_or_refused_on_one_line(text):
    with scratch() as tmp:
        path = tmp / "b.csv"
        path.write_text(text)
        check_refused_or_read(*compare_file(path), {0, 1})
        assert files(tmp) == ["b.csv"]


@st.composite
def chrome_traces(draw: Any) -> Any:
    """Profiler-shaped events (spans and [memory] instants) with drawn values where PyTorch writes numbers."""
    events = []
    for _ in range(draw(st.integers(0, 6))):
        ts = draw(st.one_of(st.integers(0, 50), json_values))
        if draw(st.booleans()):
            args = {
                "Addr": draw(st.one_of(st.integers(0, 4), json_values)),
                "Bytes": draw(st.one_of(st.integers(-64, 64), json_values)),
            }
            args.update(
                draw(
                    st.dictionaries(
                        st.sampled_from(["Total Allocated", "Device Type", "Device Id"]),
                        json_values,
                        max_size=2,
                    )
                )
            )
            events.append({"ph": "i", "name": "[memory]", "ts": ts, "pid": 1, "tid": 1, "args": args})
        else:
            events.append({
                "ph": "X", "cat": draw(st.sampled_from(["cpu_op", "python_function", "user_annotation", "x"])),
                "name": draw(st.sampled_from(["aten::mm", "model.py(3): forward", "Optimizer.step#AdamW.step", "nn.Module: L_0"])),
                "ts": ts, "dur": draw(st.one_of(st.integers(0, 50), json_values)),
                "pid": draw(st.one_of(st.just(1), json_values)), "tid": 1,
            })  # fmt: skip
    return {"traceEvents": events} if draw(st.booleans()) else events


@BUDGET
@given(trace=chrome_traces(), gzipped=st.booleans())
def test_any_chrome_trace_is_read_or_refused_on_one_line(trace, gzipped):
    with scratch() as tmp:
        raw = json.dumps(trace).encode()
        path = tmp / ("t.json.gz" if gzipped else "t.json")
        path.write_bytes(gzip.compress(raw) if gzipped else raw)
        check_refused_or_read(*compare_file(path), {0, 1})
        assert files(tmp) == [path.name]


SNAPSHOT = snapshot()
pickle_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**66), 2**66),
        st.floats(),
        st.text(max_size=8),
        st.binary(max_size=8),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.tuples(inner), st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)


@BUDGET
@given(data=mutated(SNAPSHOT, pickle_values))
def test_any_snapshot_pickle_is_read_or_refused_on_one_line(data):
    with scratch() as tmp:
        path = tmp / "s.pickle"
        path.write_bytes(pickle.dumps(data))
        check_refused_or_read(*compare_file(path), {0, 1})
        assert files(tmp) == ["s.pickle"]


@BUDGET
@given(
    raw=st.one_of(
        st.binary(max_size=300),
        st.binary(max_size=300).map(lambda b: b"\x80" + b),
        st.binary(max_size=300).map(gzip.compress),
    )
)
def test_any_bytes_are_refused_on_one_line(raw):
    with scratch() as tmp:
        path = tmp / "x.bin"
        path.write_bytes(raw)
        check_refused_or_read(*compare_file(path), set())
        assert files(tmp) == ["x.bin"]


# ---------------------------------------------------------------------------------------------------------
# a sample replayed in one real process, with an address-space cap and a timeout
# ---------------------------------------------------------------------------------------------------------

REPLAY = """
import sys
from hyperdryrun.cli import main
for path in sys.argv[1:]:
    try:
        rc = main(["compare", path, path])
    except SystemExit as exc:
        rc = exc.code
    print("rc", rc, flush=True)
"""


def test_a_sample_of_hostile_files_in_a_capped_process(tmp_path):
    samples = {
        "deep.json": b"[" * 200_000 + b"]" * 200_000,
        "gz.json.gz": gzip.compress(b"[" + b" " * (8 << 20) + b"]"),
        "report.json": json.dumps(replaced(REPORT, ("metadata",), 5)).encode(),
        "frames.pickle": pickle.dumps(replaced(SNAPSHOT, ("device_traces", 0, 0, "frames"), 7)),
        "nul.csv": b",".join(c.encode() for c in CSV_COLUMNS) + b"\n0\x00,1\n",
        "junk.bin": bytes(range(256)) * 64,
        # issue 23: 220 KB of shared references to one 100,000-entry trace (was 33-43 s and a MemoryError), and
        # integers no step has (an OverflowError and Python's 4,300-digit ValueError, exit 3)
        "shared.pickle": pickle.dumps(
            {
                "segments": [],
                "device_traces": [[{"action": "alloc", "addr": 1, "size": 512}] * 100_000] * 10_000,
            }
        ),
        "digits.json": b'{"traceEvents": [{"ph": "i", "ts": ' + b"9" * 100_000 + b"}]}",
        "bytes.json": json.dumps(
            {
                "traceEvents": [
                    {
                        "ph": "i",
                        "name": "[memory]",
                        "ts": 1,
                        "pid": 1,
                        "tid": 1,
                        "args": {"Addr": 1, "Bytes": 10**400},
                    }
                ]
            }  # fmt: skip
        ).encode(),
    }
    paths = []
    for name, raw in samples.items():
        (tmp_path / name).write_bytes(raw)
        paths.append(str(tmp_path / name))
    cap = 3 << 30

    def capped() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    env = {k: v for k, v in os.environ.items() if not k.startswith("HYPERDRYRUN_MAX_")}
    env["PYTHONPATH"] = str(ROOT / "src")
    proc = subprocess.run(
        [sys.executable, "-c", REPLAY, *paths],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=capped,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["rc", "2"] * len(samples)
    lines = proc.stderr.splitlines()
    assert len(lines) == len(samples) and all(line.startswith("hyperdryrun: error: ") for line in lines)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(samples)


# ---------------------------------------------------------------------------------------------------------
# environment variables, flags, HF config.json files and output paths (issue 23): a good report already in the
# output directory stays byte for byte unless the run succeeds (here the simulation is stopped once accepted)
# ---------------------------------------------------------------------------------------------------------

safe_text = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=16
)  # what an environment variable or an argv entry can hold
hostile = st.one_of(
    safe_text,
    st.integers(-(2**70), 2**70).map(str),
    st.floats().map(str),
    st.sampled_from(
        [
            "", "0", "-1", "1", "2", "8", "nan", "inf", "-inf", "1e400", "9" * 5000, "1_000", " 2 ", "abc", "@@@",
            "expandable_segments:True", "max_split_size_mb:" + "9" * 30, "max_split_size_mb:20",
            "garbage_collection_threshold:0.5", "backend:cudaMallocAsync", ":4096:8", ":x:y", "llama-tiny",
            "moe-tiny", "h100-80gb", "mi300x", "/", "/dev/null", "a,b", "1,2,3", "0,0", "bf16", "full", "hf:/",
        ]
    ),
)  # fmt: skip
TINY = ["--model", "llama-tiny", "--seq-len", "64"]
FIT_BASE = [*TINY, "--world-size", "2", "--gpu", "h100-80gb", "--global-batch-seqs", "8", "--no-cache"]


def good_report(out: Path) -> dict[Path, bytes]:
    """Files standing for a good earlier report of rank 0 (and 1) under ``out``."""
    kept = {}
    for r in (0, 1):
        for name in ("memory.json", "memory.csv", "segments.csv"):
            p = out / f"rank_{r}" / f"rank_{r}_{name}"
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(f"good {name}\n")
            kept[p] = p.read_bytes()
    return kept


def check_kept(kept: dict[Path, bytes]) -> None:
    assert all(p.read_bytes() == data for p, data in kept.items())
    assert sorted(kept) == sorted(p for p in next(iter(kept)).parents[1].rglob("*") if p.is_file())


def command_argv(command: str, out: Path) -> list[str]:
    return {
        "run": ["run", *TINY, "--output-dir", str(out)],
        "run-ranks": ["run", *TINY, "--world-size", "2", "--ranks", "0,1", "--output-dir", str(out)],
        "fit": ["fit", *FIT_BASE],
        "compare": ["compare", str(REFERENCE), str(REFERENCE)],
    }[command]


@SMALL_BUDGET
@given(
    env=st.dictionaries(st.sampled_from(ENV_VARS), hostile, min_size=1, max_size=3),
    command=st.sampled_from(["run", "run-ranks", "fit", "compare"]),
)
def test_any_environment_is_accepted_or_refused_on_one_line_and_keeps_the_report(env, command):
    with scratch() as tmp, mock.patch.dict(os.environ, env):
        kept = good_report(tmp / "out")
        rc, out, err = call(command_argv(command, tmp / "out"))
        check_refused_or_read(rc, out, err, {None, 0, 1} if command == "compare" else {None})
        check_kept(kept)


def _flag_values(flags: list[str]) -> Any:
    """One to three ``--flag=value`` arguments (``=``: a value starting with '-' stays a value)."""
    return st.lists(
        st.tuples(st.sampled_from(flags), hostile).map(lambda fv: f"{fv[0]}={fv[1]}"), min_size=1, max_size=3
    )


@SMALL_BUDGET
@given(flags=_flag_values([*RUN_FLAGS, "--config", "--ranks", "--jobs", "--all-ranks"]))
def test_any_run_flags_are_accepted_or_refused_on_one_line_and_keep_the_report(flags):
    with scratch() as tmp:
        kept = good_report(tmp / "out")
        rc, out, err = call(["run", *TINY, "--output-dir", str(tmp / "out"), *flags])
        check_refused_or_read(rc, out, err, {None})
        check_kept(kept)


def _fit_flags() -> list[str]:
    from hyperdryrun.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return sorted(
        o
        for a in sub.choices["fit"]._actions
        for o in a.option_strings
        if o.startswith("--") and o != "--help"
    )


@SMALL_BUDGET
@given(flags=_flag_values(_fit_flags()))
def test_any_fit_flags_are_accepted_or_refused_on_one_line(flags):
    with scratch() as tmp, contextlib.chdir(tmp):
        rc, out, err = call(["fit", *FIT_BASE, *flags])
        check_refused_or_read(rc, out, err, {None})
        assert files(tmp) == []  # --json/--csv are written after the search only


HF_CONFIG = json.loads((ROOT / "src/hyperdryrun/models/hf_configs/llama-3.1-8b.json").read_text())


@SMALL_BUDGET
@given(config=mutated(HF_CONFIG, json_values), command=st.sampled_from(["run", "fit"]))
def test_any_hf_config_is_accepted_or_refused_on_one_line(config, command):
    pytest.importorskip("transformers")
    with scratch() as tmp:
        (tmp / "hf").mkdir()
        (tmp / "hf" / "config.json").write_text(json.dumps(config))
        model = ["--model", f"hf:{tmp / 'hf'}", "--seq-len", "64"]
        argv = (
            ["run", *model, "--output-dir", str(tmp / "out")]
            if command == "run"
            else ["fit", *model, *FIT_BASE[4:]]
        )
        rc, out, err = call(argv)
        check_refused_or_read(rc, out, err, {None})
        assert files(tmp) == ["hf/config.json"]


@st.composite
def output_paths(draw: Any, tmp: Path) -> str:
    """A path where an output goes: free, an existing file or directory, under a file, missing parents."""
    (tmp / "dir").mkdir(exist_ok=True)
    (tmp / "file").write_text("a file\n")
    if not (tmp / "fifo").exists():
        os.mkfifo(tmp / "fifo")  # a special file of our own, not the machine's /dev/null (CI runs as root)
    base = draw(st.sampled_from(["free", "dir", "file", "file/under", "missing/deep/x", "dir/x", "fifo", ""]))
    return str(tmp / base) if base else draw(st.sampled_from(["/", "/proc/version"]))


@SMALL_BUDGET
@given(
    data=st.data(), command=st.sampled_from(["report-html", "report-plot", "snapshot", "fit-json", "fit-csv"])
)
def test_any_output_path_is_written_whole_or_refused_before_anything_is_written(data, command):
    with scratch() as tmp:
        path = data.draw(output_paths(tmp))
        keep = tmp / "keep.html"
        keep.write_text("keep\n")
        before = {p: p.read_bytes() for p in tmp.rglob("*") if p.is_file()}
        trace = str(FIXTURES / "tiny_step.trace.json.gz")
        argv = {
            "report-html": ["report", trace, "--html", path],
            "report-plot": ["report", trace, "--html", str(keep), "--plot", path],
            "snapshot": ["snapshot", trace, "-o", path],
            "fit-json": ["fit", *FIT_BASE, "--json", path],
            "fit-csv": ["fit", *FIT_BASE, "--csv", path],
        }[command]
        rc, out, err = call(argv)
        check_refused_or_read(rc, out, err, {None, 0})
        assert stat.S_ISFIFO(os.lstat(tmp / "fifo").st_mode)  # a special file is never replaced
        if rc != 0:  # refused (or fit accepted before its search): nothing written
            assert {p: p.read_bytes() for p in tmp.rglob("*") if p.is_file()} == before


REPLAY_ENV = """
import json, os, sys
from hyperdryrun.cli import main
for env, argv in json.loads(open(sys.argv[1]).read()):
    os.environ.update(env)
    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = exc.code
    for k in env:
        del os.environ[k]
    print("rc", rc, flush=True)
"""


def test_hostile_variables_and_flags_in_a_capped_process(tmp_path):
    """Variables and flags whose values are huge (100,000 digits, a 1e400 capacity, a world of 10**30 ranks) are
    refused within a time and address-space cap, before any simulation, each on one line."""
    out = str(tmp_path / "out")
    cases = [
        (
            {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:" + "9" * 100_000},
            ["run", *TINY, "--output-dir", out],
        ),
        (
            {"WORLD_SIZE": "9" * 100_000},
            ["fit", *FIT_BASE[:2], "--gpu", "h100-80gb", "--global-batch-seqs", "8"],
        ),
        ({"HYPERDRYRUN_MAX_NESTING": "9" * 100_000 + "x"}, ["compare", str(REFERENCE), str(REFERENCE)]),
        ({}, ["run", *TINY, "--world-size", str(10**30), "--output-dir", out]),
        ({}, ["fit", *FIT_BASE, "--device-memory-gib", "1e400"]),
        ({}, ["fit", *FIT_BASE, "--peak-tflops", "1e308"]),
    ]
    cap = 3 << 30

    def capped() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS and not k.startswith("HYPERDRYRUN_MAX_")}
    env["PYTHONPATH"] = str(ROOT / "src")
    (tmp_path / "cases.json").write_text(json.dumps(cases))  # too long for an argument list
    proc = subprocess.run(
        [sys.executable, "-c", REPLAY_ENV, str(tmp_path / "cases.json")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=capped,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["rc", "2"] * len(cases), proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    assert len(lines) == len(cases) and all(line.startswith("hyperdryrun: error: ") for line in lines), lines
    assert all(len(line) < 600 for line in lines)  # no value is echoed whole
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------------------
# issue 30: the script contract, outputs over their own inputs, closed standard streams
# ---------------------------------------------------------------------------------------------------------

import hyperdryrun.runner as _runner  # noqa: E402

REAL_RUN_RANK = _runner.run_rank  # the autouse fixture stops it; the script contract needs the real step

CALLBACK_SCRIPT = """
import sys, torch
from torch import nn
F = sys.modules["__fuzz_returns__"]
def model_fn():
    return F.make("model_fn", None, None) if F.callback == "model_fn" else nn.Linear(8, 8)
def batch_fn(i, device):
    return F.make("batch_fn", None, None) if F.callback == "batch_fn" else torch.randn(2, 8, device=device)
def loss_fn(model, batch):
    return F.make("loss_fn", model, batch) if F.callback == "loss_fn" else model(batch).sum()
def optimizer_fn(params):
    return F.make("optimizer_fn", None, None) if F.callback == "optimizer_fn" else torch.optim.SGD(params, lr=0.1)
def hyperdryrun_job(launch):
    return dict(model_fn=model_fn, batch_fn=batch_fn, loss_fn=loss_fn, optimizer_fn=optimizer_fn)
"""

RETURNS = {
    "None": lambda m, b: None,
    "int": lambda m, b: 3,
    "float": lambda m, b: 1.5,
    "str": lambda m, b: "x",
    "list": lambda m, b: [1, 2],
    "dict": lambda m, b: {"a": 1},
    "tensor-vector": lambda m, b: m(b).sum(0) if m is not None else __import__("torch").ones(3),
    "tensor-int": lambda m, b: __import__("torch").ones((), dtype=__import__("torch").int64),
    "tensor-const": lambda m, b: __import__("torch").tensor(1.0),
    "the-valid-one": None,  # what the contract asks for: the step runs
}


@settings(BUDGET, max_examples=14, deadline=None, suppress_health_check=[*BUDGET.suppress_health_check,
          HealthCheck.function_scoped_fixture])  # fmt: skip
@given(
    callback=st.sampled_from(["model_fn", "batch_fn", "loss_fn", "optimizer_fn"]),
    returns=st.sampled_from(sorted(RETURNS)),
)
def test_any_callback_return_is_run_or_refused_on_one_line_naming_it(callback, returns, monkeypatch):
    """What each callback of the script contract returns: the step runs (0) only for what the contract asks, and
    anything else is exit 2 on one line naming the callback and what it returned (was exit 3, "rerun with
    --debug"). In-process (--in-process): a simulation of an 8x8 Linear, a fraction of a second each."""
    import types

    monkeypatch.setattr(_runner, "run_rank", REAL_RUN_RANK)
    fuzz = types.SimpleNamespace(callback=callback if RETURNS[returns] is not None else None)
    fuzz.make = lambda name, model, batch: RETURNS[returns](model, batch)
    monkeypatch.setitem(sys.modules, "__fuzz_returns__", fuzz)
    with scratch() as tmp:
        script = tmp / f"job_{callback}_{returns}.py".replace("-", "_")
        script.write_text(CALLBACK_SCRIPT)
        rc, out, err = call(
            ["script", str(script), "--in-process", "--quiet", "--output-dir", str(tmp / "out")]
        )
    if RETURNS[returns] is None:
        assert rc == 0, err
        return
    check_refused_or_read(rc, out, err, set())
    assert f"{callback}(" in err, err


@pytest.fixture(scope="module")
def a_report(tmp_path_factory) -> Path:
    """One real run's output directory (a process of its own: the module's fixture stops the simulation)."""
    out = tmp_path_factory.mktemp("fuzz_run") / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run(
        [sys.executable, "-m", "hyperdryrun", "run", "--model", "llama-tiny", "--seq-len", "64", "--quiet",
         "--output-dir", str(out)], env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return out


@SMALL_BUDGET
@given(
    data=st.data(),
    command=st.sampled_from(["snapshot", "report-html", "report-plot", "report-compare"]),
    target=st.sampled_from(["json", "csv"]),
    spelling=st.sampled_from(["plain", "dot", "dotdot", "absolute", "symlink", "hardlink", "double-slash"]),
)
def test_an_output_equal_to_an_input_by_any_name_is_refused_and_the_input_kept(
    data, command, target, spelling, a_report
):
    import shutil

    with scratch() as tmp:
        shutil.copytree(a_report, tmp / "out")
        g = tmp / "out" / "rank_0" / "rank_0_memory.json"
        victim = g.with_suffix(f".{target}")
        name = {
            "plain": str(victim),
            "dot": str(victim.parent / "." / victim.name),
            "dotdot": str(victim.parent / ".." / "rank_0" / victim.name),
            "absolute": os.path.abspath(victim),
            "double-slash": str(victim).replace("/rank_0/", "//rank_0//"),
            "symlink": str(tmp / f"link.{target}"),
            "hardlink": str(tmp / f"hard.{target}"),
        }[spelling]
        if spelling == "symlink":
            os.symlink(victim, name)
        if spelling == "hardlink":
            os.link(victim, name)
        given_input = (
            data.draw(st.sampled_from([str(g), str(tmp / "out")])) if command != "snapshot" else str(g)
        )
        before = {p: p.read_bytes() for p in (tmp / "out").rglob("*") if p.is_file()}
        argv = {
            "snapshot": ["snapshot", str(g), "-o", name],
            "report-html": ["report", given_input, "--html", name],
            "report-plot": [
                "report",
                given_input,
                "--html",
                str(tmp / "page.html"),
                "--plot",
                str(victim.parent),
            ],
            "report-compare": ["report", str(REFERENCE), "--compare", str(g), "--html", name],
        }[command]
        rc, out, err = call(argv)
        if command == "report-plot":  # PNGs beside the reports: another name, allowed (or matplotlib missing)
            check_refused_or_read(rc, out, err, {0})
        else:
            check_refused_or_read(rc, out, err, set())
            assert "is an input of this command" in err, err
        assert {p: p.read_bytes() for p in (tmp / "out").rglob("*") if p.is_file() and p in before} == before


STREAM_COMMANDS = {
    "version": ["--version"],
    "help": ["run", "--help"],
    "bad-input": ["run", "--model", "potato"],
    "compare": ["compare", str(REFERENCE), str(REFERENCE)],
    "snapshot": ["snapshot", str(FIXTURES / "tiny_step.trace.json.gz"), "-o", "s.pickle"],
}


@settings(BUDGET, max_examples=8, deadline=None)
@given(
    command=st.sampled_from(sorted(STREAM_COMMANDS)),
    redirect=st.sampled_from([">&-", "2>&-", "<&-", ">/dev/full", "2>/dev/full", ">&- 2>&-"]),
)
def test_closed_or_full_standard_streams_keep_the_exit_code(command, redirect):
    """Issue 30, item 8: a closed stream is /dev/null (the exit code is the command's own); a full stdout is one
    line, exit 2; a full or closed stderr never changes the exit code. Never a traceback."""
    import shlex

    argv = STREAM_COMMANDS[command]
    expected = 2 if command == "bad-input" else 0
    if ">/dev/full" in redirect.split() and command not in ("bad-input",):
        expected = 2  # what it printed was lost
    if command == "snapshot" and ">/dev/full" in redirect.split():
        expected = 2
    with scratch() as tmp:
        line = " ".join(map(shlex.quote, [sys.executable, "-m", "hyperdryrun", *argv])) + " " + redirect
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
        proc = subprocess.run(
            ["bash", "-c", line], cwd=tmp, env=env, capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == expected, (redirect, proc.stderr)
        assert "Traceback" not in proc.stderr
        assert proc.stderr.count("\n") <= 1
        assert not any(p.name.isdigit() for p in tmp.iterdir())
