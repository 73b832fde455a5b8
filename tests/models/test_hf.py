"""Hugging Face causal LMs (``--model hf:NAME``): shipped configs, dry run vs real execution, the built-in preset
of the same shape, MoE routing, TP from the model's own plan, and the CLI."""

from __future__ import annotations

import json
from collections import Counter

import pytest

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

from hyperdryrun.config import ConfigError, build_config  # noqa: E402
from hyperdryrun.measure.accuracy import compare_job, phases  # noqa: E402
from hyperdryrun.models import hf  # noqa: E402
from hyperdryrun.recipe import run_job  # noqa: E402

SMALL = {"n_layers": 2, "dim": 128, "n_heads": 4, "n_kv_heads": 1, "ffn_dim": 448, "vocab_size": 512}
"""The accuracy suite's "llama3-8b shape, 2 layers, width 128" row."""
TINY = {"n_layers": 2, "dim": 64, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 96, "vocab_size": 256}
CPU = {"training": {"seq_len": 64, "param_dtype": "fp32"}, "target_device": "cpu"}
HF_STRUCTURE = {"norm": "fp32-unfused", "fuse_qkv": False, "rope": "shared"}
"""The built-in llama's options that give HF LlamaForCausalLM's modules (LlamaRMSNorm, q/k/v_proj, one rotary)."""


@pytest.mark.parametrize(
    ("name", "total", "active"),
    [
        # The model cards' totals: Llama-3.1-8B 8,030,261,248; Qwen2.5-7B 7.62B; Qwen3-30B-A3B 30.5B total, 3.3B
        # active; Mixtral-8x7B 46.7B total (12.9B active: 2 of 8 experts).
        ("llama-3.1-8b", 8_030_261_248, None),
        ("qwen2.5-7b", 7.62e9, None),
        ("qwen3-30b-a3b", 30.5e9, 3.3e9),
        ("mixtral-8x7b", 46.7e9, 12.9e9),
    ],
)
def test_shipped_configs_build_on_meta_with_the_published_parameter_counts(name, total, active):
    args = build_config({"model": {"name": f"hf:{name}"}}).model.args()
    n = args.num_params()
    if isinstance(total, int):
        assert n == total
    else:
        assert round(n / 1e9, 2 if total < 10e9 else 1) == pytest.approx(total / 1e9), n
    if active is not None:
        assert args.is_moe
        # the cards' one-decimal figures: Qwen writes 3.35B as "3.3B", Mistral 12.88B as "12.9B"
        assert abs(args.num_params(active=True) - active) < 0.06e9
    else:
        assert not args.is_moe


def test_hf_llama_dry_run_equals_its_real_cpu_execution_per_phase():
    r = compare_job("hf llama", {**CPU, "model": {"name": "hf:llama-3.1-8b", **SMALL}})
    # Measured without kernel scratch (what a dry run counts): equal to the byte, the step and every phase. The
    # real run also allocates transformers' packed-sequence check (3 int64 vectors of 64 and a few scalars, freed at
    # once), which the dry run answers without running; they are not live at any phase peak.
    assert r.measured_peak_without_scratch == r.dry_peak
    for phase, (dry, measured) in r.phase_peaks.items():
        assert dry == measured, phase


LOSS_OPS = ("_to_copy", "constant_pad_nd", "clone", "_log_softmax", "nll_loss_forward")


def _loss_blocks(trace) -> list[tuple[str, int]]:
    """(op, bytes) of the forward blocks from the head's logits on, in order, that the loss's ops made."""
    head = max(b.start for b in trace.blocks if b.module == "lm_head" and str(b.phase) == "forward")
    blocks = sorted(
        (b for b in trace.blocks if b.start > head and str(b.phase) == "forward"), key=lambda b: b.start
    )
    return [(b.op, b.size) for b in blocks if b.op in LOSS_OPS]


