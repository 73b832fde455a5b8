"""Exit codes as a contract, in real processes: 0 done, 1 the verdict failed and nothing else, 2 bad input, 3 an
internal error (one line, the report path when one was written, how to see the traceback)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "ingest" / "fixtures"
TRACE, SNAPSHOT = FIXTURES / "tiny_step.trace.json.gz", FIXTURES / "tiny.snapshot.pickle"
TINY = ["--model", "llama-tiny", "--seq-len", "32", "--world-size", "2"]

DRIVER = """
import sys
{patch}
from hyperdryrun.cli import main
sys.exit(main(sys.argv[1:]))
"""

INJECT = """
import {module} as target
def injected(*args, **kwargs):
    raise RuntimeError("injected fault")
target.{name} = injected
"""


def hyperdryrun(argv: list[str], cwd: Path, patch: str = "") -> subprocess.CompletedProcess:
    """``hyperdryrun <argv>`` in a child interpreter, after ``patch`` ran there."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-c", DRIVER.format(patch=patch), *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def inject(module: str, name: str) -> str:
    return INJECT.format(module=module, name=name)


def one_line(err: str) -> str:
    assert err.endswith("\n") and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("hyperdryrun: error: "), err
    return err


def files_under(root: Path) -> set[str]:
    return (
        {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()} if root.exists() else set()
    )


@pytest.mark.parametrize(
    ("command", "module", "name"),
    [
        (["run", *TINY], "hyperdryrun.recipe", "run_job"),
        (["measure", *TINY, "--target-device", "cpu"], "hyperdryrun.measure", "measure_job"),
        (["compare", str(TRACE), str(TRACE)], "hyperdryrun.commands.compare", "compare"),
    ],
    ids=["run", "measure", "compare"],
)
def test_an_internal_error_exits_3_on_one_line_not_1(tmp_path, command, module, name):
    out = tmp_path / "out"
    argv = [*command, "--output-dir", str(out)] if command[0] != "compare" else command
    proc = hyperdryrun(argv, tmp_path, inject(module, name))
    assert proc.returncode == 3, proc.stderr
    err = one_line(proc.stderr)
    assert "RuntimeError: injected fault" in err and err.endswith("rerun with --debug for the traceback\n")
    assert proc.stdout == "" and files_under(out) == set()


def test_debug_shows_the_traceback_of_an_internal_error(tmp_path):
    proc = hyperdryrun(["run", *TINY, "--debug"], tmp_path, inject("hyperdryrun.recipe", "run_job"))
    assert proc.returncode == 3
    assert proc.stderr.startswith("Traceback") and "in injected" in proc.stderr
    assert proc.stderr.splitlines()[-1] == "hyperdryrun: error: RuntimeError: injected fault"


def test_a_failure_inside_the_simulation_is_internal_and_names_its_report(tmp_path):
    out = tmp_path / "out"
    patch = """
import hyperdryrun.recipe as recipe
def boom(model, mesh):
    raise RuntimeError("boom")
recipe.parallelize = lambda cfg: boom
"""
    proc = hyperdryrun(["run", *TINY, "--output-dir", str(out)], tmp_path, patch)
    report = out / "rank_0" / "rank_0_memory.json"
    assert proc.returncode == 3, proc.stderr
    assert one_line(proc.stderr) == (
        f"hyperdryrun: error: rank 0: parallelize failed: RuntimeError: boom (report: {report}); "
        "internal error: rerun with --debug for the traceback\n"
    )
    assert files_under(out) == {"rank_0/rank_0_memory.json"}
    assert json.loads(report.read_text())["stage"] == "parallelize"


def test_a_rank_that_fails_on_bad_input_in_a_worker_exits_2(tmp_path):
    # a value rule that does not fit the model (3 counts for 4 experts) is refused inside each rank's step
    job = tmp_path / "job.yaml"
    rule = {"module": "layers.1.*", "op": "moe.token_counts", "handler": "explicit", "counts": [1, 2, 3]}
    job.write_text(json.dumps({"values": {"rules": [rule]}}))
    out = tmp_path / "out"
    argv = [
        "run",
        "--config",
        str(job),
        "--model",
        "moe-tiny",
        "--world-size",
        "2",
        "--ep",
        "2",
        "--seq-len",
        "8",
    ]
    proc = hyperdryrun([*argv, "--ranks", "0,1", "--output-dir", str(out)], tmp_path)
    assert proc.returncode == 2, proc.stderr
    err = one_line(proc.stderr)
    assert (
        "routing rule counts=[1, 2, 3] must have 4 entries" in err and "(and 1 more of 2 ranks failed)" in err
    )
    assert "rerun with --debug" not in err
    assert files_under(out) == set()  # bad input writes no error report (an earlier good one would stay)


