"""The simulation device follows the CUDA kernels: per layer, the ops, new storages and saved tensors on fake "cpu"
equal those recorded on fake "cuda" by the CUDA build of torch 2.13 (tests/audit/fixtures/cuda_kernels.json, made
with ``hyperdryrun audit-kernels --record``); the kernel patches are active inside the world and undone on exit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import hyperdryrun.world.simulated as world_module
from hyperdryrun import audit
from hyperdryrun.trace.blocks import round_size
from hyperdryrun.world import SimulatedWorld, default_simulation_device, kernels
from hyperdryrun.world.autocast import CastRules, WeightCache, autocast_patches
from hyperdryrun.world.cuda_target import DEFAULT_CUDA_TARGET, DIFFERENCES, MX_CAST_KERNELS
from hyperdryrun.world.kernels import (
    OUTPUT_FIXUPS,
    TargetFakeTensorMode,
    needs_target_kernels,
    target_kernel_patches,
)

REFERENCE = Path(__file__).parents[1] / "audit" / "fixtures" / "cuda_kernels.json"
UNRECORDABLE = {
    # aten::_fused_sgd_ has no fake/meta kernel in torch 2.13: fake mode runs the real kernel on zeros, which
    # needs a GPU for "cuda". It is in-place (no new storage) on every device; the simulation runs it on CPU.
    "sgd_fused": "Found no NVIDIA driver",
}


ACCEPTED = {name for d in DIFFERENCES if not d.handled_by for name in d.audit_layers}


@pytest.fixture(scope="module")
def reference() -> dict:
    return audit.load_reference(str(REFERENCE))


@pytest.fixture(scope="module")
def simulated() -> dict:
    return audit.record("cpu", "engine")["layers"]


def test_the_reference_is_a_fake_cuda_record_of_every_layer_by_a_cuda_build_of_torch_2_13(reference):
    assert reference["device"] == "cuda" and reference["backward"] == "walk"
    assert reference["torch_version"].startswith("2.13.0+cu") and reference["cuda_build"]
    assert set(reference["layers"]) == set(audit.LAYERS)
    assert reference["cuda_target"] == DEFAULT_CUDA_TARGET.as_dict()
    # Only these two were taken from the code under test (no GPU: no SDPA choice; FakeTensor optimizer default);
    # everything else is what the CUDA build's own dispatch did on fake "cuda".
    assert sorted(m.split(":")[0] for m in reference["modelled"]) == [
        "_foreach_supported_types",
        "scaled_dot_product_attention",
    ]


@pytest.mark.parametrize("name", sorted(audit.LAYERS))
def test_layer_allocates_and_saves_exactly_what_the_cuda_reference_does(name, reference, simulated):
    ref, sim = reference["layers"][name], simulated[name]
    assert "error" not in sim
    if name in UNRECORDABLE:
        assert UNRECORDABLE[name] in ref["error"]
        assert audit.summary(sim)["step_bytes"] == 0  # in-place on CUDA too: nothing to allocate
        return
    assert audit.summary(ref) == audit.summary(sim)
    if name in ACCEPTED:  # a documented difference in op names only: the bytes above agree
        assert all(
            p.startswith(("forward ops", "backward ops", "forward alloc", "backward alloc", "saved"))
            for p in audit.diff_layer(ref, sim)
        )
        assert audit.diff_layer(ref, sim) != []
        return
    assert audit.diff_layer(ref, sim) == []


def _without(monkeypatch, names: set[str]) -> None:
    orig = kernels.target_kernel_patches
    monkeypatch.setattr(
        world_module, "target_kernel_patches", lambda t, s: [p for p in orig(t, s) if p.name not in names]
    )
    for op in list(OUTPUT_FIXUPS):
        if op.overloadpacket.__name__ in names:
            monkeypatch.delitem(OUTPUT_FIXUPS, op)


@pytest.mark.parametrize("difference", [d for d in DIFFERENCES if d.audit_layers], ids=lambda d: d.layer)
def test_each_modelled_difference_is_found_by_the_audit_when_its_handling_is_removed(
    difference, reference, monkeypatch
):
    _without(monkeypatch, set(difference.handled_by))
    sim = audit.record("cpu", "engine", list(difference.audit_layers))["layers"]
    for name in difference.audit_layers:
        assert audit.diff_layer(reference["layers"][name], sim[name]) != [], name


def test_every_patch_and_output_fixup_has_a_difference_row_and_names_the_torch_behaviour():
    handled = {name for d in DIFFERENCES for name in d.handled_by}
    patches = target_kernel_patches("cuda", "cpu") + autocast_patches(CastRules("cpu", WeightCache()))
    fixups = {op.overloadpacket.__name__ for op in OUTPUT_FIXUPS}
    # torchao's MXFP8 casts are patched only where an earlier test loaded torchao's MX formats: their row either way
    assert set(MX_CAST_KERNELS) <= handled
    assert ({p.name for p in patches} | fixups) - set(MX_CAST_KERNELS) == handled - set(MX_CAST_KERNELS)
    assert all("torch 2.13" in p.reason for p in patches if p.name not in MX_CAST_KERNELS)
    assert all("torchao" in p.reason for p in patches if p.name in MX_CAST_KERNELS)
    layers = {n for d in DIFFERENCES for n in d.audit_layers}
    assert layers <= set(audit.LAYERS)


def test_torchaos_mx_casts_are_patched_as_their_row_names_them_where_torchao_is_loaded():
    pytest.importorskip("torchao.prototype.mx_formats.kernels")
    patches = [p for p in target_kernel_patches("cuda", "cpu") if p.name in MX_CAST_KERNELS]
    assert {p.name for p in patches} == set(MX_CAST_KERNELS)
    assert all(p.owner.__name__.startswith("torchao") for p in patches)


def test_cudnn_sdpa_saves_q_k_v_out_and_one_fp32_logsumexp_per_row(simulated):
    # derivatives.yaml, _scaled_dot_product_cudnn_attention: saves query, key, value, output, logsumexp and the
    # philox seed/offset (0-d int64); B=2, H=8, S=48, D=64 in bf16.
    qkv_out = 2 * 8 * 48 * 64 * 2
    expected = 4 * qkv_out + 2 * 8 * 48 * 4 + 2 * 8
    assert audit.summary(simulated["sdpa_causal_bf16_mha"])["saved_bytes"] == expected
    forward_ops = [op for op, new in simulated["sdpa_causal_bf16_mha"]["forward"] if new]
    assert forward_ops == ["_scaled_dot_product_cudnn_attention"]


def test_fused_rms_norm_saves_the_input_its_weight_and_one_fp32_rstd_per_row(simulated):
    # derivatives.yaml, _fused_rms_norm: saves input, weight and result1 (rstd, fp32); x is (2, 48, 64) bf16.
    saved = simulated["rms_norm_functional_bf16"]["saved"]
    expected = [
        [[2, 48, 64], "bfloat16", 2 * 48 * 64 * 2],
        [[64], "bfloat16", 64 * 2],
        [[2, 48, 1], "float32", 2 * 48 * 4],
    ]
    assert sorted(saved) == sorted(expected)


@pytest.mark.parametrize(
    "name", ["llama_block_bf16", "sdpa_bool_mask_bf16", "layernorm_bf16", "logsigmoid_fp32"]
)
def test_the_tracker_records_the_bytes_the_audit_counts(name, simulated):
    # The audit's recorder and the tracker apply the same rule (outermost ops, new storages), so the dry run's
    # blocks carry exactly the audited bytes; the output gradient is made by the test and counted once.
    with SimulatedWorld(world_size=1, target_device="cuda", simulation_device="cpu") as world, world.fake():
        torch.manual_seed(0)
        case = audit.LAYERS[name](torch.device("cpu"))
        tracker = world.track(capture_stacks=False)
        tracker.start()
        out = case.forward()
        grad = torch.ones_like(out)
        out.backward(grad)
        tracker.stop()
        grad_bytes = round_size(grad.untyped_storage().nbytes(), 512)
        total = sum(b.size for b in tracker.finalize())
    s = audit.summary(simulated[name])
    assert total == s["forward_blocks"] + s["backward_blocks"] + grad_bytes


# ---------------------------------------------------------------------------------------------- restore
def _globals() -> dict:
    import torch.optim.optimizer as optim_module

    return {
        "sdpa": F.scaled_dot_product_attention,
        "dropout": F.dropout,
        "rms_norm": F.rms_norm,
        "softmax": F.softmax,
        "log_softmax": F.log_softmax,
        "foreach_types": optim_module._foreach_supported_types,
        "foreach_devices": optim_module._get_foreach_kernels_supported_devices,
    }


class Boom(Exception):
    pass


@pytest.mark.parametrize("raises", [False, True], ids=["normal exit", "exception"])
def test_every_kernel_patch_is_active_inside_the_world_and_undone_on_exit(raises):
    before = _globals()
    try:
        with SimulatedWorld(world_size=2, rank=1, target_device="cuda", simulation_device="cpu") as world:
            inside = _globals()
            assert all(inside[k] is not before[k] for k in before)
            assert isinstance(world.fake_mode, TargetFakeTensorMode)
            if raises:
                raise Boom
    except Boom:
        assert raises
    after = _globals()
    assert all(after[k] is before[k] for k in before)
    import torch.optim.optimizer as optim_module
    from torch._subclasses.fake_tensor import FakeTensor

    assert FakeTensor not in optim_module._foreach_supported_types


def test_a_cpu_target_gets_no_kernel_patches_and_the_plain_tracking_mode():
    assert target_kernel_patches("cpu", "cpu") == []
    with SimulatedWorld(world_size=1, target_device="cpu", simulation_device="cpu") as world:
        assert not isinstance(world.fake_mode, TargetFakeTensorMode)
        assert F.scaled_dot_product_attention is _globals()["sdpa"]


def test_fake_cuda_is_only_simulated_where_a_gpu_is_usable(monkeypatch):
    assert default_simulation_device() == ("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_simulation_device() == "cpu"  # CUDA wheel, no GPU: fake cuda cannot run a backward
    assert needs_target_kernels("cuda", "cuda")  # and its SDPA choice would be math
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert default_simulation_device() == "cuda"
    assert not needs_target_kernels("cuda", "cuda")
    names = [
        p.name for p in target_kernel_patches("cuda", "cuda")
    ]  # torchao's MXFP8 casts if an earlier test
    assert [n for n in names if n not in MX_CAST_KERNELS] == ["_foreach_supported_types"]  # loaded them


# ---------------------------------------------------------------------------------------------- DTensor inputs
def _saved_locals(fn):
    """Run ``fn`` and return (shape, dtype, bytes) of the local tensor of everything autograd saves, once per
    storage."""
    from torch.distributed.tensor import DTensor

    saved, seen = [], set()

    def pack(t):
        local = t._local_tensor if isinstance(t, DTensor) else t
        st = local.untyped_storage()
        if id(st) not in seen:
            seen.add(id(st))
            saved.append((tuple(local.shape), local.dtype, st.nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, saved


def test_a_sequence_parallel_rms_norm_runs_the_fused_cuda_kernel_on_its_local_shard():
    # TP 2 with sequence parallel: the norm's input is a DTensor sharded on the sequence. On a GPU the DTensor's
    # device type is cuda, so aten::rms_norm calls _fused_rms_norm (layer_norm.cpp, rms_norm_symint) and DTensor
    # runs it on the local shard: autograd saves the local input (2, 24, 64) bf16, the replicated weight (64) bf16
    # and rstd, fp32, one per row (2, 24, 1) -- no fp32 copy of the input (the CPU composite's x.float(), pow, mul).
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    with SimulatedWorld(world_size=2, target_device="cuda", simulation_device="cpu") as world, world.fake():
        norm = parallelize_module(
            torch.nn.RMSNorm(64, dtype=torch.bfloat16), world.mesh, SequenceParallel(sequence_dim=1)
        )
        x = torch.randn(2, 24, 64, dtype=torch.bfloat16, requires_grad=True)  # the local shard of (2, 48, 64)
        out, saved = _saved_locals(lambda: norm(x))
        assert out.placements == (Shard(1),)
        assert sorted(saved, key=str) == sorted(
            [
                ((2, 24, 64), torch.bfloat16, 2 * 24 * 64 * 2),
                ((64,), torch.bfloat16, 64 * 2),
                ((2, 24, 1), torch.float32, 2 * 24 * 4),
            ],
            key=str,
        )
        assert type(out.grad_fn).__name__ == "_FusedRMSNormBackward"  # one fused backward


def test_a_tensor_and_sequence_parallel_block_saves_what_the_cuda_kernels_save_derived_by_hand():
    # The Llama block under TP 2 + SP (the recipe's and torchtitan's plan), llama-tiny's shape in bf16: B=2, S=48
    # (24 per rank on the sequence-parallel side), D=64, 4 query and 2 KV heads of 16 (2 and 1 per rank), FFN 128
    # (64 per rank); the model's shared RoPE table (complex64). Per rank, each storage once:
    #   attention_norm, fused kernel on the local shard: input 2*24*64*2 = 6,144, weight 128, fp32 rstd
    #     2*24*4 = 192                                                                                  6,464
    #   wqkv (colwise): the gathered input viewed (96, 64), 12,288; its weight's shard (64 rows) 8,192    20,480
    #   RoPE: xc * rot saves rot (rot needs no grad): (1, 48, 1, 8) complex64                           3,072
    #   cuDNN attention (sm90, bf16, GQA): q 6,144, k 3,072, v 3,072, out 6,144, fp32 logsumexp
    #     2*2*48*4 = 768, philox seed and offset 8 + 8                                                 19,216
    #   wo (rowwise): its weight's shard (64, 32) 4,096; its input is the attention output (cuDNN's layout
    #     makes transpose().contiguous() a view of it: no new storage)                                  4,096
    #   ffn_norm: as attention_norm                                                                     6,464
    #   w1, w3 (colwise): the gathered input 12,288 (once), two weight shards 8,192 each; SiLU saves its
    #     input 12,288; the product saves both factors 2 x 12,288; w2 (rowwise) its input 12,288 and its
    #     weight's shard 8,192                                                                          86,016
    # Total 145,808 B; no fp32 tensor of the hidden size (the CPU composite of rms_norm saved fp32 copies of
    # every norm input: the 192 MiB per layer an H200 did not hold, ../shared/gpu p3 and p6).
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from hyperdryrun.audit.layers import _module
    from hyperdryrun.models.llama import PRESETS, TransformerBlock, rope_cache
    from hyperdryrun.parallel.tp import block_tp_plan

    args = PRESETS["llama-tiny"].replace(rope="shared")
    with SimulatedWorld(world_size=2, target_device="cuda", simulation_device="cpu") as world, world.fake():
        block = _module(lambda: TransformerBlock(args, 48), torch.device("cpu"), torch.bfloat16)
        parallelize_module(block, world.mesh, block_tp_plan(block, Shard(1)))
        rope = rope_cache(args.head_dim, 48, args.rope_theta)
        x = torch.randn(2, 24, 64, dtype=torch.bfloat16, requires_grad=True)
        _, saved = _saved_locals(lambda: block(x, rope))
    assert sum(nbytes for _, _, nbytes in saved) == 6_464 + 20_480 + 3_072 + 19_216 + 4_096 + 6_464 + 86_016
    assert [s for s in saved if s[1] == torch.float32 and s[0][-1] == 64] == []
    assert [s for s in saved if s[0] == (2, 24, 1)] == [((2, 24, 1), torch.float32, 192)] * 2


def test_an_out_kernel_without_a_meta_kernel_writes_into_out_instead_of_running_for_real(monkeypatch):
    """``aten._scaled_mm.out`` (Inductor's extern call for a compiled float8 GEMM) has no Meta kernel, so
    FakeTensorMode ran its real CPU kernel on zero-filled tensors of the full size (``run_fallback_kernel``): a
    405B float8 step took minutes per layer. On a CUDA target it returns ``out`` and allocates nothing."""
    import torch._subclasses.fake_tensor as fake_tensor

    import hyperdryrun

    def no_real_kernel(*args, **kwargs):
        raise AssertionError("a real kernel ran on the fake tensors")

    monkeypatch.setattr(fake_tensor, "run_fallback_kernel", no_real_kernel)
    n = 64

    class Float8Gemm(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.empty(n, n, dtype=torch.bfloat16))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            one = torch.ones((), device=x.device)
            out = torch.empty(n, n, dtype=torch.bfloat16, device=x.device)
            a, b = x.to(torch.float8_e4m3fn), self.w.detach().to(torch.float8_e4m3fn).t()
            torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16, out=out)
            return out.float().sum() + self.w.float().sum()

    trace = hyperdryrun.simulate(
        Float8Gemm,
        lambda i, device: torch.randn(n, n, device=device, dtype=torch.bfloat16),
        loss_fn=lambda model, x: model(x),
        capture_stacks=False,
    )
    assert not [b for b in trace.blocks if b.op.startswith("_scaled_mm")]
    # what the forward allocated around it: the ones scalar, out (n x n bf16), the two fp8 copies (n x n bytes)
    assert {b.op for b in trace.blocks if b.size == n * n * 2} >= {"empty"}
