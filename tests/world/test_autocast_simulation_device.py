"""An autocast region opened for the simulation device's type in a CUDA-target world is CUDA's region.

torchtitan's MoE router computes its gate under ``torch.autocast(x.device.type, dtype=torch.float32)``: on a GPU
``x.device.type`` is "cuda" and CUDA autocast runs the gate's linear in fp32 (its ``lower_precision_fp`` list with
fp32 as the autocast dtype: both operands cast to fp32 copies). In a dry run the simulated tensors are "cpu", and
CPU autocast refuses fp32 ("CPU Autocast only supports dtypes of torch.bfloat16, torch.float16 currently") and runs
the region without autocast, so the gate ran in bf16 and its fp32 copies were missing. The bytes below are derived
by hand from the shapes and dtypes.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from hyperdryrun.world import SimulatedWorld

T, D, E = 32, 64, 8  # tokens, model dim, experts
BF16, FP32 = 2, 4
X_FP32 = T * D * FP32  # 8192: the fp32 copy of the bf16 activations, saved for the weight's gradient
W_FP32 = (
    E * D * FP32
)  # 2048: the fp32 copy of the bf16 gate weight (not cached: autocast caches fp32 leaves only)
SCORES_FP32 = T * E * FP32  # 1024
SCORES_BF16 = T * E * BF16  # 512


def _router(target_device: str, region) -> dict:
    """The gate of a router on bf16 activations and a bf16 weight (FSDP's unsharded mixed-precision parameter),
    tracked from an empty device: bytes at the region's peak, after it, and the scores' dtype."""
    with SimulatedWorld(target_device=target_device, simulation_device="cpu") as world, world.fake():
        x = torch.randn(T, D, dtype=torch.bfloat16)
        w = torch.randn(E, D, dtype=torch.bfloat16, requires_grad=True)
        tracker = world.track(capture_stacks=False)
        tracker.start()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a CPU target's CPU autocast warns that it disables itself
            with region(x):
                scores = F.linear(x, w)
                inside = torch.is_autocast_enabled("cuda")
        after, peak = tracker.current, tracker.peak
        tracker.stop()
        return {"dtype": scores.dtype, "after": after, "peak": peak, "cuda_enabled": inside}


def test_a_router_gate_under_autocast_of_its_device_type_runs_fp32_as_on_a_gpu():
    got = _router("cuda", lambda x: torch.autocast(x.device.type, dtype=torch.float32))
    assert got["dtype"] == torch.float32 and got["cuda_enabled"]
    # the linear holds both copies and its output; the weight's copy is freed after it, x's is saved for backward
    assert got["peak"] == X_FP32 + W_FP32 + SCORES_FP32 == 11264
    assert got["after"] == X_FP32 + SCORES_FP32 == 9216


def test_a_cpu_target_keeps_cpu_autocast_which_runs_the_gate_in_bf16():
    got = _router("cpu", lambda x: torch.autocast(x.device.type, dtype=torch.float32))
    assert got["dtype"] == torch.bfloat16
    assert got["peak"] == got["after"] == SCORES_BF16  # no copies: the derivation above is not vacuous


def test_a_disabled_region_of_the_simulation_device_type_disables_cuda_autocast():
    def region(x):
        import contextlib

        stack = contextlib.ExitStack()
        stack.enter_context(torch.autocast("cuda", dtype=torch.bfloat16))
        stack.enter_context(torch.autocast(x.device.type, enabled=False))
        return stack

    got = _router("cuda", region)
    assert got["dtype"] == torch.bfloat16 and not got["cuda_enabled"]
    assert got["peak"] == got["after"] == SCORES_BF16


def test_the_regions_restore_the_autocast_state():
    before = (
        torch.is_autocast_enabled("cpu"),
        torch.get_autocast_dtype("cpu"),
        torch.is_autocast_enabled("cuda"),
    )
    _router("cuda", lambda x: torch.autocast(x.device.type, dtype=torch.float32))
    after = (
        torch.is_autocast_enabled("cpu"),
        torch.get_autocast_dtype("cpu"),
        torch.is_autocast_enabled("cuda"),
    )
    assert before == after
