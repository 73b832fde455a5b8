"""Expert parallel for the built-in MoE model, torch-native and torchtitan's way (``ExpertParallel``).

The ``ep`` ranks split the ``dp_shard`` dimension: the mesh's ``dp_shard`` is unflattened into
``(dp_shard_mod_ep, ep)``. Routed expert weights are DTensors sharded on the expert dimension over ``ep``; FSDP2
shards them further over ``dp_shard_mod_ep`` (and ``dp_replicate``) while every other parameter is sharded over
``dp_shard`` as without EP. Tokens reach their experts by all-to-all (``all_to_all_single_autograd``): the split
sizes depend on the router's decisions, which fake tensors do not have, so they come from the routing rule of
:mod:`hyperdryrun.world.values` (``moe.token_counts``), assuming every EP rank routes its tokens alike.

With TP (torchtitan's ``apply_moe_ep_tp``), the MoE layer gathers the sequence over tp, keeps the router replicated
and splits shared experts Megatron style; routed experts are split on their hidden dimension over tp (ep = 1,
``TensorParallel``) or over ep x etp with etp = tp (``ExpertTensorParallel``: tokens replicated over tp, dispatched
over ep). torchtitan's etp = 1 with ep > 1, where EP borrows the tp ranks, is not built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from hyperdryrun.compat.torch_dtensor import unflatten_mesh
from hyperdryrun.compat.torch_fsdp import shard_placement_result
from hyperdryrun.models.moe import MLAttention, TokenDispatcher
from hyperdryrun.parallel.ac import apply_ac
from hyperdryrun.parallel.fsdp import fsdp_enabled, fsdp_mesh, mixed_precision, shard_embedding_and_head
from hyperdryrun.parallel.options import LayoutUnsupported
from hyperdryrun.parallel.tp import apply_tp, decoder_block_tp_plan
from hyperdryrun.world.values import ValueRuleError, active_rules

if TYPE_CHECKING:
    from hyperdryrun.parallel.fsdp import FSDPOptions
    from hyperdryrun.parallel.options import ParallelizeOptions
    from hyperdryrun.parallel_dims import ParallelDims


def expert_meshes(mesh: Any, dims: ParallelDims) -> tuple[Any, Any, Any]:
    """(ep mesh, mesh that FSDP2 shards the experts over, ep x tp mesh or None) from the world mesh; built outside
    fake mode. The ep x tp mesh exists when experts are also tensor parallel (etp = tp > 1)."""
    p = dims
    full = unflatten_mesh(mesh, "dp_shard", (p.dp_shard // p.ep, p.ep), ("dp_shard_mod_ep", "ep"))
    efsdp = full["dp_replicate", "dp_shard_mod_ep"] if p.dp_replicate > 1 else full["dp_shard_mod_ep"]
    ep_tp = full["ep", "tp"] if p.etp > 1 else None
    return full["ep"], efsdp, ep_tp


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


class ExpertParallel:
    """Shard a :class:`GroupedExperts` on the expert dimension over ``ep`` and wrap its forward with all-to-all
    token dispatch and combine (torchtitan's ``ExpertParallel`` through ``distribute_module``)."""

    def __init__(self, fqn: str, top_k: int, permute: str = "torchtitan") -> None:
        self.fqn, self.top_k, self.permute = fqn, top_k, permute
        self.input_splits: list[int] = []
        self.output_splits: list[int] = []
        self.inverse: torch.Tensor | None = None
        self.permuted: tuple[torch.Size, torch.Tensor] | None = None

    def apply(self, experts: nn.Module, ep_mesh: Any) -> nn.Module:
        from torch.distributed.tensor import distribute_module

        return distribute_module(
            experts,
            ep_mesh,
            partition_fn=self._partition,
            input_fn=self._dispatch,
            output_fn=self._combine,
        )

    def shard(self, experts: nn.Module, ep_mesh: Any) -> nn.Module:
        """The experts' weights sharded on the expert dimension, with no token hooks (the MoE's
        :class:`AllToAllTokenDispatcher` moves the tokens)."""
        from torch.distributed.tensor import distribute_module

        return distribute_module(experts, ep_mesh, partition_fn=self._partition)

    @staticmethod
    def _partition(name: str, module: nn.Module, mesh: Any) -> None:
        from torch.distributed.tensor import Shard, distribute_tensor

        for pname, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [Shard(0)])))

    def _splits(
        self, counts: torch.Tensor, counts_group: torch.Tensor, tokens: int, ep: int, me: int
    ) -> list[list[int]]:
        """Tokens per (source rank, local expert) that this rank receives; sets the all-to-all split sizes."""
        num_experts = counts.shape[0]
        local = num_experts // ep
        if not _is_fake(counts):
            mine = counts.long().tolist()
            received = counts_group.long().view(ep, local).tolist()
        else:
            rules = active_rules()
            if rules is None:
                raise ValueRuleError(
                    f"expert-parallel dispatch in module {self.fqn!r} needs tokens per expert, but no value rules "
                    "are active (run inside hyperdryrun.world.values.use_rules)"
                )
            mine = rules.token_counts(self.fqn, tokens, num_experts, self.top_k)
            received = [mine[me * local : (me + 1) * local] for _ in range(ep)]
        self.input_splits = [sum(mine[r * local : (r + 1) * local]) for r in range(ep)]
        self.output_splits = [sum(row) for row in received]
        return received

    def _dispatch(self, module: nn.Module, inputs: tuple, mesh: Any) -> tuple[torch.Tensor, torch.Tensor]:
        from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd

        routed_input, counts = inputs
        ep, me, group = mesh.size(), mesh.get_local_rank(), mesh.get_group()
        counts_group = all_to_all_single(counts, None, None, group)
        received = self._splits(counts, counts_group, routed_input.shape[0] // self.top_k, ep, me)
        routed_input = all_to_all_single_autograd(routed_input, self.output_splits, self.input_splits, group)
        if self.permute == "torchtitan":
            return self._permute(routed_input, counts_group, ep)
        # Received rows are ordered (source rank, local expert); the grouped GEMM wants expert-major order.
        local = len(received[0])
        starts, pos = [], 0
        for row in received:
            starts.append([])
            for n in row:
                starts[-1].append(pos)
                pos += n
        order = [
            starts[src][e] + i for e in range(local) for src in range(ep) for i in range(received[src][e])
        ]
        perm = torch.tensor(order, dtype=torch.long, device=routed_input.device)
        inverse = [0] * len(order)
        for new, old in enumerate(order):
            inverse[old] = new
        self.inverse = torch.tensor(inverse, dtype=torch.long, device=routed_input.device)
        tokens_per_local_expert = counts_group.view(ep, local).sum(dim=0)
        return routed_input[perm], tokens_per_local_expert

    def _permute(
        self, routed_input: torch.Tensor, counts_group: torch.Tensor, ep: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank-major rows to expert-major rows on the device, as torchtitan 0.3.0's
        ``AllToAllTokenDispatcher._permute``: the permutation (int64, one per row) is kept for the combine."""
        counts_group = counts_group.reshape(-1)
        local = counts_group.shape[0] // ep
        total = routed_input.shape[0]
        t_mat = counts_group.view(ep, local)
        input_starts = (counts_group.cumsum(0) - counts_group).view(ep, local)
        segment_lens = t_mat.t().reshape(-1)
        input_starts = input_starts.t().reshape(-1)
        device = routed_input.device
        seg_ids = torch.arange(segment_lens.shape[0], device=device).repeat_interleave(
            segment_lens, output_size=total
        )
        output_starts = segment_lens.cumsum(0) - segment_lens
        permuted = input_starts[seg_ids] + torch.arange(total, device=device) - output_starts[seg_ids]
        self.permuted = (routed_input.shape, permuted)
        return routed_input[permuted, :], t_mat.sum(0)

    def _combine(self, module: nn.Module, routed_output: torch.Tensor, mesh: Any) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        if self.permuted is not None:
            # torchtitan's _unpermute: an empty buffer written at the permuted rows.
            shape, permuted = self.permuted
            unpermuted = routed_output.new_empty(shape)
            unpermuted[permuted, :] = routed_output
            self.permuted = None
        else:
            unpermuted = routed_output[self.inverse]
            self.inverse = None
        return all_to_all_single_autograd(unpermuted, self.input_splits, self.output_splits, mesh.get_group())


class AllToAllTokenDispatcher(TokenDispatcher):
    """torchtitan 0.3.0's ``AllToAllTokenDispatcher``: the local token reordering, then the all-to-alls and the
    device-side permutation of :class:`ExpertParallel` between the MoE and its experts; the experts' weights are
    sharded on the expert dimension without hooks (:meth:`ExpertParallel.shard`)."""

    def __init__(self, top_k: int, ep: ExpertParallel, mesh: Any) -> None:
        super().__init__(top_k)
        self.ep, self.mesh = ep, mesh

    def exchange(self, routed_input: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ep._dispatch(None, (routed_input, counts), self.mesh)

    def exchange_back(self, routed_output: torch.Tensor) -> torch.Tensor:
        return self.ep._combine(None, routed_output, self.mesh)


class ExpertTensorParallel(ExpertParallel):
    """Experts sharded over ep x etp (torchtitan's ``ExpertTensorParallel``): the expert dimension over ep, each
    expert's hidden dimension over tp (w1/w3 column-wise, w2 row-wise). Tokens are replicated over tp, dispatched
    and combined over ep; the output is a partial sum over tp that the MoE output's reduce-scatter completes."""

    def __init__(self, fqn: str, top_k: int, ep_mesh: Any, tp_mesh: Any, permute: str = "torchtitan") -> None:
        super().__init__(fqn, top_k, permute)
        self.ep_mesh, self.tp_mesh = ep_mesh, tp_mesh

    def apply(self, experts: nn.Module, ep_tp_mesh: Any) -> nn.Module:
        from torch.distributed.tensor import distribute_module

        return distribute_module(
            experts,
            ep_tp_mesh,
            partition_fn=_partition_2d,
            input_fn=lambda mod, inputs, mesh: self._dispatch(
                mod, _tp_replicated(inputs, self.tp_mesh), self.ep_mesh
            ),
            output_fn=lambda mod, out, mesh: self._combine(mod, out, self.ep_mesh),
        )


def _partition_2d(name: str, module: nn.Module, mesh: Any) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    for pname, dim in _TP_DIMS.items():
        param = getattr(module, pname)
        module.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [Shard(0), Shard(dim)])))


