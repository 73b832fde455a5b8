"""torch's untyped storages (``torch/storage.py``, ``UntypedStorage``), by release: calls that reach no dispatch
mode."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hyperdryrun.patches import Patch


def resize_patch(around: Callable[[Callable[[Any, int], Any], Any, int], Any]) -> Patch:
    """``UntypedStorage.resize_`` that runs ``around(resize, storage, size)`` (``resize`` is torch's own).

    torch 2.11 to 2.14: ``UntypedStorage.resize_`` (FSDP2's unshard/reshard, ``FSDPParam.alloc_storage`` and
    ``free_storage`` in ``torch/distributed/fsdp/_fully_shard/_fsdp_common.py``) is a direct C++ call
    (``THPStorage_resize_``) that never reaches a dispatch mode, so the tracker wraps it."""
    import torch

    orig = torch.UntypedStorage.resize_

    def resize_(st: torch.UntypedStorage, size: int) -> Any:
        return around(orig, st, size)

    return Patch(
        torch.UntypedStorage,
        "resize_",
        resize_,
        reason="torch 2.13 UntypedStorage.resize_ (FSDP2's unshard/reshard: FSDPParam.alloc_storage and "
        "free_storage) is a direct C++ call that never reaches a dispatch mode; wrapped for the tracked span.",
    )
