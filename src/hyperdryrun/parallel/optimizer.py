"""The optimizer of the built-in recipe, in the implementation the job names (foreach, fused, for-loop)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hyperdryrun.config import JobConfig


def build_optimizer(params, cfg: JobConfig) -> torch.optim.Optimizer:
    """AdamW, Adam or SGD over ``params`` with the job's learning rate, momentum and weight decay."""
    t = cfg.training
    impl = {
        "foreach": {"foreach": True},
        "fused": {"fused": True},
        "for-loop": {"foreach": False},
    }[t.optimizer_impl]
    if t.optimizer == "SGD":
        return torch.optim.SGD(params, lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay, **impl)
    cls = torch.optim.AdamW if t.optimizer == "AdamW" else torch.optim.Adam
    return cls(params, lr=t.lr, weight_decay=t.weight_decay, **impl)
