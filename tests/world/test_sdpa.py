"""The SDPA backend torch 2.13 picks on a CUDA GPU, and the dry run's SDPA following the chosen target's choice."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention import SDPBackend, sdpa_kernel

from hyperdryrun.audit import OpRecorder
from hyperdryrun.world.cuda_target import CudaTarget
from hyperdryrun.world.gpus import GPU_PRESETS, gpu_preset
from hyperdryrun.world.kernels import target_kernel_patches
from hyperdryrun.world.patches import PatchSet
from hyperdryrun.world.sdpa import cuda_sdpa_backend, sdpa_priority


def _qkv(heads=8, kv_heads=8, head_dim=64, dtype=torch.bfloat16, seq=128):
    q = torch.empty(2, heads, seq, head_dim, dtype=dtype, device="meta", requires_grad=True)
    k = torch.empty(2, kv_heads, seq, head_dim, dtype=dtype, device="meta", requires_grad=True)
    v = torch.empty(2, kv_heads, seq, head_dim, dtype=dtype, device="meta", requires_grad=True)
    return q, k, v


H100 = CudaTarget()  # h100-80gb with the torch 2.13.0 PyPI wheel: CUDA 13.0, cuDNN 9.20
A100 = CudaTarget(gpu_preset("a100-80gb"))
B200 = CudaTarget(gpu_preset("b200"))
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


# ---------------------------------------------------------------------------------------------- GPU presets
# sdp_utils.cpp (pytorch/pytorch 001f694a) check_prefer_cudnn_attention, l. 93-120: with CUDA >= 13.0 (l. 109)
# "cudnn_version > 91500 && (major == 9 || major == 10)" puts cuDNN first (priority_order, l. 123-135); otherwise
# the Context's default order, flash, efficient, math, cudnn. The wheel's cuDNN is 9.20 (92000 > 91500).
PRIORITY_BY_GPU = {
    "a100-40gb": ("flash", "efficient", "math", "cudnn"),  # major 8
    "a100-80gb": ("flash", "efficient", "math", "cudnn"),
    "h100-80gb": ("cudnn", "flash", "efficient", "math"),  # major 9
    "h100-96gb": ("cudnn", "flash", "efficient", "math"),
    "h200": ("cudnn", "flash", "efficient", "math"),
    "b200": ("cudnn", "flash", "efficient", "math"),  # major 10
}


@pytest.mark.parametrize("name", sorted(PRIORITY_BY_GPU))
def test_each_cuda_preset_gets_the_sdpa_priority_of_its_compute_capability(name):
    assert sdpa_priority(CudaTarget(gpu_preset(name))) == PRIORITY_BY_GPU[name]


def test_every_preset_is_either_a_cuda_target_or_says_why_it_is_not_modelled():
    assert set(PRIORITY_BY_GPU) | {"mi300x"} == set(GPU_PRESETS)
    with pytest.raises(ValueError, match="gpu='mi300x' is not a CUDA GPU the dry run models: the ROCm build"):
        CudaTarget(gpu_preset("mi300x"))


def _dry_run_sdpa_ops(gpu: str) -> list[str]:
    """The allocating ops F.scaled_dot_product_attention issues on fake "cpu" under the target-kernel patches for
    ``gpu``: a Llama-style causal bf16 GQA attention (8 query heads, 2 KV heads, head_dim 128) in training."""
    patches = target_kernel_patches("cuda", "cpu", CudaTarget(gpu_preset(gpu)))
    with PatchSet(patches), FakeTensorMode():
        q = torch.empty(1, 8, 256, 128, dtype=torch.bfloat16, requires_grad=True)
        k = torch.empty(1, 2, 256, 128, dtype=torch.bfloat16, requires_grad=True)
        v = torch.empty(1, 2, 256, 128, dtype=torch.bfloat16, requires_grad=True)
        rec = OpRecorder("cpu")
        with rec:
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return [op for op, new in rec.events["forward"] if new]


def test_the_same_sdpa_call_runs_flash_on_an_a100_and_cudnn_on_an_h100():
    # A100 (sm80): flash first; bf16, no mask, head_dim 128 <= 256, sm80 in [sm80, sm121], GQA supported
    # (can_use_flash_attention). H100 (sm90): cuDNN first; bf16, head_dim 128 <= 128 and % 8, GQA supported
    # (can_use_cudnn_attention).
    assert _dry_run_sdpa_ops("a100-80gb") == ["_scaled_dot_product_flash_attention"]
    assert _dry_run_sdpa_ops("h100-80gb") == ["_scaled_dot_product_cudnn_attention"]
    assert _dry_run_sdpa_ops("b200") == ["_scaled_dot_product_cudnn_attention"]


def test_the_bound_sdpa_keeps_the_name_context_parallel_patches_by():
    [patch] = [
        p
        for p in target_kernel_patches("cuda", "cpu", CudaTarget(gpu_preset("a100-40gb")))
        if p.name == "scaled_dot_product_attention"
    ]
    assert patch.new.__name__ == "cuda_scaled_dot_product_attention"
