"""The optimizer of the built-in recipe, in the implementation the job names (foreach, fused, for-loop)."""

from __future__ import annotations

import torch


def build_optimizer(
    params, *, name: str, impl: str, lr: float, momentum: float, weight_decay: float
) -> torch.optim.Optimizer:
    """``name`` (AdamW, Adam or SGD) over ``params`` in implementation ``impl`` (foreach, fused, for-loop) with the
    job's learning rate, momentum (SGD) and weight decay (``training.optimizer``, ``optimizer_impl``, ...)."""
    kwargs = {
        "foreach": {"foreach": True},
        "fused": {"fused": True},
        "for-loop": {"foreach": False},
    }[impl]
    if name == "SGD":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay, **kwargs)
    cls = torch.optim.AdamW if name == "AdamW" else torch.optim.Adam
    return cls(params, lr=lr, weight_decay=weight_decay, **kwargs)
