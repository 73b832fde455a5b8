"""torchtitan's MoE debug models: the dry run of a step equals its real CPU execution (``--measure``) with the
routing of the measured run.

Each job: the family's debug model cut to 2 layers, world 2, FSDP 2 x EP 2 (the experts' all-to-all token
dispatch, whose split sizes depend on the routing), rank 0, local batch 2 x 64 tokens, ``--attention sdpa`` (no
FlexAttention/varlen backward on the CPU) and ``--training.disable_cuda_graphs`` (torchtitan refuses EP's
all-to-all dispatcher under CUDA graphs, also on GPUs). The measured run records each routed-experts module's
per-expert token counts; the dry run is given them (``routing=``) as explicit ``moe.token_counts`` rules.

Left out of the comparison, as in test_torchtitan_measure.py, what a CPU run puts on the device allocator and a GPU
keeps in host memory: the CPU RNG states of activation checkpointing, torchtitan's host token counter, and the
0-dim tensors a CPU op wraps a Python scalar in (fused AdamW's step ``+ 1``; ``// top_k`` of the dispatcher and
``// 2`` of the load-balancing hook, 8 B each; an 8 B double and its 4 B float32 cast for FSDP's
``grad / gradient_divide_factor`` on the experts' one-rank FSDP group and the load-balancing hook's
``load_balance_coeff * torch.sign(...)``). On CUDA a wrapped scalar is a CPU tensor, passed to the kernel as an
argument.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "torchtitan", reason="torchtitan is not installed (pip install 'hyperdryrun[torchtitan]')"
)

from hyperdryrun.integrations.torchtitan import (  # noqa: E402
    TorchtitanError,
    load_config,
    simulate_torchtitan,
)
from hyperdryrun.integrations.torchtitan_ranks import measured_routing  # noqa: E402
from hyperdryrun.measure.torchtitan import measure_torchtitan  # noqa: E402
from hyperdryrun.trace.blocks import STEP_PHASES, Category  # noqa: E402
from hyperdryrun.trace.tracker import RESIZE_OP  # noqa: E402
from tests.integrations.test_torchtitan_measure import (  # noqa: E402
    by_category,
    cpu_scalar_blocks,
    host_blocks,
    kernel_scratch_blocks,
    live,
)

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # each job runs two real steps (about 30 s)

WORLD, EP, N_LAYERS, BATCH, SEQ = 2, 2, 2, 2, 64
TOKENS = BATCH * SEQ
BF16, FP32 = 2, 4
FAMILIES = [
    ("deepseek_v3", "deepseek_v3_debugmodel"),
    ("qwen3", "qwen3_moe_debug"),
    ("gpt_oss", "gpt_oss_debugmodel"),
]


def job(module: str, config: str) -> list[str]:
    return [
        *("--module", module, "--config", config),
        *("--parallelism.data_parallel_shard_degree", str(WORLD)),
        *("--parallelism.expert_parallel_degree", str(EP)),
        "--training.disable_cuda_graphs",
        *("--training.seq_len", str(SEQ), "--training.local_batch_size", str(BATCH)),
    ]


def moe_layers(argv: list[str]) -> dict[str, object]:
    """torchtitan's own config of each MoE layer of the cut model, by the routed-experts module's FQN."""
    layers = load_config(argv).model_spec.model.layers[:N_LAYERS]
    return {
        f"layers.{i}.moe.routed_experts": layer.moe
        for i, layer in enumerate(layers)
        if getattr(layer, "moe", None) is not None
    }


def wrapped_scalar_blocks(trace) -> list:
    """The measured 0-dim tensors of CPU ops on a Python scalar (see the module docstring): an 8 B block that no
    aten op made (the profiler names it by the Python call: ``<built-in method floor_divide>``, or
    ``file(line): function``, where the argument parser wraps the scalar before dispatch) and the 4 B float32 cast
    of it made by the next op and freed with it."""
    by_start: dict[int, list] = {}
    for b in trace.blocks:
        by_start.setdefault(b.start, []).append(b)
    out = []
    for b in trace.blocks:
        if b.size == 8 and (b.op.startswith("<built-in method ") or "): " in b.op):
            out.append(b)
            out += [c for c in by_start.get(b.start + 1, []) if c.size == 4 and c.end == b.end]
    return out


@pytest.fixture(scope="module", params=FAMILIES, ids=[c for _, c in FAMILIES])
def measured_and_dry(request):
    argv = job(*request.param)
    kw = dict(world_size=WORLD, rank=0, n_layers=N_LAYERS, attention="sdpa")
    measured = measure_torchtitan(argv, **kw)
    routing = measured_routing(measured)
    dry = simulate_torchtitan(argv, **kw, target_device="cpu", capture_stacks=False, routing=routing)
    return argv, measured, routing, dry


def test_the_measured_routing_is_recorded_per_moe_layer_and_routes_every_token_top_k_times(measured_and_dry):
    argv, measured, routing, _ = measured_and_dry
    layers = moe_layers(argv)
    assert set(routing) == set(layers) and layers
    for name, moe in layers.items():
        counts = routing[name]
        assert len(counts) == moe.num_experts
        assert sum(counts) == TOKENS * moe.router.top_k and max(counts) <= TOKENS
        # forward and the selective-checkpoint recompute (if any) routed the same tokens
        assert all(c == counts for c in measured.metadata["torchtitan"]["routing"][name])


def test_the_dry_runs_all_to_all_receives_the_measured_counts(measured_and_dry):
    argv, _, routing, dry = measured_and_dry
    dim = load_config(argv).model_spec.model.dim
    for name, moe in moe_layers(argv).items():
        local = moe.num_experts // EP
        # EP rank 0 receives from each EP rank (all route alike) the tokens of its experts 0..local-1, bf16 rows
        received = EP * sum(routing[name][:local]) * dim * BF16
        sizes = {b.size for b in dry.blocks if b.op == "all_to_all_single" and str(b.phase) == "forward"}
        assert received in sizes, (name, received, sorted(sizes))


def _sinks_states(argv: list[str]) -> int:
    """gpt_oss: the bytes of the attention sinks' AdamW states (exp_avg, exp_avg_sq: ``n_heads`` fp32 each, FSDP's
    dim-0 shard; step: 4 B) in the dry run, which the measured run does not make: torchtitan's
    ScaledDotProductAttention (``--attention sdpa``) takes gpt_oss's sink rescale (``out_transform``) and ignores
    it, so the sinks get no gradient and AdamW skips them. The dry run, as a GPU running torchtitan's own attention
    would, holds them."""
    if argv[argv.index("--module") + 1] != "gpt_oss":
        return 0
    heads = load_config(argv).model_spec.model.layers[0].attention.n_heads
    return N_LAYERS * (2 * math.ceil(heads / WORLD) * FP32 + FP32)


def backward_unsharded_parameters(trace) -> list:
    """The measured storages FSDP2 all-gathers a layer's parameters back into in backward (``storage.resize_``).

    The measured run labels a storage a parameter when a module that owns it runs forward (trace/roles.py), by
    the storage's address at that time; its allocation in backward gets a new address, so it is labelled only when
    activation checkpointing recomputes the module's forward afterwards. gpt_oss's debug config has no activation
    checkpointing: they stay Temp, where the dry run's tracker, which follows the storage object, keeps them
    Parameter. Their bytes are compared as they are; only their label is the dry run's."""
    return [b for b in trace.blocks if b.op == RESIZE_OP and str(b.phase) == "backward"]


