"""The one routing option through the command line of every front door: ``run`` (built-in MoE), ``script``,
``fit`` (and ``script --fit``) take the same ``--routing``/``--skew``/``--routing-from`` flags, give the same
tokens per expert, and say which routing a fit's verdicts assume. (``torchtitan``'s: test_torchtitan_routing.py.)

Expected counts come from the definition (tests/world/test_routing.py works them by hand): 64 tokens x top 2 over
8 experts, balanced 16; ``--skew 2``: expert 0 gets 32, the other 7 share 96 = 7 x 13 + 5."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import cli

HERE = Path(__file__).resolve().parents[1] / "integrations"
SCRIPT = str(HERE / "_script_moe.py")
SKEW_2 = [32, 14, 14, 14, 14, 14, 13, 13]
RUN = ["--model", "moe-debug", "--world-size", "2", "--ep", "2", "--seq-len", "64", "--target-device", "cpu"]


@pytest.fixture(autouse=True)
def _no_torchrun_env(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(var, raising=False)


def report(out: Path, rank: int = 0) -> dict:
    return json.loads((out / f"rank_{rank}" / f"rank_{rank}_memory.json").read_text())


def test_run_skew_2_gives_the_busiest_expert_twice_the_balanced_load(tmp_path, capsys):
    rc, _, err = cli(
        ["run", *RUN, "--skew", "2", "--no-stacks", "--quiet", "--output-dir", str(tmp_path)], capsys
    )
    assert rc == 0, err
    moe = report(tmp_path)["metadata"]["moe"]
    assert moe["tokens_per_expert"] == SKEW_2
    assert moe["routing_line"].startswith("skew 2: in every routed layer expert 0 gets 2x the balanced load")
    # EP rank 0 holds experts 0-3 and receives them from both EP ranks (all route alike)
    assert moe["tokens_received_per_moe_layer"] == 2 * (32 + 14 + 14 + 14)


def test_run_routing_from_a_file_of_torchtitan_buffers(tmp_path, capsys):
    # moe-debug: layer 0 dense, layer 1 routed; the file's layer 1 loads (summed over steps) scaled to 128 rows
    path = tmp_path / "tpe.json"
    path.write_text(json.dumps({"layers.1.moe.tokens_per_expert_E": [300, 100, 100, 100, 100, 100, 100, 0]}))
    out = tmp_path / "out"
    argv = ["run", *RUN, "--routing-from", str(path), "--no-stacks", "--quiet", "--output-dir", str(out)]
    rc, _, err = cli(argv, capsys)
    assert rc == 0, err
    # 128 x 300/900 = 42.67, 128 x 100/900 = 14.22 (x6), 0: floors 42 + 6 x 14 = 126, the 2 left by largest
    # remainder: expert 0 (.67), then expert 1 (.22, the lowest of the ties)
    assert report(out)["metadata"]["moe"]["tokens_per_expert"] == [43, 15, 14, 14, 14, 14, 14, 0]


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (
            ["--routing-from", "/nonexistent.json"],
            "values.routing_from (--routing-from): not a readable JSON file",
        ),
        (["--routing", "bound", "--skew", "3"], "values.skew=3.0 has no effect with values.routing='bound'"),
        (["--capacity-factor", "0.5"], "values.capacity_factor"),
    ],
)
def test_bad_routing_is_one_line_naming_the_flag_on_run_and_script(flags, needle, capsys):
    for argv in (["run", *RUN, *flags], ["script", SCRIPT, *flags]):
        rc, _, err = cli(argv, capsys)
        assert (
            rc == 2 and needle.split(" (")[0].split("=")[0] in err and len(err.strip().splitlines()) == 1
        ), err


def script_report(tmp_path: Path, capsys, *flags: str) -> dict:
    out = tmp_path / "_".join(flags or ("balanced",))
    rc, _, err = cli(
        ["script", SCRIPT, "--target-device", "cpu", *flags, "--quiet", "--output-dir", str(out)], capsys
    )
    assert rc == 0, err
    return report(out)


def test_script_skew_2_moves_the_peak_by_expert_0s_extra_rows(tmp_path, capsys):
    balanced, skewed = script_report(tmp_path, capsys), script_report(tmp_path, capsys, "--skew", "2")
    # expert 0: 16 rows balanced, 32 at skew 2; the script holds 1024 fp32 per row
    assert skewed["summary"]["peak_bytes"] - balanced["summary"]["peak_bytes"] == (32 - 16) * 1024 * 4
    assert skewed["metadata"]["routing"].startswith("skew 2:")
    bound = script_report(tmp_path, capsys, "--routing", "bound")  # dropless: expert 0 takes every token
    assert bound["summary"]["peak_bytes"] - balanced["summary"]["peak_bytes"] == (64 - 16) * 1024 * 4


def test_script_fit_says_which_routing_its_verdicts_assume(tmp_path, capsys):
    argv = [
        "script",
        SCRIPT,
        "--fit",
        "--world-size",
        "1",
        "--device-memory-gib",
        "1",
        "--target-device",
        "cpu",
    ]
    rc, out, err = cli([*argv, "--skew", "2", "--output-dir", str(tmp_path)], capsys)
    assert rc == 0, err
    assert (
        "MoE routing (of the layers that ask for it): skew 2: in every routed layer expert 0 gets 2x" in out
    )
    peak = json.loads((tmp_path / "layout_0" / "rank_0" / "rank_0_memory.json").read_text())["summary"]
    assert peak["peak_bytes"] == script_report(tmp_path, capsys, "--skew", "2")["summary"]["peak_bytes"]


def fit_peak(tmp_path: Path, capsys, *flags: str) -> tuple[str, dict]:
    path = tmp_path / f"fit{len(flags)}.json"
    argv = ["fit", "--model", "moe-debug", "--world-size", "2", "--seq-len", "1024", "--gpu", "h100-80gb"]
    argv += ["--tp", "1", "--pp", "1", "--ep", "2", "--micro-batch-size", "1", "--ac", "none", "--no-cache"]
    argv += ["--no-shortcut", "--global-batch-seqs", "2", "--json", str(path), *flags]
    rc, out, err = cli(argv, capsys)
    assert rc == 0, err
    [candidate] = json.loads(path.read_text())["candidates"]
    return out, candidate


def test_fit_takes_the_same_flags_and_its_title_says_the_routing(tmp_path, capsys):
    out, skewed = fit_peak(tmp_path, capsys, "--skew", "4")
    assert "MoE routing: skew 4: in every routed layer expert 0 gets 4x the balanced load" in out
    out_balanced, balanced = fit_peak(tmp_path, capsys)
    assert "MoE routing: balanced" in out_balanced
    assert (
        skewed["peak_allocated_bytes"] > balanced["peak_allocated_bytes"]
    )  # EP rank 0 receives more at skew 4
    # the verdicts are the runs' under that routing: run's peak of the same layout and routing
    for flags, candidate in (([], balanced), (["--skew", "4"], skewed)):
        run_out = tmp_path / f"run{len(flags)}"
        argv = ["run", "--model", "moe-debug", "--world-size", "2", "--ep", "2", "--seq-len", "1024", "--gpu"]
        argv += ["h100-80gb", "--no-stacks", "--quiet", "--output-dir", str(run_out), *flags]
        assert cli(argv, capsys)[0] == 0
        assert candidate["peak_allocated_bytes"] == report(run_out)["summary"]["peak_bytes"], flags


def test_the_skew_table_is_each_skews_full_run(tmp_path, capsys):
    """--skew-table's rows against a run of the rank at each skew on its own (the same peak to the byte), and the
    run it comes with is the routing given."""
    base = ["run", *RUN[:-4], "--seq-len", "512", "--gpu", "h100-80gb", "--no-stacks", "--quiet"]
    rc, out, err = cli([*base, "--skew-table", "--output-dir", str(tmp_path / "table")], capsys)
    assert rc == 0, err
    assert "peak by skew" in out
    table = json.loads((tmp_path / "table" / "skew_table.json").read_text())
    assert [r["skew"] for r in table["rows"]] == [1.0, 1.5, 2.0, 4.0] and table["hot_expert"] == 0
    assert report(tmp_path / "table")["metadata"]["moe"]["routing_line"].startswith("balanced")
    peaks = []
    for row in table["rows"]:
        alone = tmp_path / f"skew_{row['skew']:g}"
        assert cli([*base, "--skew", str(row["skew"]), "--output-dir", str(alone)], capsys)[0] == 0
        s = report(alone)["summary"]
        assert (row["peak_allocated_bytes"], row["peak_reserved_bytes"]) == (
            s["peak_allocated_bytes"], s["peak_reserved_bytes"],
        ), row  # fmt: skip
        peaks.append(s["peak_allocated_bytes"])
    assert (
        peaks == sorted(peaks) and peaks[-1] > peaks[0]
    )  # EP rank 0 holds expert 0: its peak grows with skew


def test_the_skew_table_needs_one_rank_of_a_moe_job(capsys):
    rc, _, err = cli(["run", "--model", "llama-tiny", "--skew-table"], capsys)
    assert rc == 2 and "--skew-table: 'llama-tiny' is a dense model" in err
    rc, _, err = cli(["run", *RUN, "--ranks", "0,1", "--skew-table"], capsys)
    assert rc == 2 and "--skew-table runs the one rank again at each skew" in err


def test_fits_result_cache_keys_a_routing_file_by_its_loads_not_its_name(tmp_path):
    from hyperdryrun.config import build_config
    from hyperdryrun.search.cache import job_key

    path = tmp_path / "loads.json"
    path.write_text(json.dumps([1, 1, 1, 1, 1, 1, 1, 1]))
    cfg = build_config({"model": {"name": "moe-debug"}, "values": {"routing_from": str(path)}})
    before = job_key(cfg, "run")
    assert job_key(cfg, "run") == before
    path.write_text(json.dumps([8, 1, 1, 1, 1, 1, 1, 1]))
    assert job_key(cfg, "run") != before


def test_fits_shortcut_does_not_extrapolate_layers_a_routing_file_sets_apart(tmp_path):
    from hyperdryrun.config import build_config
    from hyperdryrun.search.extrapolate import plan_for

    path = tmp_path / "loads.json"
    path.write_text(json.dumps({"layers.1.moe.tokens_per_expert_E": [8, 1, 1, 1, 1, 1, 1, 1]}))
    cfg = build_config(
        {"model": {"name": "moe-debug", "n_layers": 12}, "values": {"routing_from": str(path)}}
    )
    assert plan_for(cfg) == (None, "--routing-from gives each layer its own routing (layers differ)")


def test_hf_moe_takes_a_routing_file_per_layer(tmp_path, capsys):
    """A Hugging Face MoE model (eager experts, whose matmuls have each expert's rows) given a file of per-layer
    loads: layer 0's router counts by HF's module name, layer 1 by number."""
    from hyperdryrun.config import build_config
    from hyperdryrun.recipe import run_job

    path = tmp_path / "hf.json"
    path.write_text(json.dumps({"model.layers.0.mlp.gate": [3, 1, 1, 1, 1, 1, 1, 1], "1": [1] * 8}))
    tiny = ["--n-layers", "2", "--dim", "64", "--n-heads", "4", "--n-kv-heads", "2", "--ffn-dim", "96"]
    argv = [
        "run",
        "--model",
        "hf:mixtral-8x7b",
        *tiny,
        "--vocab-size",
        "256",
        "--experts-implementation",
        "eager",
    ]
    argv += [
        "--seq-len",
        "64",
        "--target-device",
        "cpu",
        "--routing-from",
        str(path),
        "--quiet",
        "--no-stacks",
    ]
    rc, _, err = cli([*argv, "--output-dir", str(tmp_path / "out")], capsys)
    assert rc == 0, err
    # 128 rows; layer 0: 128 x 3/10 = 38.4, 128 x 1/10 = 12.8 (x7): floors 38 + 7 x 12 = 122, the 6 left by largest
    # remainder to experts 1-6 (.8 each, above expert 0's .4); layer 1: balanced
    layer0, layer1 = [38, 13, 13, 13, 13, 13, 13, 12], [16] * 8
    moe = report(tmp_path / "out")["metadata"]["moe"]
    assert moe["tokens_per_expert_by_layer"] == {"0": layer0, "1": layer1}
    cfg = {"name": "hf:mixtral-8x7b", "n_layers": 2, "dim": 64, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 96}
    trace = run_job(
        build_config(
            {"model": {**cfg, "vocab_size": 256, "experts_implementation": "eager"}, "training": {"seq_len": 64},
             "target_device": "cpu", "values": {"routing_from": str(path)}}
        ),
        capture_stacks=False,
    )  # fmt: skip
    for layer, counts in ((0, layer0), (1, layer1)):
        # per expert, bf16 compute: gate_up tokens x 2*96 x 2 B, down tokens x 64 x 2 B (tests/models/test_hf.py)
        sizes = sorted(
            b.size
            for b in trace.blocks
            if b.module == f"model.layers.{layer}.mlp.experts" and b.op == "mm" and str(b.phase) == "forward"
        )
        assert sizes == sorted([c * 192 * 2 for c in counts] + [c * 64 * 2 for c in counts]), layer
