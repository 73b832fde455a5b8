"""torchao's float8 and MX training on fake tensors for a CUDA target (tested: torchao 0.18.0, the release the
``hyperdryrun[float8]`` extra pins, on torch 2.13.0; torchtitan 0.3.0's quantization converters).

What runs is torchao's own code: ``Float8Linear`` (tensorwise, rowwise, rowwise_with_gw_hp), its FSDP2 float8
all-gather (``WeightWithDynamicFloat8CastTensor``), ``MXFP8Linear``. Three things depend on the GPU, and a dry run on
a CPU host answers them as the target's compute capability does:

- **The SM checks of torchtitan's converters** (``torchtitan/components/quantization/{float8,mx,nvfp4}.py`` call
  ``has_cuda_capability(8, 9)``, ``(10, 0)`` at config time): :func:`capability_patches` answers them as the target
  GPU preset, so float8 runs on an sm89+ target and is refused, with torchtitan's own message, on an A100 (sm80);
  MXFP8 and NVFP4 need sm100 (B200). Only those modules' names are patched: torchtitan's attention choice
  (``tools.utils.get_cuda_flash_attention_impl``) keeps asking the real machine.
- **torchao's MXFP8 cast kernels.** ``torchao/prototype/mx_formats/kernels.py`` defines its Triton casts
  (``triton_to_mxfp8_dim0``/``_dim1``, ``triton_mx_block_rearrange``) and the CUDA cast (``mxfp8_quantize_cuda``,
  ``torchao::mxfp8_quantize`` in ``_C_mxfp8.so``) only where ``torch.cuda.is_available()`` and the GPU is sm100+
  (``_triton_kernels_available``); elsewhere they are stubs that raise. :func:`mx_kernel_patches` puts in their
  place functions that allocate what each kernel allocates (its outputs, as the kernel's host code and torchao's
  own ``register_fake`` size them), on the simulation device; no values. On a target below sm100 they refuse in one
  line, as torchao's kernels cannot run there.
- **``torch._scaled_mm``** needs nothing: its meta kernel (``torch/_meta_registrations.py``
  ``_check_scaled_mm_sizes``) returns the M x N output the CUDA kernel allocates; the cuBLASLt workspace of the
  tensorwise path is the handle's cuBLAS workspace (unified by default, counted once per handle and stream by the
  tracker, which lists ``_scaled_mm`` among the matmuls). Not modelled: the rowwise CUTLASS kernel's padded copy of
  the input scales when M is not a multiple of 256 (``RowwiseScaledMM.cu``: ``ceil(M / 256) * 256 x 1`` fp32, freed
  with the call) and its CUTLASS workspace (``Gemm::get_workspace_size``; 0 B for the persistent tile scheduler).

Importing torchao 0.18 on a CPU torch logs a warning per CUDA extension it cannot load and two of torch's pytree
deprecation warnings: :func:`quiet_import` imports it with those loggers raised to ERROR (restored after).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any

from hyperdryrun.compat.versions import installed_version
from hyperdryrun.patches import Patch

TESTED_VERSION = "0.18.0"
"""The torchao release this is tested with (the ``hyperdryrun[float8]`` extra pins it)."""

FLOAT8_SM = (8, 9)
"""torchtitan's Float8LinearConverter and Float8GroupedExpertsConverter: ``has_cuda_capability(8, 9)`` (Ada, Hopper,
Blackwell); torch's ``_scaled_mm`` on CUDA needs the same."""
MX_SM = (10, 0)
"""MXFP8/NVFP4 (torchtitan's MXFP8 and NVFP4 converters ``has_cuda_capability(10, 0)``; torchao's MX kernels
``is_sm_at_least_100``; torch's ``_scaled_mm`` with e8m0 block scales runs on sm100 only)."""

_QUANTIZATION_MODULES = (
    "torchtitan.components.quantization.float8",
    "torchtitan.components.quantization.mx",
    "torchtitan.components.quantization.nvfp4",
)
_NOISY_LOGGERS = ("torchao", "torch.utils._pytree")


def torchao_version() -> str | None:
    """The installed torchao's version, or None when it is not installed."""
    return installed_version("torchao")


def untested(version: str | None) -> str | None:
    """A limitation line when the installed torchao is not :data:`TESTED_VERSION` (None when it is or is absent)."""
    if version is not None and version != TESTED_VERSION:
        return f"torchao {version} is not the tested {TESTED_VERSION} (float8/MX training)"
    return None


@contextlib.contextmanager
def quiet_import() -> Iterator[None]:
    """Import torchao (when installed and not yet imported), and run the body, with its CUDA-extension and torch's
    pytree warnings silenced: on a CPU torch torchao 0.18 logs "Failed to load ..._C_cutlass_90a.abi3.so" and
    torch 2.13 warns that torchao's enums (imported with the modules that define them) need no
    ``register_constant``; neither concerns a dry run. Loggers restored after."""
    if torchao_version() is None:
        yield
        return
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with contextlib.suppress(ImportError):
            import torchao  # noqa: F401
            import torchao.float8  # noqa: F401
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _sm_text(sm: tuple[int, int]) -> str:
    return f"sm{sm[0]}{sm[1]}"


