"""``F.scaled_dot_product_attention`` as torch runs it on a CUDA GPU, bound to a
:class:`~hyperdryrun.world.cuda_target.CudaTarget` (the default: ``DEFAULT_CUDA_TARGET``). The rules themselves depend
on the torch release and live in :mod:`hyperdryrun.compat.torch_sdpa`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from hyperdryrun.compat import torch_sdpa
from hyperdryrun.world.cuda_target import DEFAULT_CUDA_TARGET, CudaTarget


def sdpa_priority(target: CudaTarget = DEFAULT_CUDA_TARGET) -> tuple[str, ...]:
    """The SDPA backends torch 2.13 tries in turn on ``target`` (first usable wins), e.g. cudnn first on sm90."""
    return torch_sdpa.sdpa_priority(target)


def cuda_sdpa_backend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    enable_gqa: bool = False,
    target: CudaTarget = DEFAULT_CUDA_TARGET,
) -> str:
    """The backend torch 2.13's CUDA ``select_sdp_backend`` picks on ``target``: cudnn, flash, efficient or math
    (:func:`hyperdryrun.compat.torch_sdpa.cuda_sdpa_backend`)."""
    return torch_sdpa.cuda_sdpa_backend(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa, target)


def cuda_scaled_dot_product_attention(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
    *,
    target: CudaTarget = DEFAULT_CUDA_TARGET,
):
    """``F.scaled_dot_product_attention`` as torch 2.13's ``attention.cpp`` runs it on ``target``
    (:func:`hyperdryrun.compat.torch_sdpa.cuda_scaled_dot_product_attention`)."""
    return torch_sdpa.cuda_scaled_dot_product_attention(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, target=target
    )


def sdpa_for(target: CudaTarget) -> Callable[..., torch.Tensor]:
    """:func:`cuda_scaled_dot_product_attention` bound to ``target``, in ``F.scaled_dot_product_attention``'s
    signature (and keeping its own ``__name__``, which context parallel's function patching relies on)."""
    if target == DEFAULT_CUDA_TARGET:
        return cuda_scaled_dot_product_attention

    @functools.wraps(cuda_scaled_dot_product_attention)
    def bound(*args, **kwargs):
        return cuda_scaled_dot_product_attention(*args, **kwargs, target=target)

    return bound


__all__ = ["cuda_scaled_dot_product_attention", "cuda_sdpa_backend", "sdpa_for", "sdpa_priority"]