def test_dry_run_equals_the_measured_step_per_category_and_peak(measured_and_dry):
    argv, measured, _, dry = measured_and_dry
    for b in backward_unsharded_parameters(measured):
        assert b.category in (Category.PARAMETER, Category.TEMP), b
        b.category = Category.PARAMETER
    assert_measured_step(measured, dry, _sinks_states(argv))


def assert_measured_step(measured, dry, dry_only_optstate: int = 0) -> None:
    """The dry run of a torchtitan MoE step equals its measured step: peak, categories at the peak, every phase's
    maximum and after the step. The measured side leaves out what a CPU run alone puts on the device allocator
    (host tensors, wrapped scalars, kernel scratch); ``dry_only_optstate``: optimizer-state bytes the dry run
    holds at every point and the measured run never makes (derived by the caller)."""
    left_out = {
        id(b)
        for b in [
            *host_blocks(measured),
            *cpu_scalar_blocks(measured),
            *wrapped_scalar_blocks(measured),
            *kernel_scratch_blocks(measured),
        ]
    }
    kept = [b for b in measured.blocks if id(b) not in left_out]
    totals = [live(kept, t) for t in range(measured.num_tasks)]
    dry_totals = [live(dry.blocks, t) - dry_only_optstate for t in range(dry.num_tasks)]
    assert max(dry_totals) == max(totals)
    peak_task = totals.index(max(totals))
    measured_peak, dry_peak = by_category(kept, peak_task), by_category(dry.blocks, dry.peak_task)
    dry_peak["Optstate"] -= dry_only_optstate
    assert measured_peak == dry_peak
    for phase in STEP_PHASES:
        sides = [
            [totals[t] for t in range(measured.num_tasks) if measured.task_phase[t] is phase],
            [dry_totals[t] for t in range(dry.num_tasks) if dry.task_phase[t] is phase],
        ]
        assert max(sides[0], default=None) == max(sides[1], default=None), phase
    end, dry_end = by_category(kept, measured.num_tasks), by_category(dry.blocks, dry.num_tasks)
    dry_end["Optstate"] -= dry_only_optstate
    assert end == dry_end


