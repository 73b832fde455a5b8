"""torch's FSDP2 (``torch/distributed/fsdp/_fully_shard/``), by release."""

from __future__ import annotations


def accumulated_grad_copy() -> bool:
    """Whether FSDP2 accumulates a parameter's unsharded gradient in a copy of its own while gradient sync is off.

    torch 2.11 to 2.14 (``_fsdp_param.py``): ``FSDPParam.to_accumulated_grad_if_needed`` moves the unsharded
    gradient into ``unsharded_accumulated_grad``, cast to ``reduce_dtype``, a tensor no gradient hook sees
    (:func:`hyperdryrun.world.fsdp.gradient_accumulation_buffers` labels it). torch 2.15 removed the method: the
    autograd leaf owns accumulation and ``unsharded_accumulated_grad`` is a property returning the parameter's
    ``grad`` (feature detection: ``hasattr``).
    """
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    return hasattr(FSDPParam, "to_accumulated_grad_if_needed")
