"""FlexAttention for a CUDA target, as the compiled kernels allocate (torch 2.13, Inductor's flex templates).

On a GPU, ``torch.compile(create_block_mask)`` is one fused Inductor graph and ``torch.compile(flex_attention)`` a
Triton template; on fake tensors neither can run (:mod:`hyperdryrun.world.compile` runs them eagerly), and the eager
code would count what the compiled kernels never allocate (create_block_mask's dense B x H x Q x KV mask) or refuse
to run (``FlexAttention does not support backward on CPU`` on a CPU simulation device). So:

- compiled ``create_block_mask``: the eager code runs with the tracker paused and its BlockMask tensors are then
  allocated as one task, ``create_block_mask``: ``kv_num_blocks``/``q_num_blocks`` int32 ``(B, H, n_blocks)`` and
  ``kv_indices``/``q_indices`` int32 ``(B, H, Q_BLOCKS, KV_BLOCKS)``, plus the ``full_*`` ones with
  ``separate_full_blocks`` (the eager graph's outputs, which Inductor's graph returns too);
- ``flex_attention`` forward: torch's ``flex_attention`` HOP under the fake mode (its registered fake
  implementation, the shapes Inductor's lowering allocates): ``out`` (B, Hq, L, Ev) in the query dtype, ``logsumexp``
  and ``max_scores`` (B, Hq, L) fp32; saved for backward as the AOT partition of the compiled region saves them:
  query, key, value, out, logsumexp (and the block mask's tensors); max_scores is dropped after the call unless
  selective activation checkpointing caches the HOP's outputs;
- backward: Inductor's ``delta`` (B, Hq, L) fp32 for the call, then torch's ``flex_attention_backward`` HOP: grad
  query (B, Hq, L, E), grad key (B, Hkv, S, E) and grad value (B, Hkv, S, Ev) (GQA: the kernel writes the KV heads'
  gradients directly).

Called without ``torch.compile`` on a GPU, flex_attention runs an unfused path that materialises the scores; that
path is not modelled (the compiled kernels' bytes are counted, and a limitation line says so).
"""

from __future__ import annotations

import collections
import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.attention.flex_attention as flex_module
from torch._higher_order_ops.flex_attention import flex_attention as flex_attention_hop
from torch._higher_order_ops.flex_attention import flex_attention_backward as flex_attention_backward_hop

from hyperdryrun.patches import Patch

CREATE_BLOCK_MASK_OP = "create_block_mask"


class KernelTask:
    """A compiled kernel as the tracker sees it: one task named ``name`` whose outputs are its new blocks."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __str__(self) -> str:
        return self.name


_CREATE_BLOCK_MASK = KernelTask(CREATE_BLOCK_MASK_OP)
_FLEX_BACKWARD_DELTA = KernelTask("flex_attention_backward")


def _active_tracker(compiled: Any) -> Any:
    tracker = compiled.tracker()
    return tracker if tracker is not None and tracker.active else None


def block_mask_tensors(block_mask: flex_module.BlockMask) -> list[tuple[str, torch.Tensor]]:
    """The BlockMask's tensors by attribute name (the ones ``BlockMask._flatten`` treats as tensor leaves)."""
    out = []
    for attr in flex_module.BlockMask._TENSOR_ATTRS:
        value = getattr(block_mask, attr)
        if isinstance(value, torch.Tensor):
            out.append((attr, value))
    return out


