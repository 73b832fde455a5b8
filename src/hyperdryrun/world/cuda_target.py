"""The CUDA target: which GPU and torch build the dry run follows, and where its kernels differ from the CPU's.

``DIFFERENCES`` is the audited list of places where a CPU kernel allocates or saves for backward differently from the
CUDA kernel of the same op; ``hyperdryrun audit-kernels`` prints it and, with ``--reference``, re-runs the audit of
:mod:`hyperdryrun.audit` (ops, new storages and saved tensors of common layers against a reference recorded on fake
"cuda" with a CUDA build of torch 2.13). :class:`CudaTarget` names what the kernel choice depends on and no GPU-less
machine can observe: the GPU (a :mod:`hyperdryrun.world.gpus` preset) and the cuDNN and CUDA of the torch build.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hyperdryrun.world.gpus import DEFAULT_GPU, GpuPreset, gpu_preset


@dataclass(frozen=True)
class KernelDifference:
    """One place where a CPU kernel allocates or saves differently from the CUDA kernel of the same op."""

    layer: str
    cpu: str
    cuda: str
    handling: str
    handled_by: tuple[str, ...] = ()
    """Names of the patches (``Patch.name``) or fixed-up ops (``OUTPUT_FIXUPS``) that model it."""
    audit_layers: tuple[str, ...] = ()
    """Layers of the kernel audit's catalogue (``hyperdryrun.audit.LAYERS``) in which the audit finds it without
    ``handled_by``."""


def cudnn_version_text(version: int) -> str:
    """``92000`` -> ``9.20``, ``91002`` -> ``9.10.2``, ``8906`` -> ``8.9.6`` (cuDNN 9 counts minors by 100s)."""
    major, rest = divmod(version, 10000) if version >= 10000 else divmod(version, 1000)
    minor, patch = divmod(rest, 100)
    return f"{major}.{minor}" + (f".{patch}" if patch else "")


def cuda_version_text(version: int) -> str:
    """``13000`` -> ``13.0``, ``12080`` -> ``12.8`` (``CUDA_VERSION``: major * 1000 + minor * 10)."""
    return f"{version // 1000}.{version % 1000 // 10}"


def sm_text(sm: tuple[int, int] | list[int]) -> str:
    """``(9, 0)`` -> ``sm90``."""
    return f"sm{sm[0]}{sm[1]}"


@dataclass(frozen=True)
class CudaTarget:
    """The CUDA GPU and torch build whose kernel choice is simulated (SDPA depends on both)."""

    gpu: GpuPreset = field(default_factory=lambda: gpu_preset(DEFAULT_GPU))
    cudnn: int = 92000
    """Runtime cuDNN version as torch reports it (``torch.backends.cudnn.version()``); 9.20.0 ships with the
    torch 2.13.0 cu130 wheel (nvidia-cudnn-cu13 9.20.0.48)."""
    cuda: int = 13000
    """CUDA version the torch build was compiled with (13.0 for the default PyPI wheel)."""

    def __post_init__(self) -> None:
        if self.gpu.compute_capability is None:
            raise ValueError(
                f"gpu={self.gpu.name!r} is not a CUDA GPU the dry run models: {self.gpu.not_modelled}"
            )

    @property
    def sm(self) -> tuple[int, int]:
        """The GPU's compute capability: (8, 0) A100, (9, 0) H100/H200, (10, 0) B200."""
        assert self.gpu.compute_capability is not None  # __post_init__
        return self.gpu.compute_capability

    def as_dict(self) -> dict:
        """What decides the kernel choice, JSON-ready (lists, not tuples): a reference file's ``cuda_target``."""
        return {"sm": list(self.sm), "cudnn": self.cudnn, "cuda": self.cuda}

    def describe(self) -> str:
        """One line for people: ``sm90 (h100-80gb), cuDNN 9.20, CUDA 13.0``."""
        return (
            f"{sm_text(self.sm)} ({self.gpu.name}), cuDNN {cudnn_version_text(self.cudnn)}, "
            f"CUDA {cuda_version_text(self.cuda)}"
        )

    @property
    def prefers_cudnn(self) -> bool:
        """torch 2.13 ``check_prefer_cudnn_attention``: cuDNN SDPA goes first on sm90/sm10x with cuDNN > 9.15
        (:func:`hyperdryrun.compat.torch_sdpa.prefers_cudnn`)."""
        from hyperdryrun.compat.torch_sdpa import prefers_cudnn

        return prefers_cudnn(self.sm, self.cudnn, self.cuda)


