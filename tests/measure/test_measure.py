"""``measure``: the dry run's job executed for real; residents, categories, metadata, restored globals, CLI."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.nn.modules import module as nn_module
from torch.optim import optimizer as optim_module

import hyperdryrun
from hyperdryrun.cli import OneLineParser
from hyperdryrun.commands.measure import register
from hyperdryrun.config import build_config
from hyperdryrun.engine import SimulationError, micro_batch_step
from hyperdryrun.ingest.profiler import _call_name
from hyperdryrun.measure import measure, measure_job
from hyperdryrun.measure.step import FAKE_PG_LIMITATION, MeasureError
from hyperdryrun.recipe import batch_fn, llama_loss, model_fn
from hyperdryrun.report import CSV_COLUMNS, blocks_csv, build_report
from hyperdryrun.report.writer import to_json

F32 = 4


def cfg(**training):
    return build_config(
        {
            "model": {"name": "llama-tiny"},
            "training": {"seq_len": 32, "param_dtype": "fp32", **training},
            "target_device": "cpu",
        }
    )


def global_state():
    """Everything a measurement could leave behind in this process."""
    return (
        dist.is_initialized(),
        len(nn_module._global_forward_pre_hooks),
        len(nn_module._global_forward_hooks),
        len(optim_module._global_optimizer_pre_hooks),
        len(optim_module._global_optimizer_post_hooks),
        torch.autograd.profiler._is_profiler_enabled,
        torch.get_default_dtype(),
        torch.is_grad_enabled(),
        sys.excepthook,
    )


@pytest.fixture(scope="module")
def tiny():
    c = cfg()
    return c, measure_job(c)


def test_residents_are_parameters_buffers_and_adamw_states_by_shape(tiny):
    c, trace = tiny
    args = c.model.args()
    n = args.num_params()
    # one complex64 RoPE table (seq x head_dim/2 x 8 B) per layer (torchtitan 0.3.0)
    rope = args.n_layers * c.training.seq_len * args.head_dim * F32
    # fp32 parameters, exp_avg and exp_avg_sq, and the RoPE buffers; no gradients after zero_grad(set_to_none).
    assert trace.initial == n * F32 + 2 * n * F32 + rope


def test_at_the_optimizer_peak_every_gradient_and_state_is_live_and_categorised(tiny):
    c, trace = tiny
    n = c.model.args().num_params()
    s = build_report(trace)["summary"]
    assert s["peak_phase"] == "optimizer"
    b = s["breakdown_at_peak"]
    assert (b["Parameter"], b["Gradient"], b["Optstate"]) == (n * F32, n * F32, 2 * n * F32)


def test_module_parameter_bytes_follow_the_layer_shapes(tiny):
    c, trace = tiny
    a = c.model.args()
    kv = a.n_kv_heads * a.head_dim
    expected = {
        # q, k and v: one fused projection (torchtitan 0.3.0's wqkv)
        "layers.0.attention.wqkv": a.dim * (a.dim + 2 * kv) * F32,
        "layers.0.feed_forward.w1": a.dim * a.ffn_dim * F32,
        "output": a.vocab_size * a.dim * F32,
        "<root>": a.num_params() * F32,
    }
    assert {k: trace.modules[k].param_bytes for k in expected} == expected
    assert trace.modules["<root>"].buffer_bytes == a.n_layers * c.training.seq_len * a.head_dim * F32
    assert trace.modules["layers"].fw_peak == 0  # a ModuleDict is never called
    assert (
        0 < trace.modules["layers.0.attention.wqkv"].fw_peak <= trace.modules["<root>"].fw_peak <= trace.peak
    )


def test_metadata_says_measured_and_reports_kernel_scratch(tiny):
    _, trace = tiny
    md = trace.metadata
    assert md["mode"] == "measured" and md["target_device"] == "cpu" and md["world_size"] == 1
    assert 0 < md["kernel_scratch"]["peak_bytes_excluding"] <= trace.peak
    assert FAKE_PG_LIMITATION not in trace.limitations


def test_same_job_gives_byte_identical_reports():
    first, second = (measure_job(cfg()) for _ in range(2))  # one call site: identical stacks expected too
    assert blocks_csv(first) == blocks_csv(second)
    assert to_json(build_report(first)) == to_json(build_report(second))


def test_world_two_runs_one_rank_with_the_fake_process_group():
    c = build_config(
        {"model": {"name": "llama-tiny"}, "training": {"seq_len": 32}, "world": {"world_size": 2, "rank": 1}}
    )
    before = global_state()
    trace = measure_job(c, capture_stacks=False)
    assert global_state() == before
    assert FAKE_PG_LIMITATION in trace.limitations
    assert trace.metadata["rank"] == 1 and trace.metadata["mesh_shape"] == [1, 1, 2, 1, 1]


def test_globals_are_restored_when_the_profiled_step_fails():
    c = cfg()
    calls = []
    inner = micro_batch_step(llama_loss, 1)

    def step(model, opt, batches):
        calls.append(1)
        if len(calls) == 2:  # the warm-up succeeds, the profiled step fails
            raise RuntimeError("boom")
        inner(model, opt, batches)

    before = global_state()
    with pytest.raises(SimulationError, match="step: RuntimeError: boom"):
        measure(model_fn(c), batch_fn(c), step_fn=step, world_size=2, mesh_shape=(2,))
    assert global_state() == before


def run_cli(argv, capsys):
    parser = OneLineParser(prog="hyperdryrun")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    register(sub)
    try:
        args = parser.parse_args(["measure", *argv])
        rc = args.func(args)
    except SystemExit as exc:
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_writes_the_report_pair_in_the_run_schema(tmp_path, capsys):
    out_dir = tmp_path / "out"
    rc, out, _ = run_cli(
        ["--model", "llama-tiny", "--seq-len", "32", "--target-device", "cpu", "--output-dir", str(out_dir)],
        capsys,
    )
    assert rc == 0, out
    report = json.loads((out_dir / "rank_0" / "rank_0_memory.json").read_text())
    assert report["status"] == "ok" and report["metadata"]["mode"] == "measured"
    header = (out_dir / "rank_0" / "rank_0_memory.csv").read_text().splitlines()[0]
    assert header == ",".join(CSV_COLUMNS)
    assert "without kernel scratch" in out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--seq-len", "0"], "training.seq_len (--seq-len)"),
        (["--world-size", "3", "--tp", "2"], "world.world_size=3"),
        (["--dtype", "fp8"], "training.dtype (--dtype)"),
        (
            ["--world-size", "2", "--cp", "2", "--seq-len", "32"],
            "cp=2: context parallel cannot be measured on the CPU",
        ),
        (["--model", "moe-tiny"], "model.name='moe-tiny': MoE models are not measured yet"),
    ],
)
def test_cli_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, argv, needle):
    out_dir = tmp_path / "out"
    model = [] if "--model" in argv else ["--model", "llama-tiny"]
    rc, _, err = run_cli([*model, "--output-dir", str(out_dir), *argv], capsys)
    assert rc == 2
    assert err.startswith("hyperdryrun: error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert needle in err
    assert not out_dir.exists()


def test_context_parallel_is_refused_before_anything_runs():
    c = build_config(
        {
            "model": {"name": "llama-tiny"},
            "training": {"seq_len": 32},
            "world": {"world_size": 2},
            "parallel": {"cp": 2},
        }
    )
    before = global_state()
    with pytest.raises(MeasureError, match="no handler for the CPU SDPA kernel"):
        measure_job(c, capture_stacks=False)
    assert global_state() == before


@pytest.mark.parametrize("rank", [0, 1])
def test_pipeline_rank_seeds_its_receive_buffers_and_restores_the_schedule_patch(rank):
    """pp=2, 1F1B, 2 micro batches of 1 x 32 tokens, fp32, dim 64: stage 1 keeps one activation receive buffer per
    micro batch, stage 0 one gradient receive buffer per micro batch: 2 x 32 x 64 x 4 B either way."""
    from torch.distributed.pipelining.schedules import _PipelineSchedule

    from hyperdryrun.trace.blocks import Category, Phase

    c = build_config(
        {
            "model": {"name": "llama-tiny"},
            "training": {"seq_len": 32, "param_dtype": "fp32", "num_micro_batches": 2},
            "world": {"world_size": 2, "rank": rank},
            "parallel": {"pp": 2, "pp_schedule": "1F1B"},
            "target_device": "cpu",
        }
    )
    warmup = _PipelineSchedule._warmup_p2p
    before = global_state()
    trace = measure_job(c, capture_stacks=False)
    assert global_state() == before and _PipelineSchedule._warmup_p2p is warmup
    held = [b for b in trace.blocks if b.phase is Phase.INITIALIZATION and b.category is Category.OTHER]
    assert c.model.args().dim == 64
    assert sorted(b.size for b in held) == [32 * 64 * F32] * 2
    assert trace.metadata["pipeline"]["stage_indices"] == [rank]
    # The schedule's chunks label their blocks by micro batch; the batch (2 x 2 randint of 32 int64 tokens) and
    # its concatenation (tokens, labels: 2 x 64 int64) are input data, "Other", as in the dry run.
    step = [b for b in trace.blocks if b.phase is not Phase.INITIALIZATION]
    assert {b.micro_batch for b in step if b.phase is Phase.BACKWARD} == {0, 1}
    assert sum(b.size for b in step if b.category is Category.OTHER) == 4 * 32 * 8 + 2 * 64 * 8


@pytest.mark.parametrize(
    ("profiler_name", "label"),
    [
        ("hyperdryrun/engine.py(81): step", "hyperdryrun.engine:step"),
        ("hyperdryrun/models/llama.py(71): forward", "hyperdryrun.models.llama:forward"),
        (
            f"{Path(hyperdryrun.__file__).parent}/measure/__init__.py(3): <module>",
            "hyperdryrun.measure:<module>",
        ),
        ("torch/_tensor.py(626): backward", "torch/_tensor.py(626): backward"),
        ("<built-in method add of Tensor object at 0x7f3a>", "<built-in method add>"),
    ],
)
def test_allocation_sites_in_hyperdryrun_code_are_named_without_line_numbers(profiler_name, label):
    # An edit that moves a line of HyperDryRun's own code must not rename an op in a measured report; other
    # code keeps the profiler's file(line) name.
    assert _call_name(SimpleNamespace(name=profiler_name)) == label


def test_the_step_functions_own_allocations_are_labelled_by_module_and_function(tiny):
    _, trace = tiny
    ops = {b.op for b in trace.blocks}
    assert "hyperdryrun.engine:step" in ops
    assert not [op for op in ops if re.search(r"hyperdryrun/\S+\.py\(\d+\)", op)]
