"""Expert parallel: expert weights split by the EP degree, all-to-all token buffers sized by the routing scenario.

Fixtures: moe-tiny (dim 64, 4 experts of hidden 32, top-2, 2 MoE layers) and moe-debug (dim 128, 8 experts of
hidden 64, top-2, one dense and one MoE layer). FSDP2 mixed precision computes in bf16 (2 bytes per element).
"""

from __future__ import annotations

import pytest
import torch

from hyperdryrun.config import ConfigError
from hyperdryrun.engine import SimulationError, simulate
from hyperdryrun.models.moe import PRESETS, MoETransformer
from hyperdryrun.parallel.expert import ExpertParallel
from hyperdryrun.trace.blocks import PERSISTENT_END, Category, Phase, round_size
from hyperdryrun.world import SimulatedWorld
from hyperdryrun.world.values import active_rules
from tests.conftest import dry_run, job

TINY = PRESETS["moe-tiny"]


def moe_run(**over):
    return dry_run(model__name=over.pop("model", "moe-tiny"), **over)


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_ep_divides_each_ranks_expert_weights_by_the_ep_degree(ep):
    """No FSDP: a rank holds num_experts / ep experts of 3 * dim * hidden fp32 values each."""
    with SimulatedWorld(world_size=4, rank=1, mesh_shape=(4,), mesh_dim_names=("ep",)) as world:
        with torch.device("meta"):
            model = MoETransformer(TINY, max_seq_len=16)
        experts = model.layers["0"].moe.experts
        if ep > 1:
            sub = world.mesh if ep == 4 else None
            if sub is None:
                sub = world.mesh._unflatten("ep", (2, 2), ("rest", "ep2"))["ep2"]
            ExpertParallel("layers.0.moe.experts", TINY.top_k).apply(experts, sub)
        local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * 4 for p in experts.parameters())
    assert local == TINY.num_experts // ep * 3 * TINY.dim * TINY.moe_ffn_dim * 4


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_with_fsdp_ep_divides_the_gathered_expert_weights_and_keeps_the_stored_shard(ep):
    """world 4, dp_shard 4: experts are sharded over dp_shard_mod_ep x ep = 4 ranks whatever ep is, so the stored
    fp32 expert bytes are the same; what EP divides is the bf16 all-gather of one layer's local experts."""
    trace = moe_run(world__world_size=4, parallel__ep=ep, training__seq_len=16)
    expert_values = 3 * TINY.dim * TINY.moe_ffn_dim
    stored = sum(
        b.size
        for b in trace.blocks
        if b.category is Category.PARAMETER and b.end == PERSISTENT_END and b.module.endswith("moe.experts")
    )
    per_tensor = round_size(TINY.num_experts * TINY.dim * TINY.moe_ffn_dim * 4 // 4, 512)
    assert stored == TINY.n_layers * 3 * per_tensor
    gathered = sum(
        b.requested
        for b in trace.blocks
        if b.phase is Phase.FORWARD and b.module.startswith("layers.0") and b.op == "empty"
        and b.category is Category.PARAMETER
    )  # fmt: skip
    d, hd, kv = TINY.dim, TINY.head_dim, TINY.n_kv_heads * TINY.head_dim
    dense_part = (
        2 * d + d * TINY.n_heads * hd * 2 + 2 * d * kv + d * TINY.num_experts
    )  # norms, wq+wo, wk+wv, gate
    assert gathered == (dense_part + TINY.num_experts // ep * expert_values) * 2


def dispatch_sizes(trace, layer: int = 0) -> list[int]:
    """Requested bytes of the forward dispatch all-to-alls of one MoE layer (counts, then tokens): the first two of
    the layer, made by the MoE's token dispatcher (EP) or by the hooks around its experts (EP x ETP)."""
    return [
        b.requested
        for b in trace.blocks
        if b.op == "all_to_all_single"
        and b.phase is Phase.FORWARD
        and b.module in (f"layers.{layer}.moe", f"layers.{layer}.moe.experts")
    ][:2]


@pytest.mark.parametrize(("rank", "rows"), [(0, 2 * (6 + 5)), (1, 2 * (3 + 2))])
def test_explicit_counts_give_the_dispatched_token_buffers_derived_by_hand(rank, rows):
    """seq 8, top-2: 16 routed rows per rank, counts [6, 5, 3, 2]; ep 2: rank 0 holds experts 0-1 and receives
    6 + 5 rows from each of the 2 ranks, rank 1 holds experts 2-3 and receives 3 + 2 from each."""
    trace = moe_run(
        world__world_size=2,
        world__rank=rank,
        parallel__ep=2,
        training__seq_len=8,
        values__routing="explicit",
        values__counts=[6, 5, 3, 2],
    )
    int64_counts = TINY.num_experts * 8
    assert dispatch_sizes(trace) == [int64_counts, rows * TINY.dim * 2]
    # torchtitan 0.3.0's AllToAllTokenDispatcher: counts, tokens and the combine, all in the MoE's forward.
    exchanges = [
        b.requested
        for b in trace.blocks
        if b.op == "all_to_all_single" and b.phase is Phase.FORWARD and b.module == "layers.0.moe"
    ]
    assert exchanges == [int64_counts, rows * TINY.dim * 2, 16 * TINY.dim * 2]
    assert trace.metadata["moe"]["tokens_received_per_moe_layer"] == rows


def test_a_hot_expert_raises_its_ranks_peak_over_balanced_routing():
    """moe-debug, 8 experts over ep 4 (2 per rank), seq 256, top-2: balanced sends 64 rows to each expert; hotspot
    skew 3 sends 192 to expert 0 (on rank 0) and spreads the rest over the other 7."""
    common = dict(model="moe-debug", world__world_size=4, parallel__ep=4, training__seq_len=256)
    balanced = moe_run(world__rank=0, **common)
    hot = moe_run(world__rank=0, values__routing="hotspot", values__hot_expert=0, values__skew=3.0, **common)
    cold = moe_run(world__rank=2, values__routing="hotspot", values__hot_expert=0, values__skew=3.0, **common)
    assert hot.metadata["moe"]["tokens_per_expert"] == [192, 46, 46, 46, 46, 46, 45, 45]
    assert hot.metadata["moe"]["tokens_received_per_moe_layer"] == 4 * (192 + 46)
    assert balanced.metadata["moe"]["tokens_received_per_moe_layer"] == 4 * 128
    assert dispatch_sizes(hot, 1)[1] == 4 * (192 + 46) * 128 * 2
    assert hot.peak > balanced.peak
    assert hot.peak > cold.peak
    assert hot.metadata["moe"]["routing"] == {
        "module": "*", "op": "moe.token_counts", "handler": "hotspot", "hot_expert": 0, "skew": 3.0,
    }  # fmt: skip


def test_expert_parallel_runs_are_deterministic():
    def run():
        t = moe_run(
            world__world_size=4,
            world__rank=3,
            parallel__ep=2,
            training__seq_len=16,
            values__routing="hotspot",
        )
        return t.peak, [(b.size, b.op, b.module, b.start, b.end, b.category) for b in t.blocks], t.metadata

    assert run() == run()


def test_expert_parallel_with_a_pipeline_runs_each_stage():
    peaks = [
        moe_run(
            model="moe-debug",
            world__world_size=4,
            world__rank=r,
            parallel__pp=2,
            parallel__ep=2,
            training__seq_len=32,
            training__num_micro_batches=2,
        ).peak
        for r in (0, 2)
    ]
    assert all(p > 0 for p in peaks)


@pytest.mark.parametrize("tp", [1, 2])
def test_dispatch_without_active_rules_names_the_module_and_restores_globals(tp):
    """ep 2, and ep 2 x etp 2 with tp 2."""
    from hyperdryrun.parallel.expert import parallelize_moe
    from hyperdryrun.recipe import parallelize_options

    over = dict(
        parallel__tp=tp, parallel__etp=tp, parallel__sequence_parallel=False, parallel__loss_parallel=False
    )
    cfg = job(model__name="moe-tiny", world__world_size=2 * tp, parallel__ep=2, training__seq_len=8, **over)
    with pytest.raises(SimulationError, match=r"layers\.0\.moe\.experts.*no value rules"):
        simulate(
            lambda: MoETransformer(TINY, 8),
            lambda i, d: (torch.randint(0, 256, (1, 8), device=d),) * 2,
            loss_fn=lambda m, b: m(b[0]).float().pow(2).mean(),
            parallelize_fn=lambda m, mesh: parallelize_moe(m, mesh, cfg.dims, parallelize_options(cfg)),
            world_size=2 * tp,
            mesh_shape=(1, 1, 2, 1, tp),
            mesh_dim_names=("pp", "dp_replicate", "dp_shard", "cp", "tp"),
        )
    assert active_rules() is None
    assert torch.utils._python_dispatch._get_current_dispatch_mode_stack() == []


@pytest.mark.parametrize(
    ("over", "message"),
    [
        (dict(parallel__ep=3, world__world_size=4), "parallel.ep=3 must divide parallel.dp_shard=4"),
        (
            dict(parallel__ep=2, world__world_size=2, model__name="llama-tiny"),
            "parallel.ep=2 needs an MoE model",
        ),
        (dict(parallel__etp=2, world__world_size=2), "parallel.etp=2 needs parallel.tp=2"),
        (
            dict(parallel__etp=4, parallel__tp=2, world__world_size=4),
            "parallel.etp=4 must be 1 or parallel.tp=2",
        ),
        (
            dict(parallel__tp=2, parallel__ep=2, world__world_size=4),
            "parallel.etp=1 with parallel.tp=2 and parallel.ep=2 is not supported",
        ),
        (
            dict(parallel__tp=2, model__moe_ffn_dim=33, world__world_size=2),
            "model.moe_ffn_dim=33 is not divisible by parallel.tp=2",
        ),
        (dict(parallel__cp=2, world__world_size=2), "parallel.cp=2 with an MoE model is not supported yet"),
        (
            dict(values__routing="explicit", values__counts=[1, 2, 3, 4]),
            "values.counts=[1, 2, 3, 4] must have",
        ),
        (dict(values__routing="explicit"), "values.routing='explicit' needs values.counts"),
        (dict(values__hot_expert=4), "values.hot_expert=4 must be < model.num_experts=4"),
        (dict(model__num_experts=8, model__name="llama-tiny"), "model.num_experts=8 needs an MoE model"),
    ],
)
def test_bad_moe_layouts_are_one_line_errors_naming_the_field(over, message):
    over.setdefault("model__name", "moe-tiny")
    with pytest.raises(ConfigError) as info:
        job(**over)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_the_cli_runs_a_hot_expert_job_and_the_report_states_the_scenario(tmp_path, capsys):
    import json

    from hyperdryrun.cli import main

    argv = ["run", "--model", "moe-tiny", "--world-size", "2", "--ep", "2", "--seq-len", "16", "--routing",
            "hotspot", "--hot-expert", "3", "--skew", "2", "--output-dir", str(tmp_path), "--no-stacks", "--quiet"]  # fmt: skip
    assert main(argv) == 0
    report = json.loads((tmp_path / "rank_0" / "rank_0_memory.json").read_text())
    moe = report["metadata"]["moe"]
    assert moe["routing"] == {
        "module": "*",
        "op": "moe.token_counts",
        "handler": "hotspot",
        "hot_expert": 3,
        "skew": 2.0,
    }
    # 16 tokens x top-2 = 32 over 4 experts: balanced 8, hot 16 on expert 3, 16 left over experts 0-2.
    assert moe["tokens_per_expert"] == [6, 5, 5, 16]
    assert any("MoE routing is a scenario" in line for line in report["limitations"])


def test_a_runtime_rule_mismatch_is_one_line_on_the_cli_and_restores_globals(tmp_path, capsys):
    import torch.distributed as dist
    import yaml

    from hyperdryrun.cli import main

    bad = {
        "values": {
            "rules": [
                {"module": "layers.1.*", "op": "moe.token_counts", "handler": "explicit", "counts": [1, 2, 3]}
            ]
        }
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(bad))
    dtype = torch.get_default_dtype()
    out = tmp_path / "out"
    rc = main(["run", "--config", str(path), "--model", "moe-tiny", "--world-size", "2", "--ep", "2", "--seq-len", "8",
               "--output-dir", str(out)])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("hyperdryrun: error: ") and err.count("\n") == 1
    assert "routing rule counts=[1, 2, 3] must have 4 entries" in err
    # bad input found inside the step writes no error report (one of an earlier good run would stay: issue 23)
    assert not (out / "rank_0" / "rank_0_memory.json").exists()
    assert active_rules() is None and not dist.is_initialized()
    assert torch.utils._python_dispatch._get_current_dispatch_mode_stack() == []
    assert torch.get_default_dtype() == dtype


def test_interleaved_pipeline_stages_each_get_expert_parallel():
    """Two stages on one rank: each is parallelized with EP (the world mesh is unflattened once per stage)."""
    trace = moe_run(
        model="moe-debug",
        model__n_layers=4,
        world__world_size=4,
        parallel__pp=2,
        parallel__ep=2,
        parallel__pp_schedule="Interleaved1F1B",
        training__seq_len=32,
        training__num_micro_batches=2,
    )
    experts = {b.module for b in trace.blocks if b.op == "all_to_all_single" and b.module.endswith("moe")}
    # 4 stages over 4 layers (even split, embedding and head weighted as a layer): layers [0], [1, 2], [3], [];
    # pipeline rank 0 holds stages 0 and 2, i.e. layer 0 (dense in moe-debug) and layer 3 (MoE).
    assert trace.metadata["pipeline"]["stage_indices"] == [0, 2]
    assert experts == {"stage2.layers.3.moe"}


def test_fewer_local_experts_than_fsdp_ranks_shard_the_hidden_dim_without_padding():
    """moe-tiny, world 8, ep 2: 2 local experts over dp_shard_mod_ep = 4 ranks. Sharding the expert dim would pad
    2 experts to 4; sharding dim 1 (hidden 32 or dim 64, both divisible by 4) stores exactly 1/8 of each weight."""
    trace = moe_run(world__world_size=8, parallel__ep=2, training__seq_len=16)
    stored = [
        b.requested
        for b in trace.blocks
        if b.category is Category.PARAMETER and b.end == PERSISTENT_END and b.module == "layers.0.moe.experts"
    ]
    assert stored == [TINY.num_experts * TINY.dim * TINY.moe_ffn_dim * 4 // 8] * 3


# --- MoE with TP, and expert TP (ep x etp) ----------------------------------------------------------------------
DEBUG = PRESETS["moe-debug"]


def stored_bytes(trace) -> dict[str, int]:
    """Stored (persistent) parameter bytes per module, as requested."""
    out: dict[str, int] = {}
    for b in trace.blocks:
        if b.category is Category.PARAMETER and b.end == PERSISTENT_END:
            out[b.module] = out.get(b.module, 0) + b.requested
    return out


def test_tp_splits_attention_dense_and_shared_expert_weights_and_replicates_the_router():
    """moe-debug (dim 128, 4 heads of 32, 2 kv heads, dense FFN 256, 8 experts and 1 shared expert of hidden 64),
    world 2 = tp 2, fp32: every projection stores half its values, the router gate all of them; with ep = 1 the
    routed experts are split over tp on their hidden dimension (torchtitan's TensorParallel)."""
    trace = moe_run(model="moe-debug", world__world_size=2, parallel__tp=2, training__seq_len=16)
    d, q, kv, f, h, e = (
        DEBUG.dim,
        DEBUG.n_heads * DEBUG.head_dim,
        DEBUG.n_kv_heads * DEBUG.head_dim,
        256,
        64,
        8,
    )
    stored = stored_bytes(trace)
    half = {
        "attention.wqkv": d * (q + 2 * kv),  # torchtitan 0.3.0's fused q/k/v, split by whole KV groups
        "attention.wo": q * d,
    }
    for name, values in half.items():
        assert stored[f"layers.0.{name}"] == stored[f"layers.1.{name}"] == values * 4 // 2
    for w in ("w1", "w2", "w3"):
        assert stored[f"layers.0.feed_forward.{w}"] == d * f * 4 // 2
        assert stored[f"layers.1.moe.shared_experts.{w}"] == d * h * 4 // 2
    assert stored["layers.1.moe.router.gate"] == d * e * 4
    assert stored["layers.1.moe.experts"] == 3 * e * h * d * 4 // 2


def test_tp_all_gathers_the_moe_input_and_reduce_scatters_its_partial_output():
    """moe-tiny, tp 2 with sequence parallel, seq 8, bf16 compute: the MoE layer gathers the 8 tokens (8 x 64 x 2
    bytes), routes all 16 (token, expert) rows on every tp rank, and reduce-scatters its output back to 4 tokens."""
    trace = moe_run(world__world_size=2, parallel__tp=2, training__seq_len=8)
    fwd = [b for b in trace.blocks if b.phase is Phase.FORWARD and b.module.startswith("layers.0")]
    gathers = [b.requested for b in fwd if b.op == "all_gather_into_tensor" and b.module == "layers.0.moe"]
    scatters = [b.requested for b in fwd if b.op == "reduce_scatter_tensor"]
    assert gathers == [8 * TINY.dim * 2]
    assert scatters[-1] == 4 * TINY.dim * 2
    # First grouped GEMM: 16 rows x (hidden 32 / tp 2) bf16 values.
    grouped = [b.requested for b in fwd if b.op == "_grouped_mm" and b.module == "layers.0.moe.experts"]
    assert grouped[0] == 16 * (TINY.moe_ffn_dim // 2) * 2


@pytest.mark.parametrize("wrap", ["torchtitan", "torchtitan-2024"])
@pytest.mark.parametrize(("world", "fsdp"), [(4, 1), (8, 2)])
def test_ep_x_etp_splits_expert_weights_by_ep_times_etp_exactly(world, fsdp, wrap):
    """moe-debug, tp = etp = 2, ep = 2: each rank stores 8/2 experts with hidden 64/2, further sharded by FSDP over
    dp_shard_mod_ep = dp_shard / ep (1 at world 4, 2 at world 8); the bf16 all-gather restores ep x etp's share
    (torchtitan-2024: in a unit of the experts' own; torchtitan 0.3.0: in the block's unit, one all-gather)."""
    trace = moe_run(
        model="moe-debug",
        world__world_size=world,
        parallel__tp=2,
        parallel__ep=2,
        parallel__etp=2,
        parallel__fsdp_wrap=wrap,
        training__seq_len=16,
    )
    full = DEBUG.num_experts * DEBUG.moe_ffn_dim * DEBUG.dim
    assert stored_bytes(trace)["layers.1.moe.experts"] == 3 * full * 4 // (2 * 2 * fsdp)
    gathered = [
        b.requested
        for b in trace.blocks
        if b.phase is Phase.FORWARD
        and b.op == "empty"
        and b.category is Category.PARAMETER
        and b.module == "layers.1.moe.experts"
    ]
    if fsdp > 1:
        assert gathered == ([full * 2 // (2 * 2)] * 3 if wrap == "torchtitan-2024" else [])
    # The router stays whole (replicated over tp, sharded by FSDP over dp_shard = world / 2).
    assert stored_bytes(trace)["layers.1.moe.router.gate"] == DEBUG.dim * DEBUG.num_experts * 4 // (
        world // 2
    )


@pytest.mark.parametrize(("rank", "rows"), [(0, 2 * (6 + 5)), (1, 2 * (6 + 5)), (2, 2 * (3 + 2))])
def test_ep_x_etp_dispatches_the_hand_derived_token_rows_on_each_tp_rank(rank, rows):
    """world 4 = ep 2 x tp 2 (rank = 2 * ep_rank + tp_rank), seq 8 gathered to all 8 tokens, top-2, counts
    [6, 5, 3, 2]: both tp ranks of ep rank 0 receive 6 + 5 rows from each of 2 ep ranks, ep rank 1 receives 3 + 2;
    the grouped GEMM runs those rows on hidden 32 / etp 2."""
    trace = moe_run(
        world__world_size=4,
        world__rank=rank,
        parallel__tp=2,
        parallel__ep=2,
        parallel__etp=2,
        training__seq_len=8,
        values__routing="explicit",
        values__counts=[6, 5, 3, 2],
    )
    assert dispatch_sizes(trace) == [TINY.num_experts * 8, rows * TINY.dim * 2]
    grouped = [
        b.requested
        for b in trace.blocks
        if b.phase is Phase.FORWARD and b.op == "_grouped_mm" and b.module == "layers.0.moe.experts"
    ]
    assert grouped[0] == rows * (TINY.moe_ffn_dim // 2) * 2
    assert trace.metadata["moe"]["tokens_received_per_moe_layer"] == rows
    # The 16 routed rows are replicated over tp, so their gradient is a partial sum all-reduced over tp in backward.
    reduced = [
        b.requested
        for b in trace.blocks
        if b.phase is Phase.BACKWARD and b.op == "all_reduce" and b.module == "layers.0.moe.experts"
    ]
    assert reduced == [16 * TINY.dim * 2]


def test_moe_tensor_parallel_runs_are_deterministic():
    def run():
        t = moe_run(
            model="moe-debug",
            world__world_size=8,
            world__rank=5,
            parallel__tp=2,
            parallel__ep=2,
            parallel__etp=2,
            training__seq_len=16,
            values__routing="hotspot",
        )
        return t.peak, [(b.size, b.op, b.module, b.start, b.end, b.category) for b in t.blocks], t.metadata

    assert run() == run()


def test_mla_attention_with_tp_splits_the_up_projections_and_replicates_the_low_rank_ones():
    """A small MLA model (4 heads, q rank 32, kv rank 16, nope 16, rope 8, v 16) over tp 2 without FSDP: wq_b and
    wkv_b store half their fp32 values, wq_a and wkv_a all of theirs (torchtitan's deepseek_v3 plan)."""
    from hyperdryrun.engine import micro_batch_step
    from hyperdryrun.models.llama import cross_entropy_loss
    from hyperdryrun.parallel.expert import parallelize_moe
    from hyperdryrun.recipe import loss_context, parallelize_options, with_value_rules

    args = DEBUG.replace(
        attention="mla",
        n_kv_heads=4,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
    )
    cfg = job(
        model__name="moe-debug",
        world__world_size=2,
        parallel__tp=2,
        training__seq_len=8,
        training__param_dtype="fp32",
        training__reduce_dtype="fp32",
    )
    step = micro_batch_step(lambda m, b: cross_entropy_loss(m(b[0]), b[1]), 1, loss_context(cfg))
    trace = simulate(
        lambda: MoETransformer(args, 8),
        lambda i, d: (torch.randint(0, 512, (1, 8), device=d),) * 2,
        step_fn=with_value_rules(cfg, step),
        parallelize_fn=lambda m, mesh: parallelize_moe(m, mesh, cfg.dims, parallelize_options(cfg)),
        world_size=2,
        mesh_shape=(1, 1, 1, 1, 2),
        mesh_dim_names=("pp", "dp_replicate", "dp_shard", "cp", "tp"),
    )
    stored = stored_bytes(trace)
    assert stored["layers.1.attention.wq_a"] == 128 * 32 * 4
    assert stored["layers.1.attention.wkv_a"] == 128 * (16 + 8) * 4
    assert stored["layers.1.attention.wq_b"] == 32 * 4 * (16 + 8) * 4 // 2
    assert stored["layers.1.attention.wkv_b"] == 16 * 4 * (16 + 16) * 4 // 2
    assert stored["layers.1.attention.wo"] == 4 * 16 * 128 * 4 // 2


def test_expert_parallel_in_the_block_unit_is_refused_where_fsdp2_has_no_per_parameter_mesh(
    tmp_path, capsys, monkeypatch
):
    """torch 2.11's FSDP2 has no ``ShardPlacementResult``: an EP job with torchtitan 0.3.0's units (the experts over
    their own mesh inside the block's unit) is bad input there, named in one line, with nothing written; the 2024
    units (the experts their own unit) run."""
    from hyperdryrun import cli
    from hyperdryrun.parallel import expert

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(expert, "shard_placement_result", lambda: None)
    argv = ["run", "--model", "moe-tiny", "--world-size", "4", "--ep", "2", "--seq-len", "32", "--quiet"]
    assert cli.main([*argv, "--output-dir", str(tmp_path / "refused")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "parallel.ep=2 with parallel.fsdp_wrap='torchtitan'" in err[0]
    assert "torch 2.11 lacks" in err[0] and "Traceback" not in err[0]
    assert not (tmp_path / "refused").exists()
    assert cli.main([*argv, "--fsdp-wrap", "torchtitan-2024", "--output-dir", str(tmp_path / "ran")]) == 0
