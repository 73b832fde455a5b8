"""How a Hugging Face causal LM is parallelized, from outside its code: TP from the model's own plan, AC and FSDP2
per decoder layer (``model.model.layers``) then the root, and MoE routing from the value rules.

TP: the config's ``base_model_tp_plan`` (decoder layers) and the LM class's ``_tp_plan`` (the head) translated to
torch's ``ColwiseParallel`` / ``RowwiseParallel``; sequence and loss parallel are not built (the job config refuses
them), the embedding stays replicated, and ``replicated_with_grad_allreduce`` parameters (Qwen3's q/k norms) stay
plain replicated tensors. MoE: HF's ``eager`` experts loop runs data-dependent ops (``nonzero`` on the expert hits,
``torch.where`` per expert, a ``bool`` of the sentinel check); on fake tensors they are answered from the routing
rule of :mod:`hyperdryrun.world.values`, so the routing scenario sets each expert's token count. The ``grouped_mm``
and ``batched_mm`` kernels have fixed shapes: their bytes do not depend on routing.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.utils._python_dispatch import TorchDispatchMode

from hyperdryrun.models.hf import decoder_layers, experts_modules
from hyperdryrun.parallel.ac import checkpoint_block, chosen_layers
from hyperdryrun.parallel.fsdp import fsdp_enabled, fsdp_mesh, mixed_precision
from hyperdryrun.world.values import ValueRuleError, active_rules

if TYPE_CHECKING:
    from hyperdryrun.parallel.fsdp import FSDPOptions
    from hyperdryrun.parallel.options import ParallelizeOptions
    from hyperdryrun.parallel_dims import ParallelDims

_NONZERO = torch.ops.aten.nonzero.default
_SCALAR = torch.ops.aten._local_scalar_dense.default


def parallelize_hf(model: nn.Module, mesh: Any, dims: ParallelDims, options: ParallelizeOptions) -> nn.Module:
    """TP from the model's own plan, routing from the value rules, then AC, then FSDP2 per decoder layer."""
    if dims.tp > 1:
        apply_hf_tp(model, mesh["tp"])
    apply_hf_routing(model)
    apply_hf_ac(model, options.ac, options.ac_selective)
    if fsdp_enabled(dims, options.fsdp):
        apply_hf_fsdp(model, fsdp_mesh(mesh, dims), options.fsdp)
    return model


def tp_styles(plan: dict[str, str]) -> dict[str, Any]:
    """HF's TP plan (``{module pattern: style name}``) as torch parallel styles; a style not built is an error."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    }
    out: dict[str, Any] = {}
    for pattern, style in plan.items():
        if style == "replicated_with_grad_allreduce":
            continue
        if style not in styles:
            raise ValueError(
                f"TP plan style {style!r} of {pattern!r} is not built (supported: {', '.join(styles)}, "
                "replicated_with_grad_allreduce)"
            )
        out[pattern] = styles[style]()
    return out


def hf_block_tp_plan(block: nn.Module, seq: Any = None) -> dict:
    """A decoder layer's TP plan: the ``layers.*.`` entries of its config's ``base_model_tp_plan`` (``seq`` is
    unused: no sequence parallel)."""
    plan = getattr(block.self_attn.config, "base_model_tp_plan", None) or {}
    return tp_styles({k.removeprefix("layers.*."): v for k, v in plan.items() if k.startswith("layers.*.")})


def apply_hf_tp(model: nn.Module, tp_mesh: Any) -> None:
    """Column/row-wise TP of every decoder layer by its plan, then of the head by the LM class's ``_tp_plan``."""
    from torch.distributed.tensor.parallel import parallelize_module

    for block in decoder_layers(model):
        parallelize_module(block, tp_mesh, hf_block_tp_plan(block))
    parallelize_module(model, tp_mesh, tp_styles(getattr(type(model), "_tp_plan", None) or {}))


def apply_hf_ac(model: nn.Module, mode: str, option: str) -> None:
    """Activation checkpointing of the decoder layers as :func:`hyperdryrun.parallel.ac.apply_ac` does it (the
    same layer positions and op policies)."""
    layers = decoder_layers(model)
    for i in sorted(chosen_layers(len(layers), mode, option)):
        layers[i] = checkpoint_block(layers[i], mode, option)


def apply_hf_fsdp(model: nn.Module, dp_mesh: Any, fsdp: FSDPOptions) -> None:
    """FSDP2 on every decoder layer, then on the root (torchtitan's order; the last layer stays unsharded)."""
    from torch.distributed.fsdp import fully_shard

    mp, layers = mixed_precision(fsdp), decoder_layers(model)
    reshard = fsdp.reshard_after_forward
    for i, block in enumerate(layers):
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard and i < len(layers) - 1)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard)


def apply_hf_routing(model: nn.Module) -> None:
    """Give every HF experts module's forward the routing rule's token counts while it runs on fake tensors."""
    names = {id(m): name for name, m in model.named_modules()}
    for experts in experts_modules(model):
        experts.forward = functools.partial(_routed_forward, experts.forward, names[id(experts)], experts)


def _routed_forward(
    forward: Any, fqn: str, experts: nn.Module, hidden_states: torch.Tensor, top_k_index, *a, **kw
):
    from torch._subclasses.fake_tensor import FakeTensor

    if not isinstance(hidden_states, FakeTensor) or experts.config._experts_implementation != "eager":
        return forward(hidden_states, top_k_index, *a, **kw)
    rules = active_rules()
    if rules is None:
        raise ValueRuleError(f"HF experts {fqn!r} ran on fake tensors outside a run's value rules")
    counts = rules.token_counts(fqn, hidden_states.shape[0], experts.num_experts, top_k_index.shape[-1])
    with ExpertsRoutingMode(fqn, counts):
        return forward(hidden_states, top_k_index, *a, **kw)


class ExpertsRoutingMode(TorchDispatchMode):
    """Answers the data-dependent ops of HF's eager experts loop from per-expert token counts. The loop runs over
    the experts hit (the first ``nonzero``: one row per expert with tokens); each iteration starts with
    ``bool(expert_idx == num_experts)`` (the sentinel: False), indexes by ``expert_idx`` (``.item()``: the expert)
    and takes ``torch.where`` of the expert's mask (a ``nonzero``: its token count)."""

    def __init__(self, fqn: str, counts: list[int]) -> None:
        super().__init__()
        self.fqn = fqn
        self.ids = [e for e, c in enumerate(counts) if c > 0]
        self.counts = [counts[e] for e in self.ids]
        self.expert = -1
        """Position in ``ids`` of the expert the loop is at (-1: before the loop)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            return func(*args, **kwargs)
        except DynamicOutputShapeException:
            if func is not _NONZERO or self.expert >= len(self.ids):
                raise ValueRuleError(self._unexpected(func)) from None
            rows = len(self.ids) if self.expert < 0 else self.counts[self.expert]
            x = args[0]
            return torch.empty((rows, x.dim()), dtype=torch.long, device=x.device)
        except DataDependentOutputException:
            if func is not _SCALAR:
                raise ValueRuleError(self._unexpected(func)) from None
            if args[0].dtype == torch.bool:
                self.expert += 1
                return False
            if self.expert < 0 or self.expert >= len(self.ids) or args[0].is_floating_point():
                raise ValueRuleError(self._unexpected(func)) from None
            return self.ids[self.expert]

    def _unexpected(self, func: Any) -> str:
        return (
            f"data-dependent op {func} in HF experts {self.fqn!r} is not one of the eager experts loop's "
            "(nonzero of the hits, the sentinel check, the expert index, torch.where per expert); "
            "use --experts-implementation grouped_mm"
        )