def test_a_module_that_routed_differently_per_call_cannot_be_given_one_count_list():
    class Trace:
        metadata = {"torchtitan": {"routing": {"layers.1.moe.routed_experts": [[2, 0], [1, 1]]}}}

    with pytest.raises(TorchtitanError, match="routed 2 different ways"):
        measured_routing(Trace())


@pytest.mark.parametrize("measured_and_dry", FAMILIES[:1], ids=[FAMILIES[0][1]], indirect=True)
def test_the_command_dry_runs_with_the_routing_of_a_measured_report(measured_and_dry, tmp_path):
    """One family is enough for the command line."""
    argv, measured, routing, dry = measured_and_dry
    from hyperdryrun.report import blocks_csv, build_report, write_reports

    [report_path] = [
        p
        for p in write_reports(build_report(measured), blocks_csv(measured), tmp_path / "measured", 0)
        if str(p).endswith(".json")
    ]
    done = subprocess.run(
        [sys.executable, "-m", "hyperdryrun.cli", "torchtitan", *argv]
        + [f"--world-size={WORLD}", "--rank=0", f"--n-layers={N_LAYERS}", "--attention=sdpa"]
        + ["--target-device=cpu", "--no-stacks", "--quiet", f"--routing-from={report_path}"]
        + ["--output-dir", str(tmp_path / "dry")],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(REPO / "src")},
    )
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "dry" / "rank_0" / "rank_0_memory.json").read_text())
    assert report["summary"]["peak_bytes"] == dry.peak
    given = [x for x in report["limitations"] if x.startswith("MoE routing:")]
    assert len(given) == 1 and f"from {report_path}: layer 1 as the file's loads" in given[0]
    assert routing == {
        "layers.1.moe.routed_experts": measured.metadata["torchtitan"]["routing"][
            "layers.1.moe.routed_experts"
        ][0]
    }


def test_the_dispatcher_is_torchtitans_own_again(measured_and_dry):
    """Both runs patched AllToAllTokenDispatcher (the dry run its value points, the measured run its count
    exchange): torchtitan's own methods are back after each."""
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    for name in ("_token_count_exchange", "_sync_token_count_exchange", "_local_reorder"):
        fn = getattr(AllToAllTokenDispatcher, name)
        assert fn.__module__ == "torchtitan.models.common.token_dispatcher", (name, fn.__module__)
