"""The command line: validation errors are one line, name the field and value, and write nothing;
successful runs write exactly the rank's two report files; failures inside the simulation write an error report.
"""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hyperdryrun.cli import main
from tests.conftest import cli

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
GIB = 2**30


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch, tmp_path):
    """No ambient torchrun identity, and a scratch cwd so a default output dir could not land in the repo."""
    for var in TORCHRUN_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)


def run_cli(argv, capsys):
    """``hyperdryrun run <argv>`` in-process: (exit code, stdout, stderr)."""
    return cli(["run", *argv], capsys)


def files_under(root: Path) -> set[str]:
    if not root.exists():
        return set()
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


def assert_one_line(err: str) -> None:
    assert err.endswith("\n"), repr(err)
    assert err.count("\n") == 1, repr(err)
    assert "Traceback" not in err
    assert err.startswith("hyperdryrun: error: "), repr(err)


def assert_nothing_written(tmp_path: Path, out_dir: Path) -> None:
    assert not out_dir.exists(), sorted(files_under(out_dir))
    assert list(tmp_path.rglob("*.tmp")) == []
    assert list(tmp_path.rglob(".*.tmp")) == []


def read_report(out_dir: Path, rank: int = 0) -> dict:
    return json.loads((out_dir / f"rank_{rank}" / f"rank_{rank}_memory.json").read_text())


# ---------------------------------------------------------------------------------------------------------
# Bad inputs: one parametrized case each. Each is (extra argv, env, YAML text or None, expected substrings).
# "{cfg}" in argv / expected is replaced by the config path, "{dir}" by a directory that exists.
# ---------------------------------------------------------------------------------------------------------

BAD_INPUTS = {
    "yaml-unknown-key": (
        ["--config", "{cfg}"],
        {},
        "training: {sq_len: 5}\n",
        ["training.sq_len", "Extra inputs are not permitted", "(got 5)"],
    ),
    "yaml-wrong-type": (
        ["--config", "{cfg}"],
        {},
        'training: {seq_len: "abc"}\n',
        ["training.seq_len", "--seq-len", "(got 'abc')"],
    ),
    "yaml-not-a-mapping": (
        ["--config", "{cfg}"],
        {},
        "- a\n- b\n",
        ["--config", "{cfg}", "must hold a mapping", "got list"],
    ),
    "yaml-invalid-syntax": (
        ["--config", "{cfg}"],
        {},
        "training: [\n",
        ["--config", "{cfg}", "is not valid YAML"],
    ),
    "config-missing": (
        ["--config", "{dir}/does-not-exist.yaml"],
        {},
        None,
        ["--config", "cannot read", "{dir}/does-not-exist.yaml", "No such file or directory"],
    ),
    "config-is-a-directory": (
        ["--config", "{dir}"],
        {},
        None,
        ["--config", "cannot read", "{dir}", "Is a directory"],
    ),
    "seq-len-zero": (["--seq-len", "0"], {}, None, ["training.seq_len (--seq-len)", "(got 0)"]),
    "seq-len-not-int": (["--seq-len", "abc"], {}, None, ["--seq-len", "'abc'"]),
    "micro-batch-negative": (
        ["--micro-batch-size", "-1"],
        {},
        None,
        ["training.micro_batch_size (--micro-batch-size)", "(got -1)"],
    ),
    "tp-zero": (["--tp", "0"], {}, None, ["parallel.tp (--tp)", "(got 0)"]),
    "heads-not-divisible-by-tp": (
        ["--world-size", "8", "--tp", "8"],
        {},
        None,
        ["model.n_heads=4", "parallel.tp=8"],
    ),
    "kv-heads-not-divisible-by-tp": (
        # llama-tiny: 4 heads (divisible by 4), 2 kv heads (not)
        ["--world-size", "4", "--tp", "4"],
        {},
        None,
        ["model.n_kv_heads=2", "parallel.tp=4"],
    ),
    "world-size-not-product": (
        ["--world-size", "4", "--dp-shard", "3"],
        {},
        None,
        ["world.world_size=4", "1*3*1*1*1 = 3"],
    ),
    "world-size-zero": (["--world-size", "0"], {}, None, ["world.world_size (--world-size)", "(got 0)"]),
    "cp-seq-not-load-balanced": (
        ["--world-size", "2", "--cp", "2", "--seq-len", "66"],
        {},
        None,
        ["training.seq_len=66", "2*parallel.cp=4"],
    ),
    "pp-unknown-schedule": (
        ["--world-size", "2", "--pp", "2", "--pp-schedule", "2F2B"],
        {},
        None,
        ["parallel.pp_schedule (--pp-schedule)", "(got '2F2B')"],
    ),
    "ep-on-dense-model": (["--ep", "2"], {}, None, ["parallel.ep=2", "needs an MoE model"]),
    "unknown-model": (["--model", "nope"], {}, None, ["model.name (--model)", "'nope'", "llama-tiny"]),
    "ac-bogus": (["--ac", "bogus"], {}, None, ["training.ac (--ac)", "(got 'bogus')"]),
    "ac-selective-too-large": (
        ["--ac", "selective", "--ac-selective", "5"],
        {},
        None,
        ["training.ac_selective=5", "model.n_layers=2"],
    ),
    "device-memory-zero": (
        ["--device-memory-gib", "0"],
        {},
        None,
        ["device_memory_gib (--device-memory-gib)", "(got 0.0)"],
    ),
    "rank-ge-world-size": (["--world-size", "2", "--rank", "2"], {}, None, ["rank=2", "world_size=2"]),
    "rank-negative": (["--world-size", "2", "--rank", "-1"], {}, None, ["world.rank (--rank)", "(got -1)"]),
    "env-world-size-zero": ([], {"WORLD_SIZE": "0"}, None, ["WORLD_SIZE=0", ">= 1"]),
    "env-rank-ge-world-size": ([], {"RANK": "5", "WORLD_SIZE": "4"}, None, ["RANK=5", "WORLD_SIZE=4"]),
    "env-local-rank-negative": ([], {"LOCAL_RANK": "-1"}, None, ["LOCAL_RANK=-1", ">= 0"]),
    "env-rank-not-int": ([], {"RANK": "abc"}, None, ["RANK='abc'", "not an integer"]),
}


