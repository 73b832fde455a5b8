"""The simulation device follows the CUDA kernels: per layer, the ops, new storages and saved tensors on fake "cpu"
equal those recorded on fake "cuda" by the CUDA build of torch 2.13 (tests/world/fixtures/cuda_kernels.json,
made with ``python -m hyperdryrun.world.audit --record``)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import hyperdryrun.world as world_module
from hyperdryrun.trace.blocks import round_size
from hyperdryrun.world import SimulatedWorld, audit, default_simulation_device, kernels
from hyperdryrun.world.kernels import (
    DIFFERENCES,
    OUTPUT_FIXUPS,
    CudaTarget,
    TargetFakeTensorMode,
    cuda_sdpa_backend,
    needs_target_kernels,
    target_kernel_patches,
)

REFERENCE = Path(__file__).parent / "fixtures" / "cuda_kernels.json"
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
    assert reference["cuda_target"] == kernels.DEFAULT_CUDA_TARGET.as_dict()
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


def test_walking_the_autograd_graph_issues_the_same_backward_ops_as_the_engine():
    # The reference runs its backward by calling each node (the engine cannot run on fake cuda without a GPU);
    # on fake cpu both run, and every dispatched backward op (allocating or not) and every byte agree.
    engine = audit.record("cpu", "engine")["layers"]
    walk = audit.record("cpu", "walk")["layers"]
    for name in audit.LAYERS:
        assert audit.diff_layer(engine[name], walk[name]) == [], name
        ops = [
            Counter((op, tuple(new)) for op, new in r.get("backward", [])) for r in (engine[name], walk[name])
        ]
        assert ops[0] == ops[1], name


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
    patches = target_kernel_patches("cuda", "cpu")
    fixups = {op.overloadpacket.__name__ for op in OUTPUT_FIXUPS}
    assert {p.name for p in patches} | fixups == handled
    assert all("torch 2.13" in p.reason for p in patches)
    layers = {n for d in DIFFERENCES for n in d.audit_layers}
    assert layers <= set(audit.LAYERS)


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


# ---------------------------------------------------------------------------------------------- SDPA backend
def _qkv(heads=8, kv_heads=8, head_dim=64, dtype=torch.bfloat16, seq=128):
    q = torch.empty(2, heads, seq, head_dim, dtype=dtype, device="meta", requires_grad=True)
    k = torch.empty(2, kv_heads, seq, head_dim, dtype=dtype, device="meta", requires_grad=True)
    v = torch.empty(2, kv_heads, seq, head_dim, dtype=dtype, device="meta", requires_grad=True)
    return q, k, v


H100 = CudaTarget()  # torch 2.13.0 PyPI wheel: CUDA 13.0, cuDNN 9.20
A100 = CudaTarget(sm=(8, 0))
B200 = CudaTarget(sm=(10, 0))
H100_CU128_CUDNN910 = CudaTarget(cudnn=91002, cuda=12080)
H100_CUDNN923 = CudaTarget(cudnn=92300)
MASK = torch.ones(128, 128, dtype=torch.bool, device="meta")

# Expected backends read by hand from torch 2.13 aten/src/ATen/native/transformers/cuda/sdp_utils.cpp:
# check_prefer_cudnn_attention (cuDNN first on sm90/sm10x with cuDNN > 9.15, CUDA >= 13), can_use_cudnn_attention
# (fp16/bf16, head_dim <= 128 unless cuDNN > 9.22, % 8, dropout in 1/16 steps), can_use_flash_attention (no mask,
# head_dim <= 256, fp16/bf16), can_use_mem_efficient_attention (fp32 too, masks, alignment), then math.
SDPA_CASES = [
    ("bf16 causal MHA", {}, {}, {"H100": "cudnn", "A100": "flash", "B200": "cudnn", "cu128": "flash"}),
    ("bf16 GQA", {"kv_heads": 2}, {"enable_gqa": True}, {"H100": "cudnn", "A100": "flash"}),
    ("bf16 GQA without enable_gqa", {"kv_heads": 2}, {}, {"H100": "math", "A100": "math"}),
    ("fp32 MHA", {"dtype": torch.float32}, {}, {"H100": "efficient", "A100": "efficient"}),
    (
        "fp32 GQA",
        {"dtype": torch.float32, "kv_heads": 2},
        {"enable_gqa": True},
        {"H100": "math", "A100": "math"},
    ),
    ("bf16 bool mask", {}, {"attn_mask": MASK}, {"H100": "cudnn", "A100": "efficient"}),
    ("bf16 head_dim 256", {"head_dim": 256}, {}, {"H100": "flash", "A100": "flash", "cudnn923": "cudnn"}),
    ("bf16 head_dim 320", {"head_dim": 320}, {}, {"H100": "efficient", "A100": "efficient"}),
    ("bf16 head_dim 100", {"head_dim": 100}, {}, {"H100": "flash", "A100": "flash"}),
    ("bf16 dropout 0.1", {}, {"dropout_p": 0.1}, {"H100": "flash"}),
    ("bf16 dropout 0.125", {}, {"dropout_p": 0.125}, {"H100": "cudnn"}),
    ("fp32 head_dim 30", {"dtype": torch.float32, "head_dim": 30}, {}, {"H100": "math"}),
]
TARGETS = {"H100": H100, "A100": A100, "B200": B200, "cu128": H100_CU128_CUDNN910, "cudnn923": H100_CUDNN923}


@pytest.mark.parametrize(
    "label,shape,kwargs,target,expected",
    [(c[0], c[1], c[2], t, b) for c in SDPA_CASES for t, b in c[3].items()],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_sdpa_backend_follows_torch_2_13_cuda_rules(label, shape, kwargs, target, expected):
    q, k, v = _qkv(**shape)
    causal = "attn_mask" not in kwargs
    assert cuda_sdpa_backend(q, k, v, is_causal=causal, target=TARGETS[target], **kwargs) == expected


def test_sdpa_backend_honours_sdpa_kernel_and_deterministic_mode():
    q, k, v = _qkv()
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        assert cuda_sdpa_backend(q, k, v, is_causal=True) == "flash"
    with sdpa_kernel([SDPBackend.MATH]):
        assert cuda_sdpa_backend(q, k, v, is_causal=True) == "math"
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]), pytest.raises(RuntimeError, match="No available kernel"):
        cuda_sdpa_backend(q, k, v, attn_mask=MASK)
    torch.use_deterministic_algorithms(True)
    try:
        assert cuda_sdpa_backend(q, k, v, is_causal=True) == "flash"  # cuDNN SDPA is not deterministic
    finally:
        torch.use_deterministic_algorithms(False)
    assert cuda_sdpa_backend(q, k, v, is_causal=True) == "cudnn"


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
    assert [p.name for p in target_kernel_patches("cuda", "cuda")] == ["_foreach_supported_types"]
