"""FSDP2 behaviour the tracker cannot see through its hooks, and the patches that show it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hyperdryrun.compat import torch_fsdp
from hyperdryrun.patches import Patch
from hyperdryrun.trace.blocks import Category


def gradient_accumulation_buffers(tracker_of: Callable[[], Any]) -> list[Patch]:
    """While gradient sync is off (``set_requires_gradient_sync(False)``, which torch's pipeline stages do until the
    last micro batch), torch 2.13 FSDP2 keeps each parameter's unsharded gradient as
    ``FSDPParam.unsharded_accumulated_grad``, cast to ``reduce_dtype`` in ``to_accumulated_grad_if_needed``. No
    gradient hook fires for that copy, so without this it would be categorised as a backward temporary. None where
    the release has no such copy (:func:`~hyperdryrun.compat.torch_fsdp.accumulated_grad_patches`)."""

    def label(fsdp_param: Any) -> None:
        tracker = tracker_of()
        grad = fsdp_param.unsharded_accumulated_grad
        if tracker is not None and tracker.active and grad is not None:
            tracker.mark(grad, Category.GRADIENT)

    return torch_fsdp.accumulated_grad_patches(label)