# GroupedExperts weights: w1, w3 (E, hidden, dim) are split column-wise on hidden, w2 (E, dim, hidden) row-wise.
_TP_DIMS = {"w1": 1, "w2": 2, "w3": 1}


def _tp_replicated(inputs: tuple, tp_mesh: Any) -> tuple:
    """Tokens are the same on every tp rank; their gradient is a partial sum over tp (torchtitan's
    ``from_local(Replicate).to_local(grad_placements=Partial)``), all-reduced in backward."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    routed_input, counts = inputs
    routed_input = DTensor.from_local(routed_input, tp_mesh, (Replicate(),), run_check=False)
    return routed_input.to_local(grad_placements=(Partial(),)), counts


class NoParallel(ParallelStyle):
    """A replicated module on the tp mesh (torchtitan's ``NoParallel``, for the router gate and MLA's low-rank
    projections): parameters become Replicate DTensors, a plain input is annotated as replicated, the output is
    returned as a local tensor."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        from torch.distributed.tensor import DTensor, Replicate, distribute_module

        def annotate(mod, inputs, mesh):
            x = inputs[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, (Replicate(),), run_check=False)
            return (x, *inputs[1:])

        return distribute_module(module, device_mesh, None, annotate, lambda mod, out, mesh: out.to_local())


