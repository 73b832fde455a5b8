"""torchao's float8 and MXFP8 training dry-run on a CUDA target: each allocation of a Float8Linear's step derived by
hand from torchao 0.18's code (``float8_scaling_utils.hp_tensor_to_float8_dynamic``: ``float8_utils.tensor_to_amax``
and ``amax_to_scale``, ``float8_training_tensor._ToFloat8ConstrFunc``; ``mxfp8_linear.mx_mm``), and the GPU checks
answered as the target preset."""

from __future__ import annotations

import pytest

pytest.importorskip("torchao", reason="torchao is not installed (pip install 'hyperdryrun[float8]')")

import torch  # noqa: E402
from torch import nn  # noqa: E402

import hyperdryrun  # noqa: E402
from hyperdryrun.compat import torchao as ao_compat  # noqa: E402
from hyperdryrun.world.runtime import CudaRuntime  # noqa: E402

with ao_compat.quiet_import():
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: E402

M, K, N = 256, 128, 512  # tokens, in_features, out_features: every dim a multiple of 16 (and of 32 for MX)
FP32, BF16, FP64, FP8 = 4, 2, 8, 1


def _trace(recipe_or_config, dtype: torch.dtype, world_size: int = 1, **plan):
    config = (
        Float8LinearConfig.from_recipe_name(recipe_or_config)
        if isinstance(recipe_or_config, str)
        else recipe_or_config
    )

    def parallelize(model, mesh):
        convert_to_float8_training(model, config=config)
        return model

    return hyperdryrun.simulate(
        lambda: nn.Sequential(nn.Linear(K, N, bias=False, dtype=dtype)),
        lambda i, device: torch.randn(M, K, device=device, dtype=dtype),
        parallelize_fn=plan.pop("parallelize_fn", parallelize),
        loss_fn=lambda model, batch: model(batch).float().sum(),
        optimizer_fn=lambda params: torch.optim.SGD(params, lr=0.1),
        world_size=world_size,
        capture_stacks=False,
        **plan,
    )


def _forward_until_gemm(trace) -> list[tuple[str, int]]:
    """(op, requested bytes) of the forward's allocations up to the first scaled GEMM, the batch left out."""
    out = []
    for block in sorted(trace.blocks, key=lambda b: b.start):
        if block.phase.name != "FORWARD" or block.op == "randn":
            continue
        out.append((block.op, block.requested))
        if block.op == "_scaled_mm":
            break
    return out


def _tensorwise_cast(n: int) -> list[tuple[str, int]]:
    """An fp32 tensor of n elements cast to float8 with one dynamic scale: abs (n fp32), max (an fp32 scalar),
    amax_to_scale in fp64 (to, clamp, finfo.max / amax as reciprocal and mul) back to an fp32 scale, then
    tensor * scale (n fp32; .to(float32) of an fp32 tensor allocates nothing), the saturating clamp (n fp32) and
    the fp8 copy (n bytes)."""
    return [
        ("abs", n * FP32), ("max", FP32),
        ("_to_copy", FP64), ("clamp", FP64), ("reciprocal", FP64), ("mul", FP64), ("_to_copy", FP32),
        ("mul", n * FP32), ("clamp", n * FP32), ("_to_copy", n * FP8),
    ]  # fmt: skip


def _rowwise_cast(n: int, scales: int) -> list[tuple[str, int]]:
    """A bf16 tensor of n elements cast to float8 with ``scales`` scales (one per row of the GEMM operand): abs (n
    bf16), amax (bf16 per scale), fp64 amax_to_scale per scale, the fp32 scale rounded down to a power of 2 (log2,
    floor, exp2: rowwise sets round_scales_to_power_of_2), then .to(float32) (n fp32), * scale, clamp, fp8 copy."""
    s = scales
    return [
        ("abs", n * BF16), ("amax", s * BF16),
        ("_to_copy", s * FP64), ("clamp", s * FP64), ("reciprocal", s * FP64), ("mul", s * FP64),
        ("_to_copy", s * FP32), ("log2", s * FP32), ("floor", s * FP32), ("exp2", s * FP32),
        ("_to_copy", n * FP32), ("mul", n * FP32), ("clamp", n * FP32), ("_to_copy", n * FP8),
    ]  # fmt: skip


def test_float8_tensorwise_forward_allocates_the_casts_derived_by_hand():
    trace = _trace("tensorwise", torch.float32)
    # the input (M x K) and the weight (N x K) each cast with one scale; _scaled_mm takes the scales' reciprocals
    # (float8_ops.py) and returns M x N in the input's dtype (fp32)
    expected = [
        *_tensorwise_cast(M * K),
        *_tensorwise_cast(N * K),
        ("reciprocal", FP32), ("reciprocal", FP32), ("_scaled_mm", M * N * FP32),
    ]  # fmt: skip
    assert _forward_until_gemm(trace) == expected


