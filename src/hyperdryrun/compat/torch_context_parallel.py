"""torch's context parallel (``torch/distributed/tensor/experimental/_context_parallel/_attention.py``), by
release: how its function patching finds ``F.scaled_dot_product_attention``, and the process globals it leaves
set."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
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


def _cp_module():
    from torch.distributed.tensor.experimental._context_parallel import _attention

    return _attention


@contextlib.contextmanager
def cp_globals(rotate_method: str) -> Iterator[None]:
    """Set ring attention's rotate method (``allgather`` or ``alltoall``) and restore every CP global of torch 2.13
    (``_attention.py``: ``_cp_options``, ``_dispatch_mode``, ``_replaced_functions``; DTensor's
    ``_op_dispatcher._custom_op_handlers``) on exit, also on error.

    ``context_parallel`` leaves ``_dispatch_mode`` set and an entry in ``_replaced_functions``; its exit resets
    DTensor's custom op handlers to their import-time value and keeps the sharding-propagation cache entries made
    under the CP sharding rules, which are cleared here so a later run cannot reuse them.
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import (
        _clear_fast_path_sharding_prop_cache,
        _clear_python_sharding_prop_cache,
    )

    cp = _cp_module()
    dispatcher = DTensor._op_dispatcher
    saved = (
        dataclasses.replace(cp._cp_options),
        cp._dispatch_mode,
        dict(cp._replaced_functions),
        dispatcher._custom_op_handlers,
    )
    try:
        cp.set_rotate_method(rotate_method)
        yield
    finally:
        options, cp._dispatch_mode, replaced, dispatcher._custom_op_handlers = saved
        for f in dataclasses.fields(options):
            setattr(cp._cp_options, f.name, getattr(options, f.name))
        cp._replaced_functions.clear()
        cp._replaced_functions.update(replaced)
        _clear_python_sharding_prop_cache()
        _clear_fast_path_sharding_prop_cache()