def capability_patches(sm: tuple[int, int] | None) -> list[Patch]:
    """torchtitan 0.3.0's quantization converters ask ``has_cuda_capability`` (and float8's
    ``has_rocm_capability``) when they are built, at config time: answered as a GPU of compute capability ``sm``
    (None: a ROCm GPU, which the dry run does not model as a float8 target, answers no CUDA capability)."""
    patches = []
    for name in _QUANTIZATION_MODULES:
        module = sys.modules.get(name)
        if module is None:
            continue

        def cuda(major: int, minor: int) -> bool:
            return sm is not None and sm >= (major, minor)

        def rocm(major: int, minor: int) -> bool:
            return False

        reason = (
            f"torchtitan's {name.rsplit('.', 1)[1]} converter checks the GPU it runs on at config time: answered as "
            f"the target GPU ({_sm_text(sm) if sm else 'no CUDA capability'})"
        )
        if hasattr(module, "has_cuda_capability"):
            patches.append(Patch(module, "has_cuda_capability", cuda, reason))
        if hasattr(module, "has_rocm_capability"):
            patches.append(Patch(module, "has_rocm_capability", rocm, reason))
    return patches


_REFUSALS = ("supported on NVIDIA SM89", "supported on SM100")
"""torchtitan 0.3.0's converters' refusals of a GPU (float8.py, mx.py, nvfp4.py ``ValueError`` messages)."""


def refused_on(err: BaseException, gpu: str, sm: tuple[int, int] | None) -> str:
    """``"gpu='a100-80gb' (sm80) refused, as on the card: "`` when ``err`` is a torchtitan converter's refusal of the
    target GPU (answered by :func:`capability_patches`), else ``""``: the prefix of the one-line error."""
    if isinstance(err, ValueError) and any(text in str(err) for text in _REFUSALS):
        return f"gpu={gpu!r} ({_sm_text(sm) if sm else 'no CUDA capability'}) refused, as on the card: "
    return ""


def import_quantization_modules() -> None:
    """Import torchtitan's quantization converters (so :func:`capability_patches` finds them) quietly."""
    with quiet_import(), contextlib.suppress(ImportError):
        import torchtitan.components.quantization  # noqa: F401


def _quantized_class(cls: type) -> bool:
    return cls.__module__.startswith(("torchao.", "torchtitan.components.quantization"))


def quantized_modules(modules: list[Any]) -> dict[str, int]:
    """How many modules of each float8/MX/NVFP4 training class the models hold (torchao's modules, and torchtitan's
    subclasses of them or of its experts, torchtitan's counted as torchtitan names them), by class name, sorted:
    what a report says was quantized."""
    counts: dict[str, int] = {}
    for root in modules:
        for module in root.modules():
            # the first such class of the MRO: FSDP2's fully_shard makes a subclass (FSDPFloat8Linear)
            cls = next((c for c in type(module).__mro__ if _quantized_class(c)), None)
            if cls is not None:
                counts[cls.__name__] = counts.get(cls.__name__, 0) + 1
    return dict(sorted(counts.items()))


def scaled_mm_patches(sm: tuple[int, int], gpu: str) -> list[Patch]:
    """``torch._scaled_mm`` (what torchao's float8 GEMMs call) refuses a GPU below sm89 on the card (torch 2.13
    ``ScaledBlas.cpp``: "torch._scaled_mm is only supported on CUDA devices with compute capability >= 9.0 or 8.9,
    or ROCm MI300+"); the fake kernel does not ask, so on such a target it refuses in one line. Nothing otherwise."""
    import torch

    if sm >= FLOAT8_SM:
        return []

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise ValueError(
            f"gpu={gpu!r} ({_sm_text(sm)}) refused, as on the card: torch._scaled_mm (float8 GEMMs) is only "
            "supported on CUDA devices with compute capability >= 8.9"
        )

    return [
        Patch(
            torch,
            "_scaled_mm",
            refused,
            f"torch's CUDA _scaled_mm refuses {_sm_text(sm)}; its fake kernel does not",
        )
    ]


# ------------------------------------------------------------------------------------------------ MX kernels
class MXKernelError(ValueError):
    """An MX cast on a target GPU whose kernels torchao does not have (one line)."""


def _refuse(kernel: str, sm: tuple[int, int], gpu: str) -> MXKernelError:
    return MXKernelError(
        f"gpu={gpu!r} ({_sm_text(sm)}): torchao {TESTED_VERSION}'s MXFP8 cast {kernel} runs only on sm100 or later "
        "(mx_formats/kernels.py: _triton_kernels_available needs is_sm_at_least_100, and torch's _scaled_mm takes "
        "e8m0 block scales on sm100 only); choose a B200 (b200)"
    )


