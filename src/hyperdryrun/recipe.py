"""The built-in recipe: a registered decoder family (dense Llama or MoE) trained with torch-native parallelisms —
FSDP2/HSDP, TP with sequence and loss parallel, pipeline (PP), context (CP) and expert (EP, expert TP) parallel —
for the rank that the job config names. The model family's train spec (:mod:`hyperdryrun.parallel.train_spec`)
says how its model is built and parallelized; :func:`plan` is the job, which the dry run (:func:`run_job`) and
``hyperdryrun measure`` both run."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from hyperdryrun.compat.torch_pipelining import receive_buffer
from hyperdryrun.compat.versions import installed_version, torch_version
from hyperdryrun.config import JobConfig
from hyperdryrun.engine import JobPlan, StepTrace, micro_batch_step, simulate_plan
from hyperdryrun.models import hf
from hyperdryrun.models.hf import is_hf_name
from hyperdryrun.models.llama import cross_entropy_loss
from hyperdryrun.parallel.context import ContextParallelStep
from hyperdryrun.parallel.fsdp import DTYPES, FSDPOptions, fsdp_enabled
from hyperdryrun.parallel.optimizer import build_optimizer
from hyperdryrun.parallel.options import ParallelizeOptions
from hyperdryrun.parallel.pipeline import DecoderPipeline, PipelineStages, StageShapes
from hyperdryrun.parallel.train_spec import get_train_spec
from hyperdryrun.trace.blocks import Category
from hyperdryrun.trace.stacks import step_code
from hyperdryrun.version import __version__
from hyperdryrun.world.values import use_rules


# --- the job config as the parallelisms take it: ParallelDims (cfg.dims) and the options each uses -----------------
def fsdp_options(cfg: JobConfig) -> FSDPOptions:
    """What FSDP2 is applied with: the training dtypes, ``parallel.reshard_after_forward`` and ``fsdp_wrap``."""
    t, p = cfg.training, cfg.parallel
    return FSDPOptions(t.dtype, t.param_dtype, t.reduce_dtype, p.reshard_after_forward, p.fsdp_wrap)


def fsdp_applied(cfg: JobConfig) -> bool:
    """Whether the job's step applies FSDP2 (:func:`hyperdryrun.parallel.fsdp.fsdp_enabled`)."""
    return fsdp_enabled(cfg.dims, fsdp_options(cfg))


def parallelize_options(cfg: JobConfig) -> ParallelizeOptions:
    """What the model family's parallelize function applies besides the degrees."""
    t = cfg.training
    return ParallelizeOptions(fsdp_options(cfg), t.ac, t.ac_selective, cfg.parallel.loss_parallel)


def optimizer(cfg: JobConfig) -> Callable[[Any], torch.optim.Optimizer]:
    """The job's optimizer over the parameters it is given (``training.optimizer`` and its settings)."""
    t = cfg.training
    return lambda params: build_optimizer(
        params,
        name=t.optimizer,
        impl=t.optimizer_impl,
        lr=t.lr,
        momentum=t.momentum,
        weight_decay=t.weight_decay,
    )


def stage_shapes(cfg: JobConfig) -> StageShapes:
    """What flows between the built-in job's pipeline stages: one micro batch of hidden states in the activation
    dtype (param_dtype under FSDP2's mixed precision, else the stored dtype), logits from the last."""
    p, t, m = cfg.parallel, cfg.training, cfg.model.args()
    dtype = DTYPES[t.param_dtype] if fsdp_applied(cfg) and t.param_dtype else DTYPES[t.dtype]
    return StageShapes(
        t.micro_batch_size,
        t.seq_len,
        m.dim,
        m.vocab_size,
        dtype,
        p.pp_num_stages,
        p.tp,
        p.sequence_parallel,
        p.loss_parallel,
    )


def model_fn(cfg: JobConfig):
    """Build the job's model (its family's model class) in the stored dtype; the engine calls it on meta."""
    args, family = cfg.model.args(), cfg.model.family

    def build() -> torch.nn.Module:
        # Built in the stored dtype rather than cast with ``.to(dtype)``, which would also turn the complex RoPE
        # buffer into a real one (nn.Module.to casts complex tensors to the requested floating dtype).
        old = torch.get_default_dtype()
        torch.set_default_dtype(DTYPES[cfg.training.dtype])
        try:
            return family.build(args, cfg.training.seq_len)
        finally:
            torch.set_default_dtype(old)

    return build


