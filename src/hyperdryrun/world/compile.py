"""Compiled code in a simulated world: no compiled kernel ever runs on fake data.

Inductor and Triton kernels read and write tensors' data pointers, which fake tensors do not have (a compiled
``create_block_mask`` on fake tensors dies in a segmentation fault). :class:`CompiledCode` therefore puts the
compiler in torch's ``force_eager`` stance for the whole simulation: every ``torch.compile`` region runs its Python
code eagerly on the fake tensors. Regions torch has a fake path for are modelled as their compiled CUDA kernels
(FlexAttention, :mod:`hyperdryrun.compat.torch_flex`); every other region entered is named in a limitation line, since its
eager temporaries and saved tensors stand in for Inductor's fused ones.

It also registers, for the world's fake-mode subclass, the rule each higher-order operator has for
``FakeTensorMode`` (torch looks HOP rules up by the exact mode class), and undoes all of it on exit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from types import CodeType, FrameType
from typing import Any

import torch

from hyperdryrun.compat import torch_compile
from hyperdryrun.compat.torch_compile import TORCH_INTERNAL_REGIONS
from hyperdryrun.patches import Patch, PatchSet

MODELLED_REGIONS = {
    "torch.nn.attention.flex_attention.create_block_mask": "create_block_mask",
    "torch.nn.attention.flex_attention.flex_attention": "flex_attention",
}
"""Compiled functions (module.qualname) modelled as their CUDA kernels for a CUDA target (hyperdryrun.compat.torch_flex)."""


def region_name(fn: Any) -> str:
    """``module.qualname`` of a compiled function; ``<Class> module`` for a compiled module (``nn.Module.compile``
    compiles its bound ``_call_impl``, ``torch.compile(module)`` its ``forward``)."""
    owner = getattr(fn, "__self__", fn)
    if isinstance(owner, torch.nn.Module):
        return f"{type(owner).__name__} module"
    target = getattr(fn, "__func__", fn)
    module = getattr(target, "__module__", None) or "?"
    return f"{module}.{getattr(target, '__qualname__', type(target).__name__)}"


class CompiledCode:
    """Context: ``torch.compile`` regions run eagerly, HOPs get the world's fake-mode rules, FlexAttention is
    modelled for a CUDA target. ``regions`` counts the compiled regions entered, by name."""

    def __init__(
        self,
        target_device: str,
        simulation_device: str,
        mode_class: type,
        tracker: Callable[[], Any],
    ) -> None:
        self.target_device, self.simulation_device = target_device, simulation_device
        self.mode_class = mode_class
        self.tracker = tracker
        self.regions: dict[str, int] = {}
        self.eager_flex_calls = 0
        """flex_attention calls not compiled by the user (on a GPU: the unfused path, modelled as compiled)."""
        self._wrapper_codes: set[CodeType] = set()
        self._stack: contextlib.ExitStack | None = None

    @property
    def models_flex(self) -> bool:
        return self.target_device == "cuda"

    def __enter__(self) -> CompiledCode:
        import torch._dynamo.eval_frame as eval_frame

        stack = contextlib.ExitStack()
        self._stack = stack
        try:
            stack.enter_context(torch.compiler.set_stance("force_eager"))
            stack.enter_context(PatchSet([self._recording_patch(eval_frame)]))
            stack.enter_context(_hop_rules(self.mode_class))
            if self.models_flex:
                from hyperdryrun.compat.torch_flex import flex_patches

                stack.enter_context(PatchSet(flex_patches(self)))
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()

    def _recording_patch(self, eval_frame: Any) -> Patch:
        regions, wrapper_codes = self.regions, self._wrapper_codes

        def on_compiled_call(caller: FrameType) -> None:
            # The caller is dynamo's compile wrapper; ``fn`` is the function it compiles (a free variable of the
            # wrapper in torch 2.13, present in its frame's locals).
            wrapper_codes.add(caller.f_code)
            name = region_name(caller.f_locals.get("fn"))
            if name not in TORCH_INTERNAL_REGIONS:
                regions[name] = regions.get(name, 0) + 1

        return torch_compile.stance_recording_patch(eval_frame, on_compiled_call)

    def called_compiled(self, frame: Any, code: CodeType) -> bool:
        """Whether the nearest frame running ``code`` above ``frame`` was called by a ``torch.compile`` wrapper
        (the function was compiled by the user, so on a GPU it would run as Inductor's kernels)."""
        while frame is not None and frame.f_code is not code:
            frame = frame.f_back
        return frame is not None and frame.f_back is not None and frame.f_back.f_code in self._wrapper_codes

    @property
    def limitations(self) -> list[str]:
        eager = sorted(name for name in self.regions if not (self.models_flex and name in MODELLED_REGIONS))
        out = []
        if eager:
            out.append(
                "torch.compile regions ran eagerly on the fake tensors (no compiled kernel is executed in a dry "
                f"run): {', '.join(eager)}; their eager temporaries and saved tensors are counted, not Inductor's "
                "fused ones"
            )
        modelled = sorted(
            {MODELLED_REGIONS[n] for n in self.regions if self.models_flex and n in MODELLED_REGIONS}
        )
        if modelled:
            out.append(
                f"compiled {' and '.join(modelled)} modelled as Inductor's CUDA kernels: their outputs and saved "
                "tensors (torch's fake implementations; the backward's fp32 delta), not the kernels' on-chip scratch"
            )
        if self.eager_flex_calls:
            out.append(
                f"flex_attention ran without torch.compile in {self.eager_flex_calls} call(s): on a GPU that is the "
                "unfused path, which materialises the attention scores; counted as the compiled kernels"
            )
        return out


@contextlib.contextmanager
def _hop_rules(mode_class: type) -> Iterator[None]:
    """Every higher-order operator's ``FakeTensorMode`` rule for ``mode_class``, HOPs passing through the value-rule
    mode (:class:`~hyperdryrun.world.values.ValueRuleMode`) to it (:func:`hyperdryrun.compat.torch_compile.hop_rules`)."""
    from hyperdryrun.world.values import ValueRuleMode

    with torch_compile.hop_rules(mode_class, ValueRuleMode):
        yield
