"""The built-in recipe: a Llama-style decoder trained with torch-native FSDP2/HSDP and TP."""

from __future__ import annotations

import contextlib

import torch

from hyperdryrun import __version__
from hyperdryrun.config import JobConfig
from hyperdryrun.engine import StepTrace, micro_batch_step, simulate
from hyperdryrun.models.llama import Transformer, cross_entropy_loss
from hyperdryrun.parallel import (
    DTYPES,
    MESH_DIMS,
    ParallelDims,
    build_optimizer,
    fsdp_enabled,
    parallelize_llama,
)
from hyperdryrun.parallel.context import ContextParallelStep
from hyperdryrun.parallel.pipeline import LlamaPipeline


def model_fn(cfg: JobConfig):
    args = cfg.model.args()

    def build() -> Transformer:
        # Built in the stored dtype rather than cast with ``.to(dtype)``, which would also turn the complex RoPE
        # buffer into a real one (nn.Module.to casts complex tensors to the requested floating dtype).
        old = torch.get_default_dtype()
        torch.set_default_dtype(DTYPES[cfg.training.dtype])
        try:
            return Transformer(args, max_seq_len=cfg.training.seq_len)
        finally:
            torch.set_default_dtype(old)

    return build


def batch_fn(cfg: JobConfig):
    t, vocab = cfg.training, cfg.model.args().vocab_size

    def make(i: int, device: torch.device):
        shape = (t.micro_batch_size, t.seq_len)
        return torch.randint(0, vocab, shape, device=device), torch.randint(0, vocab, shape, device=device)

    return make


def llama_loss(model, batch) -> torch.Tensor:
    tokens, labels = batch
    return cross_entropy_loss(model(tokens), labels)


def loss_context(cfg: JobConfig):
    if cfg.parallel.tp > 1 and cfg.parallel.loss_parallel:
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel
    return contextlib.nullcontext


def job_metadata(cfg: JobConfig) -> dict:
    t, args = cfg.training, cfg.model.args()
    dims = ParallelDims.from_config(cfg)
    tokens = t.micro_batch_size * t.seq_len
    return {
        "mode": "dry-run",
        "model": cfg.model.name,
        "model_args": args.to_dict(),
        "num_params": args.num_params(),
        "hyperdryrun_version": __version__,
        "torch_version": torch.__version__,
        "dtype": t.dtype,
        "mixed_precision": {"param_dtype": t.param_dtype, "reduce_dtype": t.reduce_dtype}
        if fsdp_enabled(cfg)
        else None,
        "parallel": {**dims.as_dict(), "ep": cfg.parallel.ep, "etp": cfg.parallel.etp},
        "fsdp": fsdp_enabled(cfg),
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
        "pipeline": pipeline(cfg).metadata() if cfg.parallel.pp > 1 else None,
        "context_parallel": context_parallel_metadata(cfg),
    }


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


def pipeline(cfg: JobConfig) -> LlamaPipeline:
    """The pipeline-parallel step for ``cfg`` (pp > 1): this rank's stages, each parallelized as without pp."""
    return LlamaPipeline(
        cfg,
        parallelize_stage=lambda stage, mesh: parallelize_llama(stage, mesh, cfg),
        loss_fn=cross_entropy_loss,
        loss_context=loss_context(cfg),
    )


def run_job(cfg: JobConfig, capture_stacks: bool = True) -> StepTrace:
    """Dry-run the built-in recipe for the rank that ``cfg`` names."""
    dims = ParallelDims.from_config(cfg)
    limitations = []
    if not fsdp_enabled(cfg) and cfg.training.param_dtype not in (None, cfg.training.dtype):
        limitations.append(
            "mixed precision needs FSDP2 in this recipe; parameters were used in training.dtype"
        )
    metadata = job_metadata(cfg)
    if cfg.parallel.pp > 1:
        pipe = pipeline(cfg)
        step_fn, parallelize_fn = pipe.step, pipe.parallelize
        limitations.append(
            "pipeline: only this rank's stages were run; point-to-point sends and receives complete at once on the "
            "fake process group, so a send buffer is freed when the schedule drops it (on CUDA, NCCL's stream may "
            "hold it a little longer)"
        )
    elif cfg.parallel.cp > 1:
        cp = ContextParallelStep(
            lambda model, mesh: parallelize_llama(model, mesh, cfg),
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
        step_fn = micro_batch_step(llama_loss, cfg.training.num_micro_batches, loss_context(cfg))
        parallelize_fn = lambda model, mesh: parallelize_llama(model, mesh, cfg)  # noqa: E731
    trace = simulate(
        model_fn(cfg),
        batch_fn(cfg),
        step_fn=step_fn,
        parallelize_fn=parallelize_fn,
        optimizer_fn=lambda params: build_optimizer(params, cfg),
        world_size=cfg.world.world_size,
        rank=cfg.world.rank,
        local_rank=cfg.local_rank,
        mesh_shape=dims.mesh_shape,
        mesh_dim_names=MESH_DIMS,
        target_device=cfg.target_device,
        num_micro_batches=cfg.training.num_micro_batches,
        capture_stacks=capture_stacks,
        metadata=metadata,
    )
    trace.limitations.extend(limitations)
    return trace