def _materialise(case, tmp_path):
    argv, env, yaml_text, expected = case
    cfg_dir = tmp_path / "cfg"
    cfg_dir.mkdir()
    cfg = cfg_dir / "job.yaml"
    if yaml_text is not None:
        cfg.write_text(yaml_text)

    def sub(s: str) -> str:
        return s.replace("{cfg}", str(cfg)).replace("{dir}", str(cfg_dir))

    return [sub(a) for a in argv], env, [sub(e) for e in expected]


@pytest.mark.parametrize("case", list(BAD_INPUTS.values()), ids=list(BAD_INPUTS))
def test_bad_input_is_one_line_error_and_writes_nothing(case, tmp_path, capsys, monkeypatch):
    argv, env, expected = _materialise(case, tmp_path)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    out_dir = tmp_path / "out"
    # llama-tiny unless the case picks the model itself; small sizes so a missed error would finish fast
    base = [] if "--model" in argv else ["--model", "llama-tiny"]
    if "--seq-len" not in argv and "--config" not in argv:
        base += ["--seq-len", "32"]
    rc, _out, err = run_cli([*base, *argv, "--output-dir", str(out_dir)], capsys)
    assert rc == 2
    assert_one_line(err)
    for needle in expected:
        assert needle in err, (needle, err)
    assert_nothing_written(tmp_path, out_dir)


def test_debug_shows_traceback_on_bad_input(tmp_path, capsys):
    out_dir = tmp_path / "out"
    rc, _out, err = run_cli(
        ["--model", "llama-tiny", "--tp", "0", "--output-dir", str(out_dir), "--debug"], capsys
    )
    assert rc == 2
    assert "Traceback" in err
    assert err.rstrip("\n").splitlines()[-1].startswith("hyperdryrun: error: parallel.tp (--tp)")
    assert_nothing_written(tmp_path, out_dir)


def _subprocess_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = os.pathsep.join([src, env["PYTHONPATH"]]) if env.get("PYTHONPATH") else src
    env.update(extra)
    return env


@pytest.mark.parametrize(
    ("argv", "env", "needles"),
    [
        (["--tp", "0"], {}, ["parallel.tp (--tp)", "(got 0)"]),
        ([], {"RANK": "5", "WORLD_SIZE": "4"}, ["RANK=5", "WORLD_SIZE=4"]),
    ],
    ids=["flag", "torchrun-env"],
)
def test_real_process_exit_code_and_one_line_stderr(argv, env, needles, tmp_path):
    out_dir = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "hyperdryrun.cli",
            "run",
            "--model",
            "llama-tiny",
            *argv,
            "--output-dir",
            str(out_dir),
        ],
        cwd=tmp_path,
        env=_subprocess_env(env),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert_one_line(proc.stderr)
    for needle in needles:
        assert needle in proc.stderr
    assert proc.stdout == ""
    assert_nothing_written(tmp_path, out_dir)


