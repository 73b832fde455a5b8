"""A script's job for the routing tests of ``hyperdryrun script`` (run only through the command): its loss asks the
run's routing for the tokens per expert of one routed layer (what an expert-parallel dispatch asks,
``moe.token_counts``) and holds ``HOT_ROWS`` fp32 rows per token of expert 0 while the loss is computed, so the
step's peak moves by exactly the routing's count for expert 0.

Routed layer ``layers.1.moe.experts``: 64 tokens, 8 experts, top 2 (balanced: 16 per expert)."""

import torch
from torch import nn

TOKENS, EXPERTS, TOP_K, ROW = 64, 8, 2, 1024


def loss_fn(model, x):
    from hyperdryrun.world.values import active_rules

    counts = active_rules().token_counts("layers.1.moe.experts", TOKENS, EXPERTS, TOP_K)
    hot = torch.ones(counts[0] * ROW, device=x.device)  # expert 0's rows, fp32
    return model(x).sum() + hot.sum()


def hyperdryrun_job(launch):
    return {
        "model_fn": lambda: nn.Linear(8, 8),
        "batch_fn": lambda i, device: torch.ones(4, 8, device=device),
        "loss_fn": loss_fn,
    }


def hyperdryrun_layouts(world_size):
    return [{}]
