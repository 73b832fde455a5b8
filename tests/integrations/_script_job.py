"""A training script's job for ``hyperdryrun script`` tests (run only through the command, in its child processes):
a two-layer MLP sharded with FSDP2 over a ``(replicate, shard)`` mesh that ``launch.layout`` chooses.

Shapes are chosen so that the bytes can be derived by hand: 2 x Linear(256, 256) in fp32 with bias, 257 * 256
parameters each, split evenly by FSDP2 over 1, 2 or 4 ranks."""

import os

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

DIM = 256


def model_fn():
    return nn.Sequential(nn.Linear(DIM, DIM), nn.ReLU(), nn.Linear(DIM, DIM))


def parallelize(model, mesh):
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def hyperdryrun_job(launch):
    replicate = int(launch.layout.get("replicate", 1))
    rows = int(launch.layout.get("rows", 64))
    return {
        "model_fn": model_fn,
        "batch_fn": lambda i, device: torch.randn(rows, DIM, device=device),
        "loss_fn": lambda model, x: model(x).pow(2).mean(),
        "parallelize_fn": parallelize,
        "optimizer_fn": lambda params: torch.optim.AdamW(params, lr=1e-3, foreach=True),
        "mesh_shape": (replicate, launch.world_size // replicate),
        "mesh_dim_names": ("replicate", "shard"),
        # what torchrun would have set, seen by the job function
        "metadata": {"env_rank": os.environ["RANK"], "env_world_size": os.environ["WORLD_SIZE"]},
        # the script's word on which ranks are alike: rank 0 stands apart (as one that logs or checkpoints would)
        "rank_class": "first" if launch.rank == 0 else "rest",
    }


def hyperdryrun_layouts(world_size):
    return [{"rows": 1 << 20}, {"rows": 64, "replicate": 2}]
