"""torch's context parallel (``torch/distributed/tensor/experimental/_context_parallel/_attention.py``), by
release: how its function patching finds ``F.scaled_dot_product_attention``."""

from __future__ import annotations

from typing import Any

from hyperdryrun.patches import Patch


def sdpa_name_patch() -> Patch | None:
    """A stand-in named ``scaled_dot_product_attention`` for whatever ``F.scaled_dot_product_attention`` is now,
    None when it already has that name.

    torch 2.11 to 2.14 ``_distribute_function`` (the monkey-patch mode of ``context_parallel``) re-binds
    ``F.<fn.__name__>`` and restores by that name. The target-kernel SDPA of :mod:`hyperdryrun.world.kernels` is
    named ``cuda_scaled_dot_product_attention``, so CP's wrapper would land on that attribute and attention would
    run on the local shard only. Under this stand-in CP wraps it, and the CUDA backend choice still applies inside.
    """
    import torch
    import torch.nn.functional as F

    current = F.scaled_dot_product_attention
    if current.__name__ == "scaled_dot_product_attention":
        return None

    def scaled_dot_product_attention(*args: Any, **kwargs: Any) -> torch.Tensor:
        return current(*args, **kwargs)

    return Patch(
        F,
        "scaled_dot_product_attention",
        scaled_dot_product_attention,
        "torch 2.13 context_parallel's _distribute_function patches F.<fn.__name__>; the target-kernel SDPA has "
        "another __name__, so CP's ring-attention wrapper would not replace F.scaled_dot_product_attention",
    )
