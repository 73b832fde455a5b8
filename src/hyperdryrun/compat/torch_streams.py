"""torch's CUDA streams as FSDP2 and ``Tensor.record_stream`` use them (``torch/distributed/fsdp/_fully_shard/
_fsdp_param_group.py``, ``torch/_tensor.py``), by release: the patches that let the world name and record them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hyperdryrun.patches import Patch

FSDP_STREAMS = (
    ("all_gather_copy_in_stream", "fsdp all-gather copy-in"),
    ("all_gather_stream", "fsdp all-gather"),
    ("reduce_scatter_stream", "fsdp reduce-scatter"),
    ("all_reduce_stream", "fsdp all-reduce"),
)
"""``FSDPCommContext`` attributes holding its streams, and the names the report gives them, in id order (torch 2.11
to 2.14 ``_fsdp_param_group.py``: the four streams ``FSDPCommContext.lazy_init`` creates)."""


def fsdp_stream_patches(register: Callable[[Any, str], Any]) -> list[Patch]:
    """Name FSDP2's communication streams when each FSDP root creates them: ``register(stream, name)`` for each.

    torch 2.11 to 2.14 ``FSDPCommContext.lazy_init`` (``_fsdp_param_group.py``) creates the all-gather copy-in,
    all-gather, reduce-scatter and all-reduce streams; a stream attribute a release lacks is skipped
    (``getattr``)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPCommContext

    orig = FSDPCommContext.lazy_init

    def lazy_init(self: Any, device: Any) -> None:
        orig(self, device)
        for attr, name in FSDP_STREAMS:
            stream = getattr(self, attr, None)
            if stream is not None:
                register(stream, name)

    return [
        Patch(
            FSDPCommContext,
            "lazy_init",
            lazy_init,
            "torch 2.13 FSDP2 creates its all-gather copy-in, all-gather, reduce-scatter and all-reduce streams in "
            "FSDPCommContext.lazy_init; their names are recorded so each block's allocation stream is named",
        )
    ]


def record_stream_patch(record: Callable[[Any, Any], bool]) -> Patch:
    """``Tensor.record_stream`` (``torch/_tensor.py``, the C++ ``record_stream`` of ``TensorBody``) that first asks
    ``record(tensor, stream)``: True when it recorded the use itself (a tracker records), else torch's own runs
    (a measured run on a real device). torch 2.11 to 2.14 alike."""
    import torch

    orig = torch.Tensor.record_stream

    def record_stream(self: torch.Tensor, stream: Any) -> None:
        if not record(self, stream):
            return orig(self, stream)

    return Patch(
        torch.Tensor,
        "record_stream",
        record_stream,
        "torch 2.13 Tensor.record_stream on a fake CPU tensor with a torch.cpu.Stream raises 'unknown parameter "
        "type'; on CUDA it makes the caching allocator hold the block until the stream's uses finish, which the "
        "block's use_streams records instead",
    )