def _mx_stand_ins(sm: tuple[int, int], gpu: str) -> dict[str, Callable[..., Any]]:
    """What each of torchao 0.18's MXFP8 cast kernels allocates (its outputs), as functions of its arguments."""
    import torch

    def check(kernel: str) -> None:
        if sm < MX_SM:
            raise _refuse(kernel, sm, gpu)

    def triton_to_mxfp8_dim0(x: Any, inner_block_size: int = 32, scaling_mode: str = "rceil") -> Any:
        # kernels.py triton_to_mxfp8_dim0: a row-major fp8 copy and one uint8 scale per 32 elements of a row
        check("triton_to_mxfp8_dim0")
        rows, cols = x.reshape(-1, x.shape[-1]).shape
        output = torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=x.device)
        scale = torch.empty((rows, cols // inner_block_size), dtype=torch.uint8, device=x.device)
        return (
            output.reshape(x.shape),
            scale.reshape(*x.shape[:-1], scale.shape[-1]).view(torch.float8_e8m0fnu),
        )

    def triton_to_mxfp8_dim1(x: Any, inner_block_size: int = 32, scaling_mode: str = "rceil") -> Any:
        # kernels.py triton_to_mxfp8_dim1: a column-major fp8 copy and one scale per 32 elements of a column
        check("triton_to_mxfp8_dim1")
        rows, cols = x.shape
        output = torch.empty((cols, rows), dtype=torch.float8_e4m3fn, device=x.device)
        scale = torch.empty((cols, rows // inner_block_size, 1), dtype=torch.uint8, device=x.device)
        return output.t(), scale.view(torch.float8_e8m0fnu).squeeze(-1)

    def mxfp8_quantize_cuda(
        x: Any, rowwise: bool = False, colwise: bool = True, scaling_mode: str = "rceil"
    ) -> Any:
        # kernels.py mxfp8_quantize_cuda -> torchao::mxfp8_quantize, sized as its _fake_mxfp8_quantize
        check("mxfp8_quantize_cuda")
        rows, cols = x.shape
        if rowwise:
            out_row = x.new_empty(rows, cols, dtype=torch.float8_e4m3fn)
            scale_row = x.new_empty(rows, cols // 32, 1, dtype=torch.float8_e8m0fnu)
        else:
            out_row = x.new_empty(0, dtype=torch.float8_e4m3fn)
            scale_row = x.new_empty(0, dtype=torch.float8_e8m0fnu)
        if colwise:
            out_col = torch.empty_strided((rows, cols), (1, rows), dtype=torch.float8_e4m3fn, device=x.device)
            scale_col = torch.empty_strided(
                (cols, rows // 32), (1, cols), dtype=torch.float8_e8m0fnu, device=x.device
            )
        else:
            out_col = x.new_empty(0, dtype=torch.float8_e4m3fn)
            scale_col = x.new_empty(0, dtype=torch.float8_e8m0fnu)
        return out_row, out_col, scale_row, scale_col

    def triton_mx_block_rearrange(scale_tensor: Any) -> Any:
        # kernels.py triton_mx_block_rearrange: the scales padded to 128-row x 4-column blocks
        check("triton_mx_block_rearrange")
        rows, cols = scale_tensor.shape
        return scale_tensor.new_empty((-(-rows // 128) * 128, -(-cols // 4) * 4))

    return {
        "triton_to_mxfp8_dim0": triton_to_mxfp8_dim0,
        "triton_to_mxfp8_dim1": triton_to_mxfp8_dim1,
        "mxfp8_quantize_cuda": mxfp8_quantize_cuda,
        "triton_mx_block_rearrange": triton_mx_block_rearrange,
    }


def mx_kernel_patches(sm: tuple[int, int], gpu: str) -> list[Patch]:
    """torchao's MXFP8 cast kernels as the target GPU runs them (see the module docstring), in
    ``torchao.prototype.mx_formats.kernels`` and every loaded torchao module that imported them by name. Nothing
    when torchao's MX formats are not loaded, or when this machine has the real kernels (an sm100 GPU)."""
    kernels = sys.modules.get("torchao.prototype.mx_formats.kernels")
    if kernels is None or getattr(kernels, "_triton_kernels_available", False):
        return []
    stand_ins = _mx_stand_ins(sm, gpu)
    originals = {name: getattr(kernels, name, None) for name in stand_ins}
    patches = []
    for module_name, module in sorted(sys.modules.items()):
        if module is None or not (module_name == "torchao" or module_name.startswith("torchao.")):
            continue
        for name, new in stand_ins.items():
            if originals[name] is not None and module.__dict__.get(name) is originals[name]:
                patches.append(
                    Patch(
                        module,
                        name,
                        new,
                        f"torchao {TESTED_VERSION} defines its MXFP8 kernel {name} only on an sm100 GPU: what it "
                        f"allocates on the target ({gpu}, {_sm_text(sm)})",
                    )
                )
    return patches


__all__ = [
    "FLOAT8_SM",
    "MX_SM",
    "TESTED_VERSION",
    "MXKernelError",
    "capability_patches",
    "import_quantization_modules",
    "mx_kernel_patches",
    "quantized_modules",
    "quiet_import",
    "refused_on",
    "scaled_mm_patches",
    "torchao_version",
    "untested",
]