# ---------------------------------------------------------------------------------------------------------
# Successful runs (each one real simulation of llama-tiny).
# ---------------------------------------------------------------------------------------------------------


def test_successful_run_writes_exactly_the_rank_files(tmp_path, capsys):
    out_dir = tmp_path / "out"
    rc, _out, err = run_cli(
        ["--model", "llama-tiny", "--world-size", "2", "--seq-len", "32", "--output-dir", str(out_dir)],
        capsys,
    )
    assert rc == 0, err
    assert "Traceback" not in err
    assert files_under(out_dir) == {
        "rank_0/rank_0_memory.json",
        "rank_0/rank_0_memory.csv",
        "rank_0/rank_0_segments.csv",  # a CUDA target: the caching allocator's segments
    }
    assert list(tmp_path.rglob("*.tmp")) == []
    report = read_report(out_dir)
    assert report["status"] == "ok"
    meta = report["metadata"]
    assert (meta["model"], meta["world_size"], meta["rank"], meta["seq_len"]) == ("llama-tiny", 2, 0, 32)
    assert meta["batch_shapes"]["tokens"] == [1, 32]
    assert meta["parallel"]["dp_shard"] == 2  # what the world leaves with tp=1
    s = report["summary"]
    assert s["peak_bytes"] > 0
    # no --device-memory-gib: no capacity verdict at all
    for key in ("capacity_bytes", "headroom_bytes", "oom", "verdict"):
        assert key not in s
    rows = list(csv.reader(io.StringIO((out_dir / "rank_0" / "rank_0_memory.csv").read_text())))
    assert len(rows) - 1 == s["num_blocks"]


def test_flags_override_yaml(tmp_path, capsys):
    cfg = tmp_path / "job.yaml"
    cfg.write_text("model: {name: llama-tiny}\nworld: {world_size: 2}\ntraining: {seq_len: 32}\n")
    out_dir = tmp_path / "out"
    rc, _out, err = run_cli(["--config", str(cfg), "--seq-len", "64", "--output-dir", str(out_dir)], capsys)
    assert rc == 0, err
    meta = read_report(out_dir)["metadata"]
    assert meta["seq_len"] == 64  # the flag wins
    assert meta["batch_shapes"]["tokens"] == [1, 64]
    assert meta["model"] == "llama-tiny"  # the file still applies where no flag is given
    assert meta["world_size"] == 2