def batch_fn(cfg: JobConfig):
    t, vocab = cfg.training, cfg.model.args().vocab_size

    @step_code
    def make(i: int, device: torch.device):
        shape = (t.micro_batch_size, t.seq_len)
        return torch.randint(0, vocab, shape, device=device), torch.randint(0, vocab, shape, device=device)

    return make


@step_code
def llama_loss(model, batch) -> torch.Tensor:
    tokens, labels = batch
    return cross_entropy_loss(model(tokens), labels)


class _HiddenGradient(torch.autograd.Function):
    """The chunked loss's bridge into the decoder's backward: the loss value, whose gradient for the hidden states
    is the one the chunks accumulated (torchtitan's ``_DecoderOutputGradientBackProp``)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, grad: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(grad)
        return loss.detach()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (grad,) = ctx.saved_tensors
        return grad, None, None


def chunked_loss(num_chunks: int):
    """torchtitan 0.3.0's ``ChunkedLossWrapper``: the decoder returns normed hidden states; each of ``num_chunks``
    sequence chunks (detached leaves) runs the output head, the fp32 loss and its backward at once, its gradient
    copied into one fp32 buffer; the head stays unsharded across chunks and reduces its gradient at the last."""
    from torch.distributed.fsdp import FSDPModule

    @step_code
    def loss_fn(model, batch) -> torch.Tensor:
        tokens, labels = batch
        model.skip_output = True
        hidden = model(tokens)
        head = model.output
        fsdp = isinstance(head, FSDPModule)
        length = hidden.shape[1] // num_chunks
        h_chunks = [c.contiguous().detach().requires_grad_(True) for c in torch.split(hidden, length, dim=1)]
        label_chunks = [c.contiguous() for c in torch.split(labels, length, dim=1)]
        grad = torch.zeros_like(hidden, dtype=torch.float32)
        total = hidden.new_zeros((), dtype=torch.float32)
        if fsdp:
            head.set_reshard_after_forward(False)
            head.set_reshard_after_backward(False)
            head.set_requires_gradient_sync(False, recurse=False)
            head.unshard()
        for i, (h, y) in enumerate(zip(h_chunks, label_chunks)):
            if fsdp and i == num_chunks - 1:
                head.set_requires_gradient_sync(True, recurse=False)
            # Bound to a name as torchtitan does: a chunk's logits live until the next chunk's replace them.
            logits = head(h)
            chunk_loss = cross_entropy_loss(logits, y) / num_chunks
            total = total + chunk_loss.detach()
            chunk_loss.backward()
            grad[:, i * length : (i + 1) * length] = h.grad
            h.grad = None
        if fsdp:
            head.set_reshard_after_forward(True)
            head.set_reshard_after_backward(True)
            head.set_requires_gradient_sync(True, recurse=False)
            head.reshard()
        return _HiddenGradient.apply(hidden, grad.to(hidden.dtype), total)

    return loss_fn


def loss_kind(cfg: JobConfig) -> str:
    """The loss the step runs: ``chunked``, the model family's own (``hf``: HF's ``loss_function``) or
    ``cross-entropy`` (the built-in fp32 cross entropy, which is also the built-in presets' own)."""
    t, family = cfg.training, cfg.model.family
    if t.loss == "chunked":
        return "chunked"
    return family.name if t.loss == "model" and family.loss is not None else "cross-entropy"


def loss_fn(cfg: JobConfig):
    """The micro batch's loss: the model's own (HF models: ``labels=`` through their ``loss_function``), the
    token cross entropy of the model's logits in fp32 (``training.loss: builtin``; HF models: the family's
    ``logits``), or torchtitan's chunked loss (``training.loss: chunked``)."""
    kind = loss_kind(cfg)
    if kind == "chunked":
        return chunked_loss(cfg.training.chunks)
    if kind != "cross-entropy":
        return cfg.model.family.loss
    logits = cfg.model.family.logits
    if logits is None:
        return llama_loss

    @step_code
    def builtin_loss(model, batch) -> torch.Tensor:
        return cross_entropy_loss(logits(model, batch[0]), batch[1])

    return builtin_loss


def loss_context(cfg: JobConfig):
    if cfg.parallel.tp > 1 and cfg.parallel.loss_parallel:
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel
    return contextlib.nullcontext


def job_metadata(cfg: JobConfig) -> dict:
    t, args = cfg.training, cfg.model.args()
    tokens = t.micro_batch_size * t.seq_len
    return {
        "mode": "dry-run",
        "model": cfg.model.name,
        "model_args": args.to_dict(),
        "num_params": args.num_params(),
        "hyperdryrun_version": __version__,
        "torch_version": torch_version(),
        # a Hugging Face model is transformers' code: its release is part of what was modelled
        **({"transformers_version": installed_version("transformers")} if is_hf_name(cfg.model.name) else {}),
        "dtype": t.dtype,
        "mixed_precision": {"param_dtype": t.param_dtype, "reduce_dtype": t.reduce_dtype}
        if fsdp_applied(cfg)
        else None,
        "parallel": cfg.dims.degrees(),
        "fsdp": fsdp_applied(cfg),
        "reshard_after_forward": cfg.parallel.reshard_after_forward,
        "sequence_parallel": cfg.parallel.sequence_parallel and cfg.parallel.tp > 1,
        "loss_parallel": cfg.parallel.loss_parallel and cfg.parallel.tp > 1,
        "batch_shapes": {
            "tokens": [t.micro_batch_size, t.seq_len],
            "labels": [t.micro_batch_size, t.seq_len],
        },
        "tokens_per_micro_batch": tokens,
        "tokens_per_step": tokens * t.num_micro_batches,
        "seq_len": t.seq_len,
        "micro_batch_size": t.micro_batch_size,
        "activation_checkpointing": {
            "mode": t.ac,
            "selective": t.ac_selective if t.ac == "selective" else None,
        },
        "optimizer_config": {"name": t.optimizer, "implementation": t.optimizer_impl},
        "loss": {"kind": loss_kind(cfg), "chunks": t.chunks if t.loss == "chunked" else None},
        "norm": getattr(args, "norm", None),
        "fuse_qkv": getattr(args, "fuse_qkv", None),
        "rope": getattr(args, "rope", None),
        "moe_impl": getattr(args, "moe_impl", None),
        "fsdp_wrap": fsdp_wrap_applied(cfg),
        "pipeline": pipeline(cfg).metadata() if cfg.parallel.pp > 1 else None,
        "context_parallel": context_parallel_metadata(cfg),
        "moe": moe_metadata(cfg),
    }


def fsdp_wrap_applied(cfg: JobConfig) -> str | None:
    """The FSDP2 units the step applies: ``parallel.fsdp_wrap`` for the built-in presets (dense: parallel/fsdp.py,
    MoE: parallel/expert.py); HF models have their own (parallel/hf.py), none of these."""
    if not fsdp_applied(cfg) or cfg.model.family.logits is not None:
        return None
    return cfg.parallel.fsdp_wrap


def context_parallel_metadata(cfg: JobConfig) -> dict | None:
    """How the sequence is split over cp ranks (torch's head-tail load balancing) and how the ring exchanges K/V."""
    p, t = cfg.parallel, cfg.training
    if p.cp == 1:
        return None
    return {
        "cp": p.cp,
        "load_balancer": "head-tail",
        "rotate_method": p.cp_rotate_method,
        "local_seq_len": t.seq_len // p.cp,
        "fsdp_mesh": "dp_replicate x dp_shard_cp" if p.dp_replicate > 1 else "dp_shard_cp",
    }


def parallelize(cfg: JobConfig):
    """The parallelize function of the model family's train spec: TP/AC/FSDP for Llama, TP/EP/AC/FSDP for MoE."""
    fn = get_train_spec(cfg.model.family.name).parallelize
    dims, options = cfg.dims, parallelize_options(cfg)
    if not cfg.training.compile:
        return lambda model, mesh: fn(model, mesh, dims, options)

    def compiled(model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
        # torchtitan 0.3.0 apply_compile: each transformer block's Module.compile(fullgraph=True)
        model = fn(model, mesh, dims, options) or model
        blocks = hf.decoder_layers(model) if is_hf_name(cfg.model.name) else model.layers
        for block in blocks.children():
            block.compile(fullgraph=True)
        return model

    return compiled


# --- MoE / expert parallel -------------------------------------------------------------------------------------
def with_value_rules(cfg: JobConfig, step_fn):
    """Run the step with the job's data-dependent value rules answering what fake tensors cannot."""
    rules = cfg.values.value_rules()

    def step(model, optimizer, batches) -> None:
        with use_rules(rules, root=model):
            step_fn(model, optimizer, batches)

    return step


def moe_metadata(cfg: JobConfig) -> dict | None:
    """The routing scenario the report states: the rules, and tokens per expert and per EP rank of one micro batch
    of this rank (every MoE layer not matched by an earlier rule)."""
    if not cfg.model.is_moe:
        return None
    args, p, v = cfg.model.args(), cfg.parallel, cfg.values
    tokens = cfg.training.micro_batch_size * cfg.training.seq_len
    rules = v.value_rules()
    first = getattr(args, "n_dense_layers", None) or 0
    by_layer = {
        i: rules.token_counts(f"layers.{i}.moe.experts", tokens, args.num_experts, args.top_k)
        for i in range(first, args.n_layers)
    }
    counts = by_layer[first] if by_layer else rules.token_counts("*", tokens, args.num_experts, args.top_k)
    local = args.num_experts // p.ep
    ep_rank = cfg.dims.coordinates(cfg.world.rank).ep
    mine = max(sum(c[ep_rank * local : (ep_rank + 1) * local]) for c in [counts, *by_layer.values()])
    out = {
        "routing": v.routing_rule().describe(),
        "routing_line": v.describe(),
        "value_rules": [r.describe() for r in v.rules],
        "num_experts": args.num_experts,
        "top_k": args.top_k,
        "active_params": args.num_params(active=True),
        "tokens_per_expert": counts,
        "ep": p.ep,
        "ep_rank": ep_rank,
        "local_experts": [ep_rank * local, (ep_rank + 1) * local],
        "tokens_received_per_moe_layer": mine * p.ep if p.ep > 1 else tokens * args.top_k,
    }
    if any(c != counts for c in by_layer.values()):
        out["tokens_per_expert_by_layer"] = {str(i): c for i, c in by_layer.items()}
    return out


def pipeline(cfg: JobConfig) -> DecoderPipeline:
    """The pipeline-parallel step for ``cfg`` (pp > 1): this rank's stages, each parallelized as without pp."""
    return DecoderPipeline(
        cfg.dims,
        cfg.world.rank,
        cfg.model.args().n_layers,
        cfg.model.family.pipeline_cut,
        stage_shapes(cfg),
        cfg.training.num_micro_batches,
        parallelize_stage=parallelize(cfg),
        loss_fn=cross_entropy_loss,
        loss_context=loss_context(cfg),
    )


def plan(cfg: JobConfig) -> JobPlan:
    """The built-in job for the rank that ``cfg`` names: the one place that picks its step (pipeline schedule,
    context-parallel ring or plain micro batches) and says what it approximates."""
    dims = cfg.dims
    limitations = []
    if not fsdp_applied(cfg) and cfg.training.param_dtype not in (None, cfg.training.dtype):
        limitations.append(
            "mixed precision needs FSDP2 in this recipe; parameters were used in training.dtype"
        )
    metadata = job_metadata(cfg)
    held_fn = None
    if cfg.parallel.pp > 1:
        pipe = pipeline(cfg)
        step_fn, parallelize_fn = pipe.step, pipe.parallelize
        held_fn = lambda: pipeline_held_buffers(pipe.schedule)  # noqa: E731
        limitations.append(
            "pipeline: only this rank's stages were run; point-to-point sends and receives complete at once on the "
            "fake process group, so a send buffer is freed when the schedule drops it (on CUDA, NCCL's stream may "
            "hold it a little longer)"
        )
    elif cfg.parallel.cp > 1:
        cp = ContextParallelStep(
            parallelize(cfg),
            cross_entropy_loss,
            cfg.training.num_micro_batches,
            rotate_method=cfg.parallel.cp_rotate_method,
            loss_context=loss_context(cfg),
        )
        step_fn, parallelize_fn = cp.step, cp.parallelize
        limitations.append(
            "context parallel: ring attention's K/V exchanges complete at once on the fake process group, so a "
            "received buffer is freed when the ring drops it (on CUDA, NCCL's stream may hold it a little longer)"
        )
    else:
        step_fn = micro_batch_step(loss_fn(cfg), cfg.training.num_micro_batches, loss_context(cfg))
        parallelize_fn = parallelize(cfg)
    if cfg.model.is_moe:
        limitations.extend(moe_limitations(cfg))
    return JobPlan(
        model_fn(cfg),
        batch_fn(cfg),
        with_value_rules(cfg, step_fn),
        parallelize_fn=parallelize_fn,
        optimizer_fn=optimizer(cfg),
        init_fn=init_fn(cfg),
        world_size=cfg.world.world_size,
        rank=cfg.world.rank,
        local_rank=cfg.local_rank,
        mesh_shape=dims.mesh_shape,
        mesh_dim_names=dims.mesh_dim_names,
        target_device=cfg.target_device,
        num_micro_batches=cfg.training.num_micro_batches,
        metadata=metadata,
        cuda=cfg.cuda,
        limitations=limitations,
        held_fn=held_fn,
    )


def run_job(cfg: JobConfig, capture_stacks: bool = True) -> StepTrace:
    """Dry-run the built-in recipe for the rank that ``cfg`` names."""
    return simulate_plan(plan(cfg), capture_stacks=capture_stacks)


def init_fn(cfg: JobConfig) -> Callable[[torch.nn.Module], None]:
    """Real values for the job's model by its family's initialiser (a measured run), stage by stage."""
    family = cfg.model.family
    return lambda model: init_stages(model, family.init_weights)


def init_stages(model: torch.nn.Module, init_weights: Callable[[torch.nn.Module], None]) -> None:
    """Real values by a model family's initialiser, on each of a rank's pipeline stages
    (:class:`~hyperdryrun.parallel.pipeline.PipelineStages`) or on the whole model."""
    for part in model.values() if isinstance(model, PipelineStages) else [model]:
        init_weights(part)


def pipeline_held_buffers(schedule: Any) -> Iterator[tuple[torch.Tensor, Category, str]]:
    """The p2p receive buffers of a built pipeline schedule's stages (torch 2.11 to 2.14's ``PipelineStage``
    allocates one per micro batch for activations and for gradients at the first step and keeps them; torch 2.15's
    allocates each just before its receive and hands it to the computation, so none is kept): input data,
    ``Other``, as the dry run labels them. Which entries are received:
    :func:`~hyperdryrun.compat.torch_pipelining.receive_buffer`."""
    if schedule is None:
        return
    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    for stage in stages:
        for infos in (stage.args_recv_info, stage.grad_recv_info):
            for recv in infos.values():
                for info in recv:
                    if (buffer := receive_buffer(info)) is not None:
                        yield buffer, Category.OTHER, ""


def moe_limitations(cfg: JobConfig) -> list[str]:
    """What the MoE recipe approximates, stated in the report."""
    out = [
        "MoE routing is a scenario, not data: tokens per expert come from the value rules in metadata.moe "
        "(every EP rank is assumed to route its tokens alike); torchtitan's padding of each expert's token group to "
        "a multiple of 8 rows is not modelled",
    ]
    args = cfg.model.args()
    if args.attention == "mla":
        out.append(
            "DeepSeek-V3 MLA is modelled by its exact projection shapes with SDPA on q/k of nope+rope and v of "
            "v_head_dim per head; node-limited (group) routing, the load-balancing bias and MTP are not modelled"
        )
        if cfg.parallel.tp > 1:
            out.append(
                "MLA under TP: the input gradient is all-reduced once per up-projection instead of torchtitan's "
                "single reduce-scatter (buffers of the same size)"
            )
    return out