def test_hf_own_loss_bytes_by_hand_equal_real_cpu_execution_and_the_builtin_loss_lacks_the_label_copies():
    from hyperdryrun.measure.step import measure_job

    # bf16 compute (FSDP2 over one rank), 2 sequences of 64 tokens, vocabulary 256: the head's logits are bf16.
    data = {"training": {"seq_len": 64, "micro_batch_size": 2}, "target_device": "cpu"}
    data["model"] = {"name": "hf:llama-3.1-8b", **TINY}
    cfg = build_config(data)
    assert cfg.training.loss == "model"
    b, s, v = 2, 64, 256
    # transformers' ForCausalLMLoss: logits.float() (an fp32 copy of the bf16 logits), labels padded with one -100
    # per row (int64, b x (s+1)), labels[..., 1:].contiguous() (a strided slice of 2 rows: an int64 copy, b x s),
    # then cross_entropy: log_softmax in fp32 (b*s x v) and nll_loss's loss and total weight (fp32 scalars).
    by_hand = [
        ("_to_copy", b * s * v * 4),
        ("constant_pad_nd", b * (s + 1) * 8),
        ("clone", b * s * 8),
        ("_log_softmax", b * s * v * 4),
        ("nll_loss_forward", 4),
        ("nll_loss_forward", 4),
    ]
    dry = run_job(cfg, capture_stacks=False)
    measured = measure_job(cfg, capture_stacks=False)
    assert dry.metadata["loss"] == {"kind": "hf", "chunks": None}
    assert _loss_blocks(dry) == by_hand
    assert _loss_blocks(measured) == by_hand
    # The whole step equal to the byte, its peak and every phase (measured without kernel scratch).
    assert measured.metadata["kernel_scratch"]["peak_bytes_excluding"] == dry.peak
    dry_phases = {k: p["peak_bytes"] for k, p in phases(dry).items()}
    assert measured.metadata["kernel_scratch"]["phase_peak_bytes_excluding"] == dry_phases
    # --loss builtin (the old name cross-entropy too): the same fp32 copy and cross entropy of the logits, on the
    # recipe's labels as given: no pad, no shifted copy; and after the model's forward has returned, so FSDP2 has
    # resharded the root unit (its bf16 embedding v x d, head v x d and final norm d, gathered for the forward).
    # HF's loss runs inside the root's forward: at its forward peak (the log_softmax) those are still held.
    d = TINY["dim"]
    root_unsharded = (2 * v * d + d) * 2
    for name in ("builtin", "cross-entropy"):
        builtin = run_job(build_config({**data, "training": {**data["training"], "loss": name}}), False)
        assert builtin.metadata["loss"] == {"kind": "cross-entropy", "chunks": None}
        assert _loss_blocks(builtin) == [x for x in by_hand if x[0] not in ("constant_pad_nd", "clone")]
        forward = phases(builtin)["forward"]["peak_bytes"]
        assert dry_phases["forward"] - forward == root_unsharded + b * (s + 1) * 8 + b * s * 8


