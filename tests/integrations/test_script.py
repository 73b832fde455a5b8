"""``hyperdryrun script``: your own training script through the command line, in a child process, with ``run``'s
reports, ranks, torchrun identity, verdict and exit codes, and ``--fit`` over the layouts the script declares."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from hyperdryrun.cli import main
from tests.doc_pages import the_block

HERE = Path(__file__).resolve().parent
JOB = str(HERE / "_script_job.py")
SEGFAULT = str(HERE / "_script_segfault.py")

# _script_job.py: 2 x Linear(256, 256) with bias in fp32, sharded evenly by FSDP2 over the shard dim of the mesh
PARAM_BYTES = 2 * (256 * 256 + 256) * 4


def optstate_bytes(shards: int) -> int:
    """AdamW's two states of each of the 4 parameter shards, each block rounded up to the CUDA caching allocator's
    512 bytes."""

    def block(nbytes: int) -> int:
        return -(-nbytes // 512) * 512

    return 2 * 2 * (block(256 * 256 * 4 // shards) + block(256 * 4 // shards))


@pytest.fixture(autouse=True)
def _no_torchrun_env(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(var, raising=False)


def readme_example() -> str:
    """The Python API example of the docs (docs/SCRIPTS_AND_API.md), whichever page holds it."""
    return the_block("python", "hyperdryrun.simulate(")[1]


EXAMPLE_PAGE = the_block("python", "hyperdryrun.simulate(")[0]


def report(out: Path, rank: int) -> dict:
    return json.loads((out / f"rank_{rank}" / f"rank_{rank}_memory.json").read_text())


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hyperdryrun: error: "), err
    assert "Traceback" not in err
    return lines[0]


def test_the_readme_example_runs_unchanged_and_gives_the_python_apis_bytes(tmp_path, monkeypatch, capsys):
    script = tmp_path / "example.py"
    script.write_text(readme_example())
    out = tmp_path / "out"
    assert (
        main(["script", str(script), "--output-dir", str(out), "--device-memory-gib", "80", "--quiet"]) == 0
    )
    assert "peak 2.95 GiB (backward); fits" in " ".join(capsys.readouterr().out.split())
    cli = report(out, 3)  # the rank of the example's own simulate() call
    # the same example through the Python API, in this process
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "readme_example"}
    exec(compile(readme_example(), str(EXAMPLE_PAGE), "exec"), namespace)
    api = json.loads((tmp_path / "my_run" / "rank_3" / "rank_3_memory.json").read_text())
    assert cli["summary"]["peak_bytes"] == namespace["trace"].peak
    assert cli["summary"] == api["summary"]  # every figure, the verdict included
    assert (cli["metadata"]["rank"], cli["metadata"]["world_size"]) == (3, 8)
    assert cli["metadata"]["script"] == {"spec": str(script), "mode": "simulate() call", "layout": {}}
    # by hand: AdamW's two states of 4 x (LayerNorm(1024) + Linear(1024, 4096) + Linear(4096, 1024)) in fp32, / 8
    params = 4 * (2 * 1024 + (1024 * 4096 + 4096) + (4096 * 1024 + 1024))
    assert cli["summary"]["breakdown_at_peak"]["Optstate"] == 2 * params * 4 // 8


@pytest.mark.parametrize("ranks", [[], ["--ranks", "0,1"]], ids=["child", "workers"])
def test_a_segfault_in_the_step_is_an_error_report_naming_the_signal(ranks, tmp_path, capsys):
    out = tmp_path / "out"
    rank_args = ranks or ["--rank", "1"]
    assert main(["script", SEGFAULT, "--world-size", "2", *rank_args, "--output-dir", str(out)]) == 3
    line = one_error_line(capsys.readouterr().err)
    assert "rank 1" in line or "rank 0" in line
    assert "killed by SIGSEGV (signal 11), a crash in native code" in line
    assert "--debug" not in line  # no Python traceback exists to show
    for rank in (1,) if not ranks else (0, 1):
        r = report(out, rank)
        assert r["status"] == "error" and r["stage"] == "simulation" and r["error"]["type"] == "ChildDied"
        assert "SIGSEGV" in r["error"]["message"]
        assert (r["metadata"]["rank"], r["metadata"]["world_size"]) == (rank, 2)
        assert sorted(p.name for p in (out / f"rank_{rank}").iterdir()) == [f"rank_{rank}_memory.json"]


def test_all_ranks_simulates_one_rank_per_declared_class_under_torchrun_identity(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "2")  # torchrun's rank of this process; --all-ranks simulates every class
    out = tmp_path / "out"
    assert main(["script", JOB, "--all-ranks", "--no-stacks", "--output-dir", str(out)]) == 0
    classes = json.loads((out / "rank_classes.json").read_text())
    assert classes["rank_class"] == [0, 1, 1, 1]
    assert [(c["representative"], c["ranks"]) for c in classes["classes"]] == [(0, "0"), (1, "1-3")]
    assert sorted(p.name for p in out.iterdir()) == ["rank_0", "rank_1", "rank_classes.json"]
    for rank in (0, 1):
        r = report(out, rank)
        md = r["metadata"]
        assert (md["rank"], md["world_size"], md["mesh_shape"]) == (rank, 4, [1, 4])
        assert (md["env_rank"], md["env_world_size"]) == (
            str(rank),
            "4",
        )  # RANK/WORLD_SIZE as torchrun sets them
        assert r["summary"]["breakdown_at_peak"]["Optstate"] == optstate_bytes(4)
    assert "2 rank classes cover all 4 ranks" in capsys.readouterr().out


def test_torchrun_variables_give_the_rank_and_a_contradicting_flag_is_an_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    out = tmp_path / "out"
    argv = ["script", JOB, "--no-stacks", "--output-dir", str(out), "--gpu", "h100-80gb", "--quiet"]
    assert main(argv) == 0
    r = report(out, 1)
    assert (r["metadata"]["rank"], r["metadata"]["env_rank"], r["metadata"]["world_size"]) == (1, "1", 2)
    # --gpu's capacity: torch's total_memory of an H100 80GB, 81,009 MiB ("79.11 GiB" in torch's OOM message)
    assert r["summary"]["capacity_bytes"] == 81_009 * 2**20 and r["summary"]["oom"] is False
    assert main([*argv, "--rank", "0"]) == 2
    assert "--rank 0 conflicts with RANK=1" in one_error_line(capsys.readouterr().err)


def test_fit_tries_the_declared_layouts_in_order_and_chooses_the_first_that_fits(tmp_path, capsys):
    out = tmp_path / "out"
    # layout 0: micro batches of 2**20 rows x 256 fp32 = 1 GiB per activation, over a 2 GiB card; layout 1: 64 rows
    argv = ["script", JOB, "--fit", "--world-size", "2", "--device-memory-gib", "2", "--no-stacks"]
    assert main([*argv, "--output-dir", str(out), "--jobs", "2"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "chosen: layout 1 (rows=64 replicate=2), the first declared that fits" in text
    big, small = report(out / "layout_0", 0), report(out / "layout_1", 0)
    assert big["summary"]["oom"] is True and small["summary"]["oom"] is False
    assert big["metadata"]["script"]["layout"] == {"rows": 1 << 20}
    assert small["metadata"]["mesh_shape"] == [2, 1]  # replicate=2: each rank holds the whole model
    assert small["summary"]["breakdown_at_peak"]["Optstate"] == optstate_bytes(1) == 2 * PARAM_BYTES
    assert big["summary"]["peak_bytes"] > 2 * 2**30 > small["summary"]["peak_bytes"]


def test_fit_does_not_choose_a_layout_that_is_only_at_risk(tmp_path, capsys):
    # the same layouts with a margin of 1.99 GiB under the 2 GiB card: layout 1's device peak (its CUDA context
    # alone is 840 MiB) lies within the margin, so it is at risk, which run's verdict fails (exit 1), not a fit
    argv = ["script", JOB, "--fit", "--world-size", "2", "--device-memory-gib", "2", "--margin-gib", "1.99"]
    assert main([*argv, "--no-stacks", "--output-dir", str(tmp_path / "out")]) == 1
    text = " ".join(capsys.readouterr().out.split())
    assert "at risk" in text and "no declared layout fits" in text and "(chosen)" not in text


def test_fit_needs_a_capacity_and_declared_layouts(tmp_path, capsys):
    assert main(["script", JOB, "--fit", "--output-dir", str(tmp_path)]) == 2
    assert "--fit needs a capacity" in one_error_line(capsys.readouterr().err)
    script = tmp_path / "example.py"
    script.write_text(readme_example())
    assert main(["script", str(script), "--fit", "--gpu", "h100-80gb", "--output-dir", str(tmp_path)]) == 2
    assert "declares no layouts: --fit needs a function hyperdryrun_layouts" in one_error_line(
        capsys.readouterr().err
    )


BAD = {
    "no_function.py": ("x = 1\n", "has no function 'hyperdryrun_job' and calls no hyperdryrun.simulate()"),
    "raises.py": (
        "def hyperdryrun_job(launch):\n    raise ValueError('no data at /mnt/x')\n",
        "hyperdryrun_job(launch) of '{path}' raised ValueError: no data at /mnt/x (raises.py:2)",
    ),
    "import_raises.py": ("import no_such_module_here\n", "raised ModuleNotFoundError"),
    "not_a_dict.py": ("def hyperdryrun_job(launch):\n    return [1]\n", "returned a list, not a dict"),
    "unknown_key.py": (
        "def hyperdryrun_job(launch):\n    return {'model_fn': int, 'batch_fn': int, 'loss_fn': int, 'lr': 1}\n",
        "gives an unknown argument 'lr'",
    ),
    "no_loss.py": (
        "def hyperdryrun_job(launch):\n    return {'model_fn': int, 'batch_fn': int}\n",
        "must give exactly one of loss_fn or step_fn",
    ),
    "wrong_world.py": (
        "def hyperdryrun_job(launch):\n    return {'model_fn': int, 'batch_fn': int, 'loss_fn': int, 'world_size': 8}\n",
        "returned world_size=8, but the launch is world_size=1",
    ),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_script_that_gives_no_job_is_one_line_exit_2(name, tmp_path, capsys):
    import hyperdryrun
    import hyperdryrun.engine

    source, expected = BAD[name]
    path = tmp_path / name
    path.write_text(source)
    # in this process, so that the globals the loading touches are checked too
    assert main(["script", str(path), "--in-process", "--output-dir", str(tmp_path / "out")]) == 2
    assert expected.format(path=path) in one_error_line(capsys.readouterr().err)
    assert hyperdryrun.simulate is hyperdryrun.engine.simulate and "RANK" not in os.environ
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("missing.py", "script: no such file 'missing.py'"),
        ("no_such_package_xyz.train:job", "script: no module named 'no_such_package_xyz'"),
        (f"{JOB}:make_job", "has no function 'make_job'"),
    ],
)
def test_a_missing_file_module_or_function_is_one_line_exit_2(spec, expected, tmp_path, capsys):
    assert (
        main(["script", spec, "--output-dir", str(tmp_path / "out")]) == 2
    )  # in the child, as a user runs it
    assert expected in one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "out").exists()


def test_a_module_function_spec_runs_the_named_function(tmp_path, monkeypatch, capsys):
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text(
        (HERE / "_script_job.py").read_text().replace("def hyperdryrun_job(", "def make_job(")
    )
    monkeypatch.chdir(tmp_path)  # `python -m`'s sys.path: the working directory
    out = tmp_path / "out"
    assert main(["script", "mypkg.train:make_job", "--no-stacks", "--output-dir", str(out), "--quiet"]) == 0
    r = report(out, 0)
    assert (
        r["metadata"]["script"]["mode"] == "job function" and r["metadata"]["model"] == "mypkg.train:make_job"
    )
    assert r["summary"]["breakdown_at_peak"]["Optstate"] == optstate_bytes(1) == 2 * PARAM_BYTES


def test_the_scripts_own_arguments_after_a_double_dash_are_its_sys_argv(tmp_path, capsys):
    source = (HERE / "_script_job.py").read_text()
    source = source.replace(
        "import os\n",
        "import argparse\nimport os\n\nARGS = argparse.ArgumentParser().add_argument('--rows', type=int) and None\n",
    )
    # parsed at import, as a training script's own flags often are
    source = source.replace(
        "ARGS = argparse.ArgumentParser().add_argument('--rows', type=int) and None\n",
        "_parser = argparse.ArgumentParser()\n_parser.add_argument('--rows', type=int, required=True)\n"
        "ARGS = _parser.parse_args()\n",
    )
    source = source.replace(
        '"env_rank": os.environ["RANK"]', '"rows": ARGS.rows, "env_rank": os.environ["RANK"]'
    )
    path = tmp_path / "train.py"
    path.write_text(source)
    out = tmp_path / "out"
    argv = ["script", str(path), "--no-stacks", "--quiet", "--output-dir", str(out), "--", "--rows", "32"]
    assert main(argv) == 0
    assert report(out, 0)["metadata"]["rows"] == 32
    assert main(argv[:-3]) == 2  # without them its own parser exits: one line naming it
    assert "raised SystemExit: 2" in one_error_line(capsys.readouterr().err)


def test_a_script_job_within_the_margin_exits_1_like_run(tmp_path):
    # "at risk" fails the verdict as OOM does, for a script's rank as for run's: its device peak 0.5% under the
    # capacity is inside the default 1% margin
    base = ["script", JOB, "--no-stacks", "--in-process", "--quiet"]
    assert main([*base, "--device-memory-gib", "80", "--output-dir", str(tmp_path / "a")]) == 0
    peak = report(tmp_path / "a", 0)["summary"]["peak_device_bytes"]
    capacity = repr(peak * 1.005 / 2**30)
    assert main([*base, "--device-memory-gib", capacity, "--output-dir", str(tmp_path / "b")]) == 1
    assert report(tmp_path / "b", 0)["summary"]["fit"] == "at risk"