class _FlexAttentionKernels(torch.autograd.Function):
    """flex_attention forward and backward with the compiled CUDA kernels' outputs and saved tensors."""

    @staticmethod
    def forward(
        ctx: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        score_mod: Any,
        block_mask: tuple,
        scale: float,
        kernel_options: dict,
        compiled: Any,
        mask_mod_other_buffers: tuple,
        *score_mod_other_buffers: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ctx.set_materialize_grads(False)
        ctx.compiled = compiled
        with torch._C._AutoDispatchBelowAutograd():
            out, logsumexp, max_scores = flex_attention_hop(
                query,
                key,
                value,
                score_mod,
                block_mask,
                scale,
                kernel_options,
                tuple(score_mod_other_buffers),
                tuple(mask_mod_other_buffers),
            )
        ctx.mark_non_differentiable(max_scores)
        positions = [i for i, x in enumerate(block_mask) if isinstance(x, torch.Tensor)]
        ctx.block_mask = tuple(None if i in positions else x for i, x in enumerate(block_mask))
        ctx.block_mask_positions = positions
        ctx.score_mod, ctx.scale, ctx.kernel_options = score_mod, scale, kernel_options
        ctx.n_score_buffers = len(score_mod_other_buffers)
        ctx.mask_mod_other_buffers = mask_mod_other_buffers
        ctx.save_for_backward(
            query,
            key,
            value,
            out,
            logsumexp,
            *(block_mask[i] for i in positions),
            *score_mod_other_buffers,
        )
        return out, logsumexp, max_scores

    @staticmethod
    def backward(ctx: Any, grad_out: Any, grad_logsumexp: Any, grad_max_scores: Any) -> tuple:
        saved = ctx.saved_tensors
        query, key, value, out, logsumexp = saved[:5]
        n_mask = len(ctx.block_mask_positions)
        block_mask = list(ctx.block_mask)
        for i, t in zip(ctx.block_mask_positions, saved[5 : 5 + n_mask]):
            block_mask[i] = t
        score_mod_other_buffers = tuple(saved[5 + n_mask :])
        batch, heads, seq_len = query.shape[:3]
        # Inductor's flex_attention_backward lowering realises delta = sum(out * grad_out, -1) in fp32 for the
        # backward template, then frees it.
        tracker = _active_tracker(ctx.compiled)
        if tracker is not None:
            tracker.begin_op()
        delta = None
        try:
            delta = torch.empty((batch, heads, seq_len), dtype=torch.float32, device=query.device)
        finally:
            if tracker is not None:
                tracker.end_op(_FLEX_BACKWARD_DELTA, (), {}, delta)
        with torch._C._AutoDispatchBelowAutograd():
            grad_query, grad_key, grad_value, grad_buffers = flex_attention_backward_hop(
                query,
                key,
                value,
                out,
                logsumexp,
                grad_out,
                grad_logsumexp,
                ctx.score_mod,
                None,
                tuple(block_mask),
                ctx.scale,
                ctx.kernel_options,
                score_mod_other_buffers,
                tuple(ctx.mask_mod_other_buffers),
            )
        del delta
        return grad_query, grad_key, grad_value, None, None, None, None, None, None, *grad_buffers


def flex_patches(compiled: Any) -> list[Patch]:
    """The patches that model compiled FlexAttention on the simulation device (``compiled``: the world's
    :class:`~hyperdryrun.world.compile.CompiledCode`, which knows the tracker and the compiled call sites)."""
    simulation_device = compiled.simulation_device
    original_validate = flex_module._validate_device
    original_create_mask = flex_module.create_mask
    original_convert = flex_module._convert_mask_to_block_mask
    original_sparse = flex_module._create_sparse_block_from_block_mask
    create_block_mask_code = flex_module.create_block_mask.__code__
    flex_attention_code = flex_module.flex_attention.__code__

    def validate_device(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        if query.device.type == simulation_device and simulation_device != "cuda":
            return  # the target is CUDA, where FlexAttention has a backward
        original_validate(query, key, value)

    def in_compiled_create_block_mask() -> bool:
        return _active_tracker(compiled) is not None and compiled.called_compiled(
            sys._getframe(2), create_block_mask_code
        )

    def create_mask(*args: Any, **kwargs: Any) -> torch.Tensor:
        if not in_compiled_create_block_mask():
            return original_create_mask(*args, **kwargs)
        with _active_tracker(compiled).paused():
            return original_create_mask(*args, **kwargs)

    def convert_mask_to_block_mask(*args: Any, **kwargs: Any) -> Any:
        if not in_compiled_create_block_mask():
            return original_convert(*args, **kwargs)
        with _active_tracker(compiled).paused():
            return original_convert(*args, **kwargs)

    def create_sparse_block_from_block_mask(*args: Any, **kwargs: Any) -> flex_module.BlockMask:
        if not in_compiled_create_block_mask():
            return original_sparse(*args, **kwargs)
        tracker = _active_tracker(compiled)
        with tracker.paused():
            block_mask = original_sparse(*args, **kwargs)
        tensors = block_mask_tensors(block_mask)
        fresh: list[torch.Tensor] = []
        tracker.begin_op()
        try:
            fresh = [torch.empty_like(t, memory_format=torch.contiguous_format) for _, t in tensors]
        finally:
            tracker.end_op(_CREATE_BLOCK_MASK, (), {}, fresh)
        for (attr, _), t in zip(tensors, fresh):
            setattr(block_mask, attr, t)
        return block_mask

    def flex_attention_kernels(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        score_mod: Any,
        block_mask: tuple,
        scale: float,
        kernel_options: dict,
        score_mod_other_buffers: tuple = (),
        mask_mod_other_buffers: tuple = (),
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if torch.compiler.is_dynamo_compiling():
            # dynamo traces torch's HOP into the region's graph; Inductor lowers it (compile_fx's flex lowering)
            # (dynamo lifts the score_mod/mask_mod buffers itself: torch's call passes seven arguments)
            return flex_attention_hop(query, key, value, score_mod, block_mask, scale, kernel_options)
        if not compiled.called_compiled(sys._getframe(1), flex_attention_code):
            compiled.eager_flex_calls += 1
        return _FlexAttentionKernels.apply(
            query,
            key,
            value,
            score_mod,
            block_mask,
            scale,
            kernel_options,
            compiled,
            tuple(mask_mod_other_buffers),
            *score_mod_other_buffers,
        )

    why_block_mask = (
        "torch 2.13 create_block_mask materialises the dense (B, H, Q, KV) bool mask when run eagerly; compiled, "
        "Inductor fuses the mask_mod into the block reduction and only the BlockMask tensors are allocated"
    )
    original_warn_once = flex_module._warn_once

    def warn_once(warning_id: str, message: str, category: type[Warning] = UserWarning) -> None:
        if warning_id != "flex_attention_performance":
            original_warn_once(warning_id, message, category)

    return [
        Patch(
            flex_module,
            "_warn_once",
            warn_once,
            reason="torch 2.13 warns that flex_attention without torch.compile runs unfused; in a dry run compiled "
            "calls run eagerly by design, so the warning would be wrong (eager calls get a limitation line)",
        ),
        Patch(
            flex_module,
            "_validate_device",
            validate_device,
            reason="torch 2.13 flex_attention refuses backward for CPU tensors ('FlexAttention does not support "
            "backward on CPU'); the CPU simulation device stands for a CUDA target, which has one",
        ),
        Patch(flex_module, "create_mask", create_mask, reason=why_block_mask),
        Patch(flex_module, "_convert_mask_to_block_mask", convert_mask_to_block_mask, reason=why_block_mask),
        Patch(
            flex_module,
            "_create_sparse_block_from_block_mask",
            create_sparse_block_from_block_mask,
            reason=why_block_mask,
        ),
        Patch(
            flex_module,
            "flex_attention_hop",
            flex_attention_kernels,
            reason="torch 2.13 flex_attention calls the flex_attention HOP, whose autograd rule saves max_scores "
            "and traces score_mod graphs on the fake tensors; the compiled CUDA kernels save query, key, value, "
            "out and logsumexp and their backward allocates delta, dq, dk and dv",
        ),
    ]


# ------------------------------------------------------------------------------------ inside a compiled region
_LIBRARY = "hyperdryrun_flex"


def _dense_like(size: list[int], strides: list[int]) -> list[int]:
    """Dense strides for ``size`` that keep the dimension order of ``strides`` with the last dimension innermost:
    the layout Inductor's flex templates write (torch 2.11 to 2.14 ``torch/_inductor/kernel/flex/common.py``
    ``infer_dense_strides``)."""
    n = len(size)
    order = sorted(range(n), key=lambda d: (strides[d], -d))
    order.remove(n - 1)
    order.insert(0, n - 1)
    out = [0] * n
    step = 1
    for d in order:
        out[d] = step
        step *= max(int(size[d]), 1)
    return out


def _empty_dense_like(size: list[int], like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty_strided(size, _dense_like(size, list(like.stride())), dtype=dtype, device=like.device)


def _forward_buffers(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, reads: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    batch, heads, seq_len = query.shape[:3]
    logsumexp = torch.empty((batch, heads, seq_len), dtype=torch.float32, device=query.device)
    max_scores = torch.empty((batch, heads, seq_len), dtype=torch.float32, device=query.device)
    out = _empty_dense_like([batch, heads, seq_len, value.shape[-1]], query, query.dtype)
    return out, logsumexp, max_scores


def _backward_buffers(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    delta: torch.Tensor,
    reads: list[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    batch = query.shape[0]
    grad_query = _empty_dense_like(list(query.shape), query, query.dtype)
    grad_value = _empty_dense_like([batch, *value.shape[1:]], value, value.dtype)
    grad_key = _empty_dense_like([batch, *key.shape[1:]], key, key.dtype)
    return grad_query, grad_key, grad_value


def _ir_tensors(values: Any) -> list[Any]:
    from torch._inductor import ir

    return [v for v in values if isinstance(v, ir.TensorBox)]


@contextlib.contextmanager
def cuda_flex_lowerings(lowered: collections.Counter) -> Iterator[None]:
    """Inductor's lowerings of the ``flex_attention`` and ``flex_attention_backward`` HOPs as their CUDA Triton
    templates allocate, for a graph lowered on this CPU host (whose own lowering is the C++ template, and no
    backward); both restored on exit.

    torch 2.11 to 2.14 ``torch/_inductor/kernel/flex/flex_attention.py``: the CUDA forward allocates
    ``logsumexp`` and ``max_scores`` (B, Hq, L) fp32 and the template's output ``out`` (B, Hq, L, Ev) in the query
    dtype, strided like the query; the backward realises ``delta = sum(out * grad_out, -1)`` in fp32 (Inductor's
    own pointwise and reduction lowerings, kept here), then allocates ``grad_query`` like the query, and the
    template writes ``grad_key``/``grad_value`` (Bq, Hkv, S, E) like key and value (summed over the batch when the
    key's batch is broadcast). Here each template is one extern call (an op of a scoped library whose fake
    implementation allocates those outputs) that reads the tensors the template reads, so their lifetimes are
    the template's. ``lowered`` counts the calls lowered, by HOP name."""
    import math

    from torch._higher_order_ops.flex_attention import flex_attention_backward as backward_hop
    from torch._inductor import ir
    from torch._inductor import lowering as inductor_lowering

    aten, prims = torch.ops.aten, torch.ops.prims
    lowerings = inductor_lowering.lowerings
    library = torch.library.Library(_LIBRARY, "DEF")
    try:
        library.define(
            "flex_attention(Tensor query, Tensor key, Tensor value, Tensor[] reads) -> (Tensor, Tensor, Tensor)"
        )
        library.define(
            "flex_attention_backward(Tensor query, Tensor key, Tensor value, Tensor delta, Tensor[] reads) -> "
            "(Tensor, Tensor, Tensor)"
        )
        for name, fn in (
            ("flex_attention", _forward_buffers),
            ("flex_attention_backward", _backward_buffers),
        ):
            library.impl(name, fn, "CompositeExplicitAutograd")
            torch.library.register_fake(f"{_LIBRARY}::{name}", fn, lib=library)
        forward_op = getattr(torch.ops, _LIBRARY).flex_attention.default
        backward_op = getattr(torch.ops, _LIBRARY).flex_attention_backward.default

        def forward(
            query: Any,
            key: Any,
            value: Any,
            subgraph: Any,
            block_mask: Any,
            scale: Any,
            kernel_options: Any,
            score_mod_other_buffers: Any,
            mask_mod_other_buffers: Any,
        ) -> Any:
            lowered["flex_attention"] += 1
            reads = _ir_tensors([*block_mask, *score_mod_other_buffers, *mask_mod_other_buffers])
            outputs = ir.FallbackKernel.create(forward_op, query, key, value, reads)
            return tuple(ir.TensorBox.create(x) for x in outputs)

        def backward(*args: Any) -> Any:
            (query, key, value, out, logsumexp, grad_out, grad_logsumexp, _fw, _joint, block_mask) = args[:10]
            score_mod_other_buffers, mask_mod_other_buffers = args[12], args[13]
            lowered["flex_attention_backward"] += 1
            delta = lowerings[aten.sum](lowerings[aten.mul](out, grad_out), axis=-1)
            delta = lowerings[prims.convert_element_type](delta, torch.float32)
            if grad_logsumexp is not None:
                scaled = lowerings[aten.mul](grad_logsumexp, 1 / math.log(2))
                delta = lowerings[aten.sub](delta, ir.ExternKernel.require_contiguous(scaled))
            delta = ir.ExternKernel.require_contiguous(delta)
            delta.realize()
            reads = _ir_tensors(
                [logsumexp, grad_out, *block_mask, *score_mod_other_buffers, *mask_mod_other_buffers]
            )
            grad_query, grad_key, grad_value = (
                ir.TensorBox.create(x)
                for x in ir.FallbackKernel.create(backward_op, query, key, value, delta, reads)
            )
            if key.get_size()[0] != query.get_size()[0]:
                grad_key = lowerings[aten.sum](grad_key, axis=0, keepdims=True)
                grad_value = lowerings[aten.sum](grad_value, axis=0, keepdims=True)
            return grad_query, grad_key, grad_value, tuple(None for _ in score_mod_other_buffers)

        saved = {op: lowerings[op] for op in (flex_attention_hop, backward_hop)}
        lowerings[flex_attention_hop], lowerings[backward_hop] = forward, backward
        try:
            yield
        finally:
            lowerings.update(saved)
    finally:
        library._destroy()
