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
import subprocess
import sys
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hyperdryrun.cli import main
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


class Accepted(BaseException):
    """Raised instead of simulating: the job file was valid (a BaseException, so no handler of the CLI eats it)."""


@pytest.fixture(autouse=True)
def _no_simulation(monkeypatch):
    """``run`` validates, then would simulate: stop it there; and no ambient identity or limit."""
    import hyperdryrun.runner as runner

    def accepted(*args: Any, **kwargs: Any) -> Any:
        raise Accepted

    monkeypatch.setattr(runner, "run_rank", accepted)
    monkeypatch.setattr(runner, "run_ranks", accepted)
    for var in list(os.environ):
        if var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE") or var.startswith(
            "HYPERDRYRUN_MAX_"
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