def test_float8_rowwise_scales_are_one_fp32_per_row_and_the_high_precision_copies_stay_for_backward():
    trace = _trace("rowwise", torch.bfloat16)
    # input scaled per row (M scales), the transposed weight per column of K x N (N scales); output bf16
    expected = [
        *_rowwise_cast(M * K, M),
        *_rowwise_cast(N * K, N),
        ("reciprocal", M * FP32), ("reciprocal", N * FP32), ("_scaled_mm", M * N * BF16),
    ]  # fmt: skip
    assert _forward_until_gemm(trace) == expected
    # matmul_with_hp_or_float8_args saves the high-precision input and weight, not their fp8 copies: every fp8
    # copy and scale of the forward is freed by the end of the forward (the batch and parameter outlive it)
    forward = [b for b in trace.blocks if b.phase.name == "FORWARD" and b.op not in ("randn",)]
    gemm = next(b for b in forward if b.op == "_scaled_mm")
    casts = [b for b in forward if b.start < gemm.start]
    assert all(b.end <= gemm.start + 1 for b in casts)


def test_float8_on_an_a100_target_is_refused_in_one_line_as_on_the_card():
    with pytest.raises(hyperdryrun.SimulationError) as info:
        _trace("tensorwise", torch.float32, cuda=CudaRuntime(gpu="a100-80gb"))
    message = str(info.value.error)
    assert "\n" not in message
    assert message.startswith("gpu='a100-80gb' (sm80) refused, as on the card: torch._scaled_mm")


def test_rowwise_with_high_precision_grad_weight_runs_one_scaled_gemm_in_backward():
    gemms = {}
    for recipe in ("rowwise", "rowwise_with_gw_hp"):
        trace = _trace(recipe, torch.bfloat16)
        backward = [b for b in trace.blocks if b.phase.name == "BACKWARD"]
        gemms[recipe] = sorted((b.op, b.requested) for b in backward if b.op in ("_scaled_mm", "mm"))
    # grad_input M x K and grad_weight N x K, bf16; with gw_hp the weight gradient is a plain bf16 mm
    assert gemms["rowwise"] == [("_scaled_mm", M * K * BF16), ("_scaled_mm", N * K * BF16)]
    assert gemms["rowwise_with_gw_hp"] == [("_scaled_mm", M * K * BF16), ("mm", N * K * BF16)]


def test_fsdp_float8_all_gather_moves_fp8_shards_world_size_times():
    from torch.distributed.fsdp import fully_shard

    world = 2

    def parallelize(model, mesh):
        convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    trace = _trace(None, torch.float32, world_size=world, parallelize_fn=parallelize)
    forward = [b for b in trace.blocks if b.phase.name == "FORWARD" and b.module == "0"]
    # WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather casts the local fp32 shard (N / world x K) to fp8: the
    # all-gather input; FSDP2's all-gather output and the unsharded fp8 weight hold world x shard bytes
    shard = N // world * K * FP8
    assert ("_to_copy", shard) in [(b.op, b.requested) for b in forward]
    assert sorted(b.requested for b in forward if b.op == "empty") == [world * shard, world * shard]


def test_mxfp8_linear_runs_as_on_a_b200():
    from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear

    def parallelize(model, mesh):
        model[0] = MXFP8Linear(K, N, bias=False, dtype=torch.bfloat16, device="meta")
        return model

    trace = _trace(None, torch.bfloat16, parallelize_fn=parallelize, cuda=CudaRuntime(gpu="b200"))
    # triton_to_mxfp8_dim0 of the input and of the weight: an fp8 copy and one e8m0 byte per 32 elements; each
    # scale matrix (rows x K/32 = 4 columns) is already 4 wide, and M = 256, N = 512 are multiples of 128, so
    # to_blocked pads nothing: its reshape of the permuted view copies it once; the GEMM returns M x N bf16
    expected = [
        ("empty", M * K * FP8), ("empty", M * K // 32),
        ("empty", N * K * FP8), ("empty", N * K // 32),
        ("reshape", M * K // 32), ("reshape", N * K // 32),
        ("_scaled_mm", M * N * BF16),
    ]  # fmt: skip
    assert _forward_until_gemm(trace) == expected


def test_mxfp8_on_an_sm90_target_is_refused_in_one_line():
    from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear

    def parallelize(model, mesh):
        model[0] = MXFP8Linear(K, N, bias=False, dtype=torch.bfloat16, device="meta")
        return model

    with pytest.raises(hyperdryrun.SimulationError) as info:
        _trace(None, torch.bfloat16, parallelize_fn=parallelize, cuda=CudaRuntime(gpu="h100-80gb"))
    message = str(info.value.error)
    assert "\n" not in message
    assert message.startswith("gpu='h100-80gb' (sm90): torchao 0.18.0's MXFP8 cast triton_to_mxfp8_dim0 runs")


def test_capability_patches_answer_as_the_preset_and_are_undone():
    from hyperdryrun.patches import PatchSet

    float8 = pytest.importorskip("torchtitan.components.quantization.float8")
    original = float8.has_cuda_capability
    for sm, float8_ok, mx_ok in (((8, 0), False, False), ((9, 0), True, False), ((10, 0), True, True)):
        with PatchSet(ao_compat.capability_patches(sm)):
            assert float8.has_cuda_capability(8, 9) is float8_ok
            assert float8.has_cuda_capability(10, 0) is mx_ok
            assert float8.has_rocm_capability(9, 4) is False
    assert float8.has_cuda_capability is original