@pytest.mark.parametrize(
    ("argv", "code"),
    [
        (["compare", str(TRACE), str(TRACE)], 0),
        (["compare", str(TRACE), str(SNAPSHOT)], 1),  # peaks 17,712 B vs 14,681,088 B: outside 1%
        (["compare", str(TRACE), "missing.json"], 2),
        (["compare", str(TRACE), str(TRACE), "--tolerance", "-1"], 2),
    ],
    ids=["within", "outside", "missing-file", "bad-tolerance"],
)
def test_compare_exit_codes(tmp_path, argv, code):
    proc = hyperdryrun(argv, tmp_path)
    assert proc.returncode == code, proc.stderr
    if code == 2:
        one_line(proc.stderr)


def test_a_bad_flag_value_is_2_and_an_oom_is_1(tmp_path):
    bad = hyperdryrun(["run", *TINY, "--seq-len", "0"], tmp_path)
    assert bad.returncode == 2 and "training.seq_len (--seq-len)" in one_line(bad.stderr)
    oom = hyperdryrun(["run", *TINY, "--device-memory-gib", "0.0001", "--quiet"], tmp_path)
    assert oom.returncode == 1 and "OOM" in oom.stdout and oom.stderr == ""


def outcome(rank: int, error: str | None = None, kind: str | None = None, oom: bool = False):
    from hyperdryrun.runner import RankOutcome

    report = {} if error else {"status": "ok", "summary": {"oom": oom}}
    return RankOutcome(
        rank, report, error=error, error_kind=kind, traceback="Traceback ...\n" if error else None
    )


@pytest.mark.parametrize(
    ("ranks", "code", "line"),
    [
        ([outcome(0), outcome(1)], 0, ""),
        ([outcome(0), outcome(1, oom=True)], 1, ""),
        ([outcome(0, oom=True), outcome(1, "rank 1: bad", "bad input")], 2, "rank 1: bad"),
        (
            [
                outcome(0, "rank 0: bad", "bad input"),
                outcome(1, "rank 1: bug", "internal"),
                outcome(2, oom=True),
            ],
            3,
            "rank 1: bug (and 1 more of 3 ranks failed); internal error: rerun with --debug for the traceback",
        ),
    ],
    ids=["done", "one-oom", "bad-input-beats-oom", "internal-beats-bad-input"],
)
def test_a_failure_beats_a_verdict_and_internal_beats_bad_input(ranks, code, line, capsys):
    from hyperdryrun.commands import exit_code_of

    assert exit_code_of(ranks) == code
    err = capsys.readouterr().err
    assert err == (f"hyperdryrun: error: {line}\n" if line else "")


REPORT_JSON = "out/rank_0/rank_0_memory.json"


@pytest.mark.parametrize(
    "argv",
    [
        ["compare", str(TRACE), str(TRACE)],
        ["compare", str(TRACE), str(TRACE), "--json"],
        ["snapshot", str(TRACE), "-o", "s.pickle"],
        ["report", str(TRACE), "--html", "page.html"],
        ["audit-kernels"],
        ["run", *TINY, "--output-dir", "out"],
        ["run", *TINY, "--ranks", "0,1", "--jobs", "2", "--output-dir", "out"],
        [
            "fit",
            "--model",
            "llama-tiny",
            "--seq-len",
            "32",
            "--world-size",
            "2",
            "--gpu",
            "h100-80gb",
            "--global-batch-seqs",
            "4",
            "--no-cache",
            "--tp",
            "1",
            "--pp",
            "1",
            "--jobs",
            "1",
        ],  # fmt: skip
        ["run", "--help"],
    ],
    ids=["compare", "compare-json", "snapshot", "report", "audit-kernels", "run", "run-ranks", "fit", "help"],
)
def test_a_closed_stdout_exits_141_silently(tmp_path, argv):
    """``hyperdryrun ... | head -1`` (issue 23): the reader has gone before the first line is written (its end of the
    pipe closed at once), so every write fails with EPIPE; the exit code is 141 as a shell reports SIGPIPE, never 1
    (rich's own broken-pipe handler exits 1, the code of a failed verdict), with nothing on stderr."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    proc = subprocess.Popen(
        [sys.executable, "-c", DRIVER.format(patch=""), *argv],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 141, err
    assert err == ""
