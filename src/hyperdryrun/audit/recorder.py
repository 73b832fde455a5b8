"""What one layer does on fake tensors: every dispatched op with the bytes of the new storages it returns, and the
tensors autograd saves for backward."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

from hyperdryrun.trace.tracker import METADATA_OPS, iter_tensors

Event = tuple[str, list[int]]
"""One dispatched op: its name and the bytes of each new output storage (empty when it allocates nothing)."""


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (what the device holds), else the tensor."""
    return getattr(t, "_local_tensor", t)


class OpRecorder(TorchDispatchMode):
    """Records every outermost aten op with the bytes of the new storages it returns (the tracker's rule:
    outputs on an input's storage, views and metadata queries are no allocation)."""

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type
        self.events: dict[str, list[Event]] = {}
        self.phase = "forward"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in METADATA_OPS or getattr(func, "is_view", False):
            return out
        inputs = {id(_local(t).untyped_storage()) for t in iter_tensors(args)}
        inputs.update(id(_local(t).untyped_storage()) for t in iter_tensors(kwargs))
        new: list[int] = []
        seen: set[int] = set()
        for t in map(_local, iter_tensors(out)):
            if not isinstance(t, FakeTensor) or t.device.type != self.device_type:
                continue  # host tensors of a CUDA step (e.g. a CPU scalar) are no device memory
            st = t.untyped_storage()
            key = id(st)
            if key in inputs or key in seen or st.nbytes() == 0:
                continue
            seen.add(key)
            new.append(int(st.nbytes()))
        name = str(func.overloadpacket.__name__) if hasattr(func, "overloadpacket") else str(func)
        self.events.setdefault(self.phase, []).append((name, new))
        return out


@contextmanager
def saved_tensors(into: list[list[Any]]) -> Iterator[None]:
    """Record (shape, dtype, storage bytes) of every tensor autograd saves for backward."""

    def pack(t: torch.Tensor) -> torch.Tensor:
        local = _local(t)
        into.append(
            [
                list(local.shape),
                str(local.dtype).removeprefix("torch."),
                int(local.untyped_storage().nbytes()),
            ]
        )
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


__all__ = ["Event", "OpRecorder", "saved_tensors"]