DEFAULT_CUDA_TARGET = CudaTarget()

MX_CAST_KERNELS = (
    "triton_to_mxfp8_dim0",
    "triton_to_mxfp8_dim1",
    "mxfp8_quantize_cuda",
    "triton_mx_block_rearrange",
)
"""torchao 0.18's MXFP8 cast kernels that ``compat/torchao.py`` stands in for (patched only where torchao's MX
formats are loaded)."""

DIFFERENCES: list[KernelDifference] = [
    KernelDifference(
        "storage allocation",
        "CPU allocator: exact bytes (64-byte aligned)",
        "CUDA caching allocator: every block rounded up to 512 B",
        "each block's size is rounded to 512 B when target_device is cuda (the tracker's alignment)",
    ),
    KernelDifference(
        "F.scaled_dot_product_attention (backend)",
        "_fused_sdp_choice_cpp: _scaled_dot_product_flash_attention_for_cpu for any float dtype, masks allowed; "
        "a CUDA build without a GPU picks math (S x S scores): no device properties",
        "select_sdp_backend (sdp_utils.cpp): cuDNN first on sm90/sm10x with cuDNN > 9.15 (bf16/fp16, head_dim "
        "<= 128 and % 8, GQA, masks), then flash (bf16/fp16, no mask, head_dim <= 256, GQA), then "
        "memory-efficient (fp32 too, masks, no GQA in 2.13), then math",
        "cuda_sdpa_backend applies the CUDA rules for CudaTarget (default h100-80gb: sm90, cuDNN 9.20, CUDA 13.0) "
        "and the chosen fused op is called, so its outputs and saved tensors are recorded",
        ("scaled_dot_product_attention",),
        ("sdpa_causal_bf16_mha", "sdpa_causal_bf16_gqa", "sdpa_causal_fp32_mha", "sdpa_bool_mask_bf16"),
    ),
    KernelDifference(
        "F.scaled_dot_product_attention (composite)",
        "flash_for_cpu takes the mask as is and any head_dim",
        "attention.cpp: bool mask -> additive mask (logical_not + where; a 1-element device scalar, a host one "
        "for cuDNN); efficient pads an unaligned mask's last dim to 8; flash pads head_dim to a multiple of 8",
        "the same ops are issued on the simulation device",
        ("scaled_dot_product_attention",),
        ("sdpa_causal_bf16_hd100", "sdpa_bool_mask_fp32"),
    ),
    KernelDifference(
        "F.dropout (training)",
        "composite _dropout: bernoulli mask of the input's dtype, x * mask / (1-p)",
        "aten.native_dropout: one fused kernel, bool mask saved",
        "dropout is routed to aten.native_dropout",
        ("dropout",),
        ("dropout_bf16", "dropout_fp32"),
    ),
    KernelDifference(
        "F.rms_norm",
        "_fused_rms_norm is the composite on CPU: pow/mean/rsqrt/mul, saving three fp32 input-sized tensors",
        "_fused_rms_norm CUDA kernel: saves input and rstd (fp32, one per row); one _fused_rms_norm_backward",
        "F.rms_norm calls _fused_rms_norm below autograd with the CUDA derivative formula, also for DTensor inputs "
        "(TP/SP: on a GPU the DTensor's device type picks the fused kernel, which DTensor runs on the local shard)",
        ("rms_norm",),
        ("rms_norm_functional_fp32", "rms_norm_functional_bf16", "rms_norm_sequence_parallel_bf16"),
    ),
    KernelDifference(
        "LayerNorm (bf16/fp16)",
        "native_layer_norm returns mean/rstd in the input dtype",
        "native_layer_norm returns mean/rstd in fp32 (accumulate type); autograd saves them",
        "the fake mode returns fp32 mean/rstd for native_layer_norm",
        ("native_layer_norm",),
        ("layernorm_bf16",),
    ),
    KernelDifference(
        "F.logsigmoid",
        "log_sigmoid_forward returns an input-sized buffer, saved for backward",
        "log_sigmoid_forward returns an empty buffer",
        "the fake mode returns an empty buffer for log_sigmoid_forward",
        ("log_sigmoid_forward",),
        ("logsigmoid_fp32",),
    ),
    KernelDifference(
        "softmax / log_softmax (fp16 input, dtype=float32)",
        "input converted to fp32 first (a full-size copy), then _softmax",
        "_softmax(half_to_float=True) reads fp16 directly (SoftMax.cpp, CUDA only)",
        "F.softmax / F.log_softmax with fp16 input and dtype=float32 call the half_to_float kernel",
        ("softmax", "log_softmax"),
        ("softmax_fp16_to_fp32", "log_softmax_fp16_to_fp32"),
    ),
    KernelDifference(
        "optimizer implementation",
        "torch's default on CPU tensors is the per-parameter for-loop",
        "torch's default on CUDA tensors is foreach (whole-list temporaries)",
        "the configured implementation (default foreach, as on CUDA) is passed explicitly; with foreach/fused "
        "unset, _default_to_fused_or_foreach counts the simulation device as a foreach device",
        ("_get_foreach_kernels_supported_devices",),
    ),
    KernelDifference(
        "optimizer implementation (fake parameters)",
        "any fake device: a FakeTensor parameter fails _default_to_fused_or_foreach's type(p) check: for-loop",
        "real CUDA parameters: foreach",
        "FakeTensor counts as a foreach-supported type",
        ("_foreach_supported_types",),
        ("adamw_default", "sgd_default"),
    ),
    KernelDifference(
        "torch.autocast('cuda') (user code)",
        "a CPU-only build disables it with a warning (CUDA not available), so the region runs in fp32; CPU "
        "autocast's own lists differ (cross_entropy_loss, cat, stack listed; sum, softmax, rms_norm not)",
        "AutocastCUDA lists (autocast_mode.cpp/.h): lower_precision_fp, fp32, fp32_set_opt_dtype, "
        "fp32_append_dtype, promote; fp32 weights' low-precision copies cached until the region exits",
        "world/autocast.py: autocast('cuda') stays enabled, carried by CPU autocast; the AutocastCPU kernels are "
        "CUDA's lists (Python kernels with the weight cache) while the world lasts; tested against a hand-derived "
        "block and torch's AutocastCUDA kernels (not part of the CUDA-build reference)",
        ("__init__", "__enter__", "__exit__", "clear_autocast_cache"),
    ),
    KernelDifference(
        "torchao MXFP8 casts (torchao loaded)",
        "torchao 0.18 defines its MXFP8 cast kernels only where Triton runs on an sm100 GPU: on this host they are "
        "missing and MXFP8 training cannot run",
        "Triton/CUDA kernels (mx_formats/kernels.py): an fp8 copy and one e8m0 scale per 32 elements, the scales "
        "rearranged into 128 x 4 blocks",
        "compat/torchao.py: stand-ins allocating each kernel's outputs as its fake kernel sizes them, on a b200 "
        "target; below sm100 they refuse in one line, as the card does",
        (*MX_CAST_KERNELS,),
    ),
    KernelDifference(
        "BatchNorm",
        "native_batch_norm (CPU kernel)",
        "cudnn_batch_norm: the same output and statistics bytes, plus an empty reserve tensor saved; backward "
        "cudnn_batch_norm_backward",
        "not modelled: the bytes agree exactly, only the producing op's name differs",
        (),
        ("batchnorm_train_fp32", "batchnorm_eval_fp32"),
    ),
]
"""Audited differences; every other layer of the audit catalogue agrees exactly (ops, bytes, saved tensors)."""


__all__ = [
    "DEFAULT_CUDA_TARGET",
    "DIFFERENCES",
    "MX_CAST_KERNELS",
    "CudaTarget",
    "KernelDifference",
    "cuda_version_text",
    "cudnn_version_text",
    "sm_text",
]