def test_hf_llama_matches_the_built_in_preset_of_the_same_shape():
    hf_trace = run_job(
        build_config({**CPU, "model": {"name": "hf:llama-3.1-8b", **SMALL}}), capture_stacks=False
    )
    # The built-in preset with HF's structure: LlamaRMSNorm normalises in fp32 unfused, q/k/v are three
    # projections, one rotary module serves every layer (torchtitan's 2024 llama; the preset's defaults are 0.3.0's).
    ours = run_job(build_config({**CPU, "model": {"name": "llama3-8b", **SMALL, **HF_STRUCTURE}}), False)
    head_dim = SMALL["dim"] // SMALL["n_heads"]
    # Both peak in the optimizer step with the same parameters, gradients and AdamW states. The one difference:
    # the RoPE tables. The built-in keeps a complex64 freqs_cis buffer of (seq_len, head_dim/2) = 64 x 16 x 8 B;
    # HF keeps inv_freq and original_inv_freq, fp32 of head_dim/2 each, and computes cos/sin per step.
    rope_builtin = 64 * (head_dim // 2) * 8
    rope_hf = 2 * (head_dim // 2) * 4
    assert ours.peak - hf_trace.peak == rope_builtin - rope_hf == 8064
    assert abs(ours.peak - hf_trace.peak) / ours.peak < 0.01


def test_hf_llama_31_8b_cut_to_2_layers_is_within_1_percent_of_the_built_in_llama3_8b():
    cfg = {"training": {"seq_len": 256}, "world": {"world_size": 8}}
    hf_trace = run_job(build_config({**cfg, "model": {"name": "hf:llama-3.1-8b", "n_layers": 2}}), False)
    # HF models take FSDP2 on each decoder layer with the root holding embedding, norm and head (the preset's
    # torchtitan-2024 units): 8 ranks of the preset's default units differ from them by gigabytes.
    built_in = {"model": {"name": "llama3-8b", "n_layers": 2, **HF_STRUCTURE}}
    ours = run_job(build_config({**cfg, **built_in, "parallel": {"fsdp_wrap": "torchtitan-2024"}}), False)
    assert hf_trace.metadata["num_params"] == ours.metadata["num_params"]
    assert abs(hf_trace.peak - ours.peak) / ours.peak < 0.01, (hf_trace.peak, ours.peak)


def _expert_mm_sizes(trace, fqn: str) -> list[int]:
    return sorted(
        b.size for b in trace.blocks if b.module == fqn and b.op == "mm" and str(b.phase) == "forward"
    )


def test_hf_mixtral_eager_experts_take_their_token_counts_from_the_routing_scenario():
    base = {"model": {"name": "hf:mixtral-8x7b", **TINY, "experts_implementation": "eager"}}
    base |= {"training": {"seq_len": 64}, "target_device": "cpu"}
    balanced = run_job(build_config(base), capture_stacks=False)
    hot = run_job(build_config({**base, "values": {"routing": "hotspot", "hot_expert": 1, "skew": 3}}), False)
    # 64 tokens x top-2 over 8 experts: 16 each; hotspot: expert 1 gets round(3 x 16) = 48, the other seven share
    # the remaining 80 (12 to the three lowest, 11 to the rest). Per expert, in bf16 compute: the gate_up matmul
    # is tokens x 2*96 x 2 B, the down matmul tokens x 64 x 2 B.
    for trace, counts in ((balanced, [16] * 8), (hot, [12, 48, 12, 12, 11, 11, 11, 11])):
        expected = sorted([c * 192 * 2 for c in counts] + [c * 64 * 2 for c in counts])
        for layer in range(2):
            assert _expert_mm_sizes(trace, f"model.layers.{layer}.mlp.experts") == expected
    fqn = "model.layers.0.mlp.experts"
    assert balanced.modules[fqn].bw_peak != hot.modules[fqn].bw_peak
    assert hot.metadata["moe"]["tokens_per_expert"] == [12, 48, 12, 12, 11, 11, 11, 11]


def test_hf_grouped_mm_experts_do_not_depend_on_routing():
    base = {"model": {"name": "hf:qwen3-30b-a3b", **TINY, "num_experts": 8, "top_k": 2, "moe_ffn_dim": 32}}
    base |= {"training": {"seq_len": 64}, "target_device": "cpu"}
    balanced = run_job(build_config(base), capture_stacks=False)
    hot = run_job(build_config({**base, "values": {"routing": "hotspot", "skew": 3}}), capture_stacks=False)
    # One grouped GEMM over all 64 x 2 routed rows whatever their split: the same blocks.
    sizes = lambda t: Counter((b.op, b.size) for b in t.blocks)  # noqa: E731
    assert sizes(balanced) == sizes(hot) and balanced.peak == hot.peak


def test_tp_2_from_base_model_tp_plan_shards_attention_and_mlp():
    # bf16 compute: FSDP2 (over dp_shard=1) holds the parameters as DTensors, the TP ones 2-D
    cfg = {"training": {"seq_len": 64}, "target_device": "cpu"}
    cfg |= {"model": {"name": "hf:llama-3.1-8b", **TINY}, "world": {"world_size": 2}}
    cfg["parallel"] = {"tp": 2, "sequence_parallel": False, "loss_parallel": False}
    trace = run_job(build_config(cfg), capture_stacks=False)
    one = run_job(
        build_config({**cfg, "model": cfg["model"], "world": {}, "parallel": {}}), capture_stacks=False
    )
    d, f, v, kv = 64, 96, 256, 2 * 16
    # fp32 parameters per layer: q and o d x d, k and v d x kv, gate/up/down d x f, two norms d. colwise/rowwise
    # halve all but the norms; the embedding stays replicated, lm_head (colwise_gather_output) is halved.
    layer = 2 * d * d + 2 * d * kv + 3 * d * f
    params_1 = (2 * (layer + 2 * d) + d + 2 * v * d) * 4
    params_2 = (2 * (layer // 2 + 2 * d) + d + v * d + v * d // 2) * 4
    param_bytes = lambda t: sum(  # noqa: E731
        b.size for b in t.blocks if b.op == "initialization" and str(b.category) == "Parameter"
    )
    assert param_bytes(one) == params_1
    assert param_bytes(trace) == params_2


def test_tp_without_a_plan_and_unsupported_layouts_are_one_line_errors(tmp_path):
    config = json.loads((hf.CONFIG_DIR / "llama-3.1-8b.json").read_text())
    config |= {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 256}
    (tmp_path / "config.json").write_text(json.dumps(config))
    # GPT-2 (no base_model_tp_plan) keeps its layers under transformer.h: refused before the TP plan is asked for
    # (it failed half-way through parallelize: 'GPT2Model' object has no attribute 'layers', issue 30)
    with pytest.raises(ConfigError, match=r"GPT2LMHeadModel keeps its layers under 'transformer'") as err:
        build_config({"model": {"name": f"hf:{tmp_path}"}, "world": {"world_size": 2}, "parallel": {"tp": 2}})
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="parallel.sequence_parallel=True is not supported"):
        build_config(
            {"model": {"name": "hf:llama-3.1-8b"}, "world": {"world_size": 2}, "parallel": {"tp": 2}}
        )
    with pytest.raises(ConfigError, match="parallel.tp=2 for Hugging Face models needs FSDP2"):
        build_config(
            {"model": {"name": "hf:llama-3.1-8b"}, "world": {"world_size": 2}, "training": {"param_dtype": "fp32"},
             "parallel": {"tp": 2, "sequence_parallel": False, "loss_parallel": False}}
        )  # fmt: skip
    with pytest.raises(ConfigError, match="parallel.pp=2 is not supported for Hugging Face models"):
        build_config(
            {
                "model": {"name": "hf:llama-3.1-8b"},
                "world": {"world_size": 2},
                "parallel": {"pp": 2},
                "training": {"num_micro_batches": 2},
            }
        )


def test_bad_model_names_and_fields_are_one_line_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"model.name: --model hf:nope: no shipped config 'nope'"):
        build_config({"model": {"name": "hf:nope"}})
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"--model hf:.*config.json: invalid or truncated JSON at line 1"):
        build_config({"model": {"name": f"hf:{tmp_path}"}})
    with pytest.raises(ConfigError, match="model.attn_implementation=eager applies to Hugging Face models"):
        build_config({"model": {"name": "llama-tiny", "attn_implementation": "eager"}})
    with pytest.raises(ConfigError, match="model.rope_theta=.* does not apply to 'hf:llama-3.1-8b'"):
        build_config({"model": {"name": "hf:llama-3.1-8b", "rope_theta": 1.0}})


def test_attn_implementation_reaches_the_model():
    cfg = build_config({**CPU, "model": {"name": "hf:llama-3.1-8b", **TINY, "attn_implementation": "eager"}})
    model = hf.build_hf_model(cfg.model.args(), 64)
    assert model.config._attn_implementation == "eager"
    eager = run_job(cfg, capture_stacks=False)
    sdpa = run_job(build_config({**CPU, "model": {"name": "hf:llama-3.1-8b", **TINY}}), capture_stacks=False)
    # eager attention materialises the (bs, heads, seq, seq) fp32 scores and probabilities SDPA does not
    assert eager.phase_peak != sdpa.phase_peak


def test_cli_runs_a_shipped_hf_config(tmp_path, capsys):
    from hyperdryrun.cli import main

    rc = main(
        ["run", "--model", "hf:llama-3.1-8b", "--n-layers", "1", "--dim", "64", "--n-heads", "4",
         "--n-kv-heads", "2", "--ffn-dim", "96", "--vocab-size", "256", "--seq-len", "32",
         "--output-dir", str(tmp_path), "--quiet"]
    )  # fmt: skip
    assert rc == 0
    report = json.loads((tmp_path / "rank_0" / "rank_0_memory.json").read_text())
    assert report["metadata"]["model"] == "hf:llama-3.1-8b"
    assert report["metadata"]["model_args"]["config"]["num_hidden_layers"] == 1


def test_a_hugging_face_job_names_the_transformers_it_modelled_and_a_built_in_one_does_not():
    import torch
    import transformers

    from hyperdryrun.recipe import job_metadata

    hf = job_metadata(build_config({"model": {"name": "hf:llama-3.1-8b"}, "training": {"seq_len": 64}}))
    assert hf["transformers_version"] == transformers.__version__ and hf["torch_version"] == torch.__version__
    built_in = job_metadata(build_config({"model": {"name": "llama-tiny"}, "training": {"seq_len": 64}}))
    assert "transformers_version" not in built_in


# --- transformers' packed-sequence check in a user's own step (simulate / measure, not the recipe) --------------
VOCAB, ROWS, SEQ = 256, 2, 64


def _tiny_hf_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=128,
        use_cache=False,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


def _random_init(model) -> None:
    for p in model.parameters():
        p.normal_(0, 0.02)


def _own_loss_step(packed_rule: bool | None):
    """An HF user's step: ``model(input_ids=..., labels=..., [position_ids=...]).loss.backward()``, AdamW; with a
    ``branch`` value rule for ``hf.packed_sequences`` when ``packed_rule`` is not None."""
    import torch

    from hyperdryrun.world.values import ValueRule, ValueRules, use_rules

    def step(model, optimizer, batches):
        rules = (
            []
            if packed_rule is None
            else [ValueRule(op="hf.packed_sequences", handler="branch", value=packed_rule)]
        )
        with use_rules(ValueRules(rules), root=model):
            for ids, positions in batches:
                model(input_ids=ids, labels=ids, position_ids=positions).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, lambda params: torch.optim.AdamW(params, lr=1e-3, foreach=True)


def _batch(packed: bool):
    import torch

    def batch(i, device):
        ids = torch.randint(0, VOCAB, (ROWS, SEQ), device=device)
        if not packed:
            return ids, None  # the model makes its own positions: arange(SEQ)
        # two sequences of SEQ/2 tokens packed in each row: positions restart at SEQ/2
        return ids, torch.arange(SEQ // 2, device=device).repeat(ROWS, 2)

    return batch


def _dry_and_measured(packed_batch: bool, packed_rule: bool | None):
    from hyperdryrun import simulate
    from hyperdryrun.measure.step import measure

    step, adamw = _own_loss_step(packed_rule)
    args = {"step_fn": step, "optimizer_fn": adamw}
    dry = simulate(_tiny_hf_llama, _batch(packed_batch), target_device="cpu", capture_stacks=False, **args)
    measured = measure(
        _tiny_hf_llama, _batch(packed_batch), init_fn=_random_init, capture_stacks=False, **args
    )
    return dry, measured


def _mask_and_repeat_blocks(trace) -> list[tuple[str, int]]:
    """(op, bytes) of the forward's causal-mask blocks (S x S bool per row) and repeated key/value heads."""
    mask = ROWS * SEQ * SEQ
    kv = ROWS * 4 * SEQ * (64 // 4) * 4  # fp32 key or value with the query's 4 heads
    return [
        (b.op, b.size)
        for b in trace.blocks
        if str(b.phase) == "forward" and b.size in (mask, kv) and b.op in ("bitwise_and", "clone")
    ]


def test_hf_own_step_on_the_models_positions_equals_real_cpu_execution_no_mask_no_repeated_heads():
    """A user's own HF step (the API, not the recipe; row h1 of the GPU record is one): the real run reads the
    positions (arange per row), finds one sequence per row, and runs SDPA with is_causal, no mask and enable_gqa.
    The dry run cannot read fake positions; it answers as the real run does, and the step is equal to the byte."""
    dry, measured = _dry_and_measured(packed_batch=False, packed_rule=None)
    assert measured.metadata["kernel_scratch"]["peak_bytes_excluding"] == dry.peak
    dry_phases = {k: p["peak_bytes"] for k, p in phases(dry).items()}
    assert measured.metadata["kernel_scratch"]["phase_peak_bytes_excluding"] == dry_phases
    # No S x S mask and no key/value heads repeated to the query's 4 (2 layers x 2 such copies before the fix).
    assert _mask_and_repeat_blocks(dry) == [] == _mask_and_repeat_blocks(measured)


def test_hf_packed_positions_with_the_packed_rule_equal_real_cpu_execution():
    """Positions that restart inside a row: the real run finds packed sequences and materialises the mask (and
    then repeats the key/value heads, as SDPA gets a mask). A ``branch`` rule ``hf.packed_sequences: true`` makes
    the dry run take that path, equal to the byte; without it the dry run assumes one sequence per row."""
    dry, measured = _dry_and_measured(packed_batch=True, packed_rule=True)
    assert measured.metadata["kernel_scratch"]["peak_bytes_excluding"] == dry.peak
    blocks = _mask_and_repeat_blocks(measured)
    assert ("bitwise_and", ROWS * SEQ * SEQ) in blocks and ("clone", ROWS * 4 * SEQ * 16 * 4) in blocks
    assert _mask_and_repeat_blocks(dry) == blocks
    unpacked, _ = _dry_and_measured(packed_batch=True, packed_rule=False)
    assert _mask_and_repeat_blocks(unpacked) == []
    assert unpacked.peak < dry.peak