def test_torchrun_env_gives_rank_when_no_rank_flag(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    out_dir = tmp_path / "out"
    rc, _out, err = run_cli(
        ["--model", "llama-tiny", "--seq-len", "32", "--output-dir", str(out_dir)], capsys
    )
    assert rc == 0, err
    assert files_under(out_dir) == {
        "rank_1/rank_1_memory.json",
        "rank_1/rank_1_memory.csv",
        "rank_1/rank_1_segments.csv",
    }
    meta = read_report(out_dir, rank=1)["metadata"]
    assert meta["rank"] == 1
    assert meta["world_size"] == 2
    assert meta["local_rank"] == 1  # no LOCAL_RANK: the rank


def test_tiny_device_memory_is_oom_and_exit_1(tmp_path, capsys):
    out_dir = tmp_path / "out"
    rc, out, err = run_cli(
        [
            "--model",
            "llama-tiny",
            "--seq-len",
            "32",
            "--device-memory-gib",
            "0.0001",
            "--output-dir",
            str(out_dir),
            "--quiet",
        ],
        capsys,
    )
    assert rc == 1, err
    s = read_report(out_dir)["summary"]
    assert s["oom"] is True
    assert s["capacity_bytes"] == 107374  # round(0.0001 * 2**30) = round(107374.1824)
    assert s["headroom_bytes"] == 107374 - s["peak_device_bytes"]  # a CUDA target is judged on device bytes
    assert s["headroom_bytes"] < 0
    assert s["verdict"].startswith("OOM")
    assert "OOM" in out
    # --quiet's one line gives a small model's peak in MiB (bytes / 2**20, two decimals), not "0.00 GiB"
    assert s["peak_bytes"] < 2**30 // 10
    assert out.startswith(f"peak {s['peak_bytes'] / 2**20:,.2f} MiB ({s['peak_phase']}); OOM")


def test_large_device_memory_fits_and_exit_0(tmp_path, capsys):
    out_dir = tmp_path / "out"
    rc, _out, err = run_cli(
        [
            "--model",
            "llama-tiny",
            "--seq-len",
            "32",
            "--device-memory-gib",
            "80",
            "--output-dir",
            str(out_dir),
            "--quiet",
        ],
        capsys,
    )
    assert rc == 0, err
    s = read_report(out_dir)["summary"]
    assert s["oom"] is False
    assert s["capacity_bytes"] == 80 * GIB == 85_899_345_920
    assert s["headroom_bytes"] == s["capacity_bytes"] - s["peak_device_bytes"]
    assert 0 < s["headroom_bytes"] < s["capacity_bytes"]
    assert s["verdict"].startswith("fits")


# ---------------------------------------------------------------------------------------------------------
# A failure inside the simulation.
# ---------------------------------------------------------------------------------------------------------


def test_error_during_simulation_writes_error_report(tmp_path, capsys, monkeypatch):
    import hyperdryrun.recipe as recipe

    def boom(model, mesh):
        raise RuntimeError("boom")

    # run_job takes the model family's parallelize function through recipe.parallelize (a module global)
    monkeypatch.setattr(recipe, "parallelize", lambda cfg: boom)
    out_dir = tmp_path / "out"
    rc, _out, err = run_cli(
        ["--model", "llama-tiny", "--world-size", "2", "--seq-len", "32", "--output-dir", str(out_dir)],
        capsys,
    )
    assert rc not in (0, 1)  # 1 means OOM
    assert_one_line(err)
    assert "boom" in err
    assert "parallelize" in err
    assert files_under(out_dir) == {"rank_0/rank_0_memory.json"}
    report = read_report(out_dir)
    assert report["status"] == "error"
    assert report["stage"] == "parallelize"
    assert report["error"]["type"] == "RuntimeError"
    assert "boom" in report["error"]["message"]
    assert report["metadata"]["seq_len"] == 32
    assert not (out_dir / "rank_0" / "rank_0_memory.csv").exists()
    assert list(tmp_path.rglob("*.tmp")) == []


# ---------------------------------------------------------------------------------------------------------
# Malformed sections, non-finite values and unwritable outputs.
# ---------------------------------------------------------------------------------------------------------


def test_yaml_world_section_not_a_mapping_is_rejected(tmp_path, capsys):
    cfg = tmp_path / "job.yaml"
    cfg.write_text("world: 5\n")
    out_dir = tmp_path / "out"
    rc, _out, err = run_cli(
        ["--config", str(cfg), "--model", "llama-tiny", "--seq-len", "32", "--output-dir", str(out_dir)],
        capsys,
    )
    assert rc == 2
    assert_one_line(err)
    assert "world" in err and "5" in err
    assert_nothing_written(tmp_path, out_dir)


def test_yaml_section_not_a_mapping_with_flag_is_one_line_error(tmp_path, capsys):
    cfg = tmp_path / "job.yaml"
    cfg.write_text("training: 5\n")
    out_dir = tmp_path / "out"
    rc, _out, err = run_cli(
        ["--config", str(cfg), "--model", "llama-tiny", "--seq-len", "32", "--output-dir", str(out_dir)],
        capsys,
    )
    assert rc == 2
    assert_one_line(err)
    assert "training" in err and "5" in err
    assert_nothing_written(tmp_path, out_dir)


def test_infinite_device_memory_is_one_line_error(tmp_path, capsys):
    out_dir = tmp_path / "out"
    rc, _out, err = run_cli(
        [
            "--model",
            "llama-tiny",
            "--seq-len",
            "32",
            "--device-memory-gib",
            "inf",
            "--output-dir",
            str(out_dir),
        ],
        capsys,
    )
    assert rc == 2
    assert_one_line(err)
    assert "device_memory_gib" in err and "inf" in err
    assert_nothing_written(tmp_path, out_dir)


def test_unwritable_output_dir_is_one_line_error(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n")
    rc, _out, err = run_cli(
        ["--model", "llama-tiny", "--seq-len", "32", "--output-dir", str(blocker / "out")], capsys
    )
    assert rc == 2
    assert_one_line(err)
    assert str(blocker) in err
    assert list(tmp_path.rglob("*.tmp")) == []


# ---------------------------------------------------------------------------------------------------------
# Rank identity: each field from its flag, else its torchrun variable, else the file / default.
# ---------------------------------------------------------------------------------------------------------


def identity_of(argv: list[str], environ: dict[str, str]) -> tuple[int, int, int]:
    """(world size, rank, local rank) that ``hyperdryrun run <argv>`` would simulate under ``environ``."""
    from hyperdryrun.cli import build_parser
    from hyperdryrun.commands.job import job_from_args

    args = build_parser().parse_args(["run", "--model", "llama-tiny", *argv])
    cfg = job_from_args(args, environ)
    return cfg.world.world_size, cfg.world.rank, cfg.local_rank


def identity_error(argv: list[str], environ: dict[str, str]) -> str:
    from hyperdryrun.config import ConfigError

    with pytest.raises(ConfigError) as err:
        identity_of(argv, environ)
    assert "\n" not in str(err.value)
    return str(err.value)


@pytest.mark.parametrize(
    ("argv", "environ", "identity"),
    [
        # the case: RANK from the environment, the world size from its flag
        (["--world-size", "8"], {"RANK": "5"}, (8, 5, 5)),
        # the other field from the environment, the rank from its flag
        (["--rank", "1"], {"WORLD_SIZE": "8"}, (8, 1, 1)),
        (["--local-rank", "3"], {"RANK": "7", "WORLD_SIZE": "8"}, (8, 7, 3)),
        # a flag equal to its variable is no conflict
        (["--rank", "5", "--world-size", "8"], {"RANK": "5", "WORLD_SIZE": "8"}, (8, 5, 5)),
        # torchrun's full identity: rank 5 of 8, 4 per node -> local rank 1 of 4
        ([], {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}, (8, 5, 1)),
        ([], {}, (1, 0, 0)),
    ],
)
def test_rank_identity_is_merged_field_by_field(argv, environ, identity):
    assert identity_of(argv, environ) == identity


def test_rank_identity_from_the_environment_overrides_the_file_field_by_field(tmp_path):
    cfg = tmp_path / "job.yaml"
    cfg.write_text("world: {world_size: 8, rank: 2}\n")
    assert identity_of(["--config", str(cfg)], {"RANK": "6"}) == (8, 6, 6)


@pytest.mark.parametrize(
    ("argv", "environ", "needles"),
    [
        (["--rank", "1"], {"RANK": "5", "WORLD_SIZE": "8"}, ["--rank 1", "RANK=5"]),
        (["--world-size", "4"], {"WORLD_SIZE": "8"}, ["--world-size 4", "WORLD_SIZE=8"]),
        (["--local-rank", "0"], {"LOCAL_RANK": "2"}, ["--local-rank 0", "LOCAL_RANK=2"]),
        # LOCAL_RANK must be a rank on this node
        (
            [],
            {"WORLD_SIZE": "8", "LOCAL_RANK": "4", "LOCAL_WORLD_SIZE": "4"},
            ["LOCAL_RANK=4", "LOCAL_WORLD_SIZE=4"],
        ),
        (
            ["--local-rank", "4"],
            {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"},
            ["local_rank", "4", "LOCAL_WORLD_SIZE=4"],
        ),
        ([], {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "8"}, ["LOCAL_WORLD_SIZE=8", "WORLD_SIZE=4"]),
        ([], {"LOCAL_WORLD_SIZE": "x"}, ["LOCAL_WORLD_SIZE='x'", "not an integer"]),
        # a merged rank outside the merged world names where each came from
        (["--world-size", "4"], {"RANK": "5"}, ["rank=5 (RANK)", "world_size=4 (--world-size)"]),
        ([], {"RANK": "3"}, ["rank=3 (RANK)", "world_size=1"]),
        # a local rank is a rank on one node of the world: never beyond the world
        (["--world-size", "2", "--local-rank", "999"], {}, ["local_rank=999", "world_size=2"]),
    ],
)
def test_rank_identity_conflicts_are_one_line_naming_both(argv, environ, needles):
    msg = identity_error(argv, environ)
    for needle in needles:
        assert needle in msg, (needle, msg)


def test_help_shows_each_job_flags_default_from_the_config(capsys):
    """Every job flag's help ends with its default as config.py declares it (checked against a fresh JobConfig)."""
    from hyperdryrun.commands.job import RUN_FLAGS
    from hyperdryrun.config import JobConfig

    with pytest.raises(SystemExit):
        main(["run", "--help"])
    raw = capsys.readouterr().out
    text = " ".join(raw.split())
    cfg = JobConfig()
    for flag, (path, _, _) in RUN_FLAGS.items():
        section, _, field = path.rpartition(".")
        value = getattr(getattr(cfg, section) if section else cfg, field)
        start = raw.index(f"\n  {flag}")
        entry = " ".join(raw[start : raw.find("\n  -", start + 1)].split())
        assert "default" in entry, (flag, entry)
        if path in ("training.seq_len", "training.optimizer", "output_dir", "parallel.tp", "values.skew"):
            assert f"(default: {value})" in entry, (flag, entry)
    assert "(default: 2048)" in text and "(default: hyperdryrun_out)" in text