class TensorParallel(ParallelStyle):
    """Every routed expert split over tp on its hidden dimension (torchtitan's ``TensorParallel`` for experts when
    ep = 1): all tokens run on every tp rank, the output is a partial sum over tp."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        from torch.distributed.tensor import Shard, distribute_module, distribute_tensor

        def partition(name, mod, mesh):
            for pname, dim in _TP_DIMS.items():
                param = getattr(mod, pname)
                mod.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [Shard(dim)])))

        return distribute_module(
            module, device_mesh, partition, input_fn=lambda mod, inputs, mesh: _tp_replicated(inputs, mesh)
        )


def moe_block_tp_plan(block: nn.Module, seq: Any) -> dict:
    """The TP plan of an MoE decoder block around its MoE layer (which :func:`apply_moe_tp` splits): attention
    split by heads and the dense FFN of the leading dense layers Megatron style, norms sequence parallel. MLA
    (torchtitan's deepseek_v3 plan): the low-rank down projections and their norms stay replicated, the per-head
    up projections are split by heads."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    if isinstance(block.attention, MLAttention):
        low_rank = [n for n in ("wq_a", "q_norm", "wkv_a", "kv_norm") if hasattr(block.attention, n)]
        projections: dict = {f"attention.{name}": NoParallel() for name in low_rank}
        # Per-head q: wq_b after the low-rank wq_a, or one wq when q_lora_rank is 0 (torchtitan's plan).
        projections["attention.wq_b" if hasattr(block.attention, "wq_b") else "attention.wq"] = (
            ColwiseParallel()
        )
        projections["attention.wkv_b"] = ColwiseParallel()
    else:
        # The fused wqkv (torchtitan 0.3.0) holds whole KV groups per column shard, as the Llama block's does.
        names = [n for n in ("wqkv", "wq", "wk", "wv") if hasattr(block.attention, n)]
        projections = {f"attention.{name}": ColwiseParallel() for name in names}
    return decoder_block_tp_plan(block, seq, projections)


def apply_moe_tp(
    model: nn.Module,
    tp_mesh: Any,
    ep_mesh: Any | None,
    ep_tp_mesh: Any | None,
    *,
    sequence_parallel: bool,
    top_k: int,
    moe_impl: str,
) -> None:
    """TP of the MoE layers (torchtitan's ``apply_moe_ep_tp``): the MoE input is all-gathered over tp and its
    partial output reduce-scattered back to sequence shards; the router is replicated, shared experts are split
    Megatron style, routed experts get TensorParallel (ep = 1) or ExpertTensorParallel (ep x etp)."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInputOutput,
        RowwiseParallel,
        parallelize_module,
    )

    seq = Shard(1) if sequence_parallel else Replicate()
    for name, block in model.layers.items():
        if getattr(block, "moe", None) is None:
            continue
        plan = {
            "moe": PrepareModuleInputOutput(
                input_layouts=(seq,),
                desired_input_layouts=(Replicate(),),
                use_local_input=True,
                output_layouts=(Partial(),),
                desired_output_layouts=(seq,),
            ),
            "moe.router.gate": NoParallel(),
        }
        if block.moe.shared_experts is not None:
            plan["moe.shared_experts.w1"] = ColwiseParallel()
            plan["moe.shared_experts.w2"] = RowwiseParallel(output_layouts=Partial())
            plan["moe.shared_experts.w3"] = ColwiseParallel()
        parallelize_module(block, tp_mesh, plan)
        fqn = f"layers.{name}.moe.experts"
        if ep_mesh is None:
            parallelize_module(block.moe.experts, tp_mesh, TensorParallel())
        else:
            ExpertTensorParallel(fqn, top_k, ep_mesh, tp_mesh, moe_impl).apply(block.moe.experts, ep_tp_mesh)


def apply_ep(model: nn.Module, ep_mesh: Any, top_k: int, permute: str = "torchtitan") -> None:
    """Expert parallel on every MoE layer's routed experts; ``permute``: how received rows are put in expert
    order (``torchtitan``: 0.3.0's device-side permutation, in the MoE's :class:`AllToAllTokenDispatcher`;
    ``torchtitan-2024``: host-built index lists, in hooks around the experts)."""
    for name, block in model.layers.items():
        if getattr(block, "moe", None) is None:
            continue
        ep = ExpertParallel(f"layers.{name}.moe.experts", top_k, permute)
        if permute == "torchtitan":
            ep.shard(block.moe.experts, ep_mesh)
            block.moe.token_dispatcher = AllToAllTokenDispatcher(top_k, ep, ep_mesh)
        else:
            ep.apply(block.moe.experts, ep_mesh)


def apply_moe_fsdp(
    model: nn.Module, dp_mesh: Any, expert_mesh: Any | None, dims: ParallelDims, fsdp: FSDPOptions
) -> None:
    """FSDP2 units of the MoE model as ``parallel.fsdp_wrap`` names them: torchtitan 0.3.0's
    (:func:`_torchtitan_moe_fsdp`) or its 2024 releases' (:func:`_torchtitan_2024_moe_fsdp`)."""
    if fsdp.wrap == "torchtitan":
        _torchtitan_moe_fsdp(model, dp_mesh, expert_mesh, dims, fsdp)
    else:
        _torchtitan_2024_moe_fsdp(model, dp_mesh, expert_mesh, dims, fsdp)


def _torchtitan_moe_fsdp(
    model: nn.Module, dp_mesh: Any, expert_mesh: Any | None, dims: ParallelDims, fsdp: FSDPOptions
) -> None:
    """torchtitan 0.3.0's ``apply_fsdp_to_decoder``: the embedding and each block are units (the dense units of
    :func:`hyperdryrun.parallel.fsdp.apply_fsdp`), norm + head one unit kept unsharded after forward; a block's
    routed experts are in the block's unit, sharded on the expert dimension (on their hidden dimension when the
    expert-sharding ranks outnumber the experts) and, under EP, over ``expert_mesh`` while the rest of the block is
    over ``dp_mesh``. Under EP, each block prefetches the next one's parameters in forward and the previous one's
    in backward, as torchtitan sets."""
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.tensor import Shard

    if expert_mesh is not None and shard_placement_result() is None:
        raise LayoutUnsupported(
            f"parallel.ep={dims.ep} with parallel.fsdp_wrap='torchtitan' shards the routed experts over their own "
            "mesh inside each block's FSDP2 unit (FSDP2's ShardPlacementResult), which torch 2.11 lacks: use torch "
            "2.12 or later, or parallel.fsdp_wrap: torchtitan-2024 (--fsdp-wrap torchtitan-2024: the experts their "
            "own unit)"
        )

    p = dims
    config = {"mesh": dp_mesh, "mp_policy": mixed_precision(fsdp)}
    blocks_reshard = fsdp.reshard_after_forward and p.pp == 1
    head = shard_embedding_and_head(model, config, blocks_reshard)
    for block in model.layers.values():
        inner = getattr(block, "_checkpoint_wrapped_module", block)
        moe = getattr(inner, "moe", None)
        placement_fn = None
        if moe is not None:
            experts = set(moe.experts.parameters())
            # torchtitan: efsdp x ep ranks (dp_shard) under EP, else every rank of the FSDP mesh.
            sharders = p.dp_shard if expert_mesh is not None else dp_mesh.size()
            placement = Shard(1) if sharders > moe.experts.num_experts else Shard(0)
            if expert_mesh is not None:
                placement_fn = _expert_mesh_placement(experts, placement, expert_mesh, dp_mesh)
            elif placement == Shard(1):
                placement_fn = lambda param, _e=experts: Shard(1) if param in _e else None  # noqa: E731
        fully_shard(block, **config, reshard_after_forward=blocks_reshard, shard_placement_fn=placement_fn)
    fully_shard(model, **config)
    # torchtitan's disable_fsdp_gradient_division: it scales gradients by the global token count itself. FSDP2
    # then reduces with PREMUL_SUM(1), and over a mesh of one rank (experts under ep = dp_shard) copies
    # ``input / 1`` out: a gradient-sized temporary.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
    if expert_mesh is None:
        return
    blocks = list(model.layers.values())
    if model.tok_embeddings is not None and blocks:
        model.tok_embeddings.set_modules_to_forward_prefetch([blocks[0]])
    for block, nxt in zip(blocks, [*blocks[1:], None]):
        if nxt is not None:
            block.set_modules_to_forward_prefetch([nxt])
        elif len(head) == 2:
            block.set_modules_to_forward_prefetch(head)
    backward = list(reversed(blocks))
    if len(head) == 2 and blocks:
        model.output.set_modules_to_backward_prefetch([backward[0]])
    for block, prev in zip(backward, [*backward[1:], None]):
        if prev is not None:
            block.set_modules_to_backward_prefetch([prev])
        elif model.tok_embeddings is not None:
            block.set_modules_to_backward_prefetch([model.tok_embeddings])


def _expert_mesh_placement(experts: set, placement: Any, expert_mesh: Any, dp_mesh: Any) -> Any:
    """FSDP2's per-parameter mesh in one unit (torch 2.13 ``ShardPlacementResult``, as torchtitan 0.3.0 uses it):
    routed experts over ``expert_mesh``, every other parameter of the block on dim 0 over ``dp_mesh``."""
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info
    from torch.distributed.tensor import Shard

    ShardPlacementResult = shard_placement_result()
    expert_info, dp_info = _get_mesh_info(expert_mesh, None), _get_mesh_info(dp_mesh, None)

    def place(param: nn.Parameter) -> Any:
        if param in experts:
            return ShardPlacementResult(placement=placement, mesh_info=expert_info)
        return ShardPlacementResult(placement=Shard(0), mesh_info=dp_info)

    return place


def _torchtitan_2024_moe_fsdp(
    model: nn.Module, dp_mesh: Any, expert_mesh: Any | None, dims: ParallelDims, fsdp: FSDPOptions
) -> None:
    """The 2024 units: each block (the last one kept unsharded after forward) and the root, with the routed experts
    wrapped first over ``expert_mesh`` when EP is on (experts over ``dp_shard_mod_ep``, the rest over
    ``dp_shard``)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    mp = mixed_precision(fsdp)
    reshard = fsdp.reshard_after_forward
    n = len(model.layers)
    for i, block in enumerate(model.layers.values()):
        inner = getattr(block, "_checkpoint_wrapped_module", block)
        keep = reshard and i < n - 1
        if expert_mesh is not None and getattr(inner, "moe", None) is not None:
            experts = inner.moe.experts
            placement = None
            if expert_mesh.size() * dims.ep > experts.num_experts:
                # torchtitan: fewer local experts than FSDP ranks, so shard the hidden dim rather than pad experts.
                placement = lambda _param: Shard(1)  # noqa: E731
            fully_shard(
                experts,
                mesh=expert_mesh,
                mp_policy=mp,
                reshard_after_forward=keep,
                shard_placement_fn=placement,
            )
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=keep)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard)


def parallelize_moe(
    model: nn.Module, mesh: Any, dims: ParallelDims, options: ParallelizeOptions
) -> nn.Module:
    """TP and EP, then AC, then FSDP2/HSDP (torchtitan's order for MoE models), all torch-native, from outside the
    model."""
    p, args = dims, model.args  # the model's own shapes (top_k, moe_impl)
    ep_mesh = expert_mesh = ep_tp_mesh = None
    if p.ep > 1:
        ep_mesh, expert_mesh, ep_tp_mesh = expert_meshes(mesh, dims)
    if p.tp > 1:
        sp = dims.sequence_parallel
        apply_tp(
            model, mesh["tp"], moe_block_tp_plan, sequence_parallel=sp, loss_parallel=options.loss_parallel
        )
        apply_moe_tp(
            model,
            mesh["tp"],
            ep_mesh,
            ep_tp_mesh,
            sequence_parallel=sp,
            top_k=args.top_k,
            moe_impl=args.moe_impl,
        )
    elif ep_mesh is not None:
        apply_ep(model, ep_mesh, args.top_k, args.moe_impl)
    apply_ac(model, options.ac, options.ac_selective)
    if fsdp_enabled(dims, options.fsdp):
        apply_moe_fsdp(model, fsdp_mesh(mesh, dims), expert_mesh, dims, options.fsdp)
    return model
