"""The CUDA streams a step runs on, observed on the simulation device and named as the real job names them.

FSDP2 (torch 2.13 ``torch/distributed/fsdp/_fully_shard``) issues its communication on side streams it creates in
``FSDPCommContext.lazy_init`` (one set per FSDP root): the all-gather copy-in stream, the all-gather stream, the
reduce-scatter stream and the HSDP all-reduce stream, entered with ``device_handle.stream(...)``. On a fake "cpu"
device the device handle is ``torch.cpu``, whose ``Stream`` objects are placeholders but whose ``stream()`` context
really sets ``torch.cpu.current_stream()``: so the current stream at every allocation is observable, and only the
names of FSDP's streams need recording (:func:`fsdp_stream_patches`). What lands where (torch 2.13 sources):

- ``foreach_all_gather``: the flat all-gather output (and the ``param_dtype`` copies of the shards) is allocated
  under the copy-in stream; the collective itself, on the all-gather stream, allocates nothing.
- ``foreach_all_gather_copy_out`` and the unsharded parameters: the current (compute) stream.
- ``foreach_reduce``: the reduce-scatter input and its copy-in on the current stream; the reduce-scatter output
  (the sharded gradient) on the reduce-scatter stream; with HSDP the all-reduce runs in place on the all-reduce
  stream, where a cast to the parameter dtype (``reduce_dtype`` != stored dtype) is then allocated.
- Collectives of DTensor (TP, SP, CP, EP) and pipeline point-to-point ops allocate their outputs on the current
  stream; NCCL runs them on its internal stream but, with ``TORCH_NCCL_AVOID_RECORD_STREAMS`` the default in
  torch 2.13, keeps the tensors alive itself instead of calling ``record_stream``, so no block is held for NCCL.

FSDP2 orders its cross-stream uses with events and keeps references instead of ``record_stream``; only an explicit
``Tensor.record_stream`` tells the allocator of another stream (:func:`record_stream_patch`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hyperdryrun.compat import torch_streams
from hyperdryrun.compat.torch_streams import FSDP_STREAMS
from hyperdryrun.patches import Patch
from hyperdryrun.trace.blocks import COMPUTE_STREAM

COMPUTE_STREAM_NAME = "compute"


def _key(stream: Any) -> Any:
    """Identity of a stream object: CUDA streams by their id (a new Python object per query), others by object."""
    sid = getattr(stream, "stream_id", None)
    return ("cuda", sid) if isinstance(sid, int) else id(stream)


class StreamRegistry:
    """Stream ids of one world: 0 is the compute (default) stream, side streams get 1, 2, ... when first seen."""

    def __init__(self, device: str) -> None:
        self._module = torch.get_device_module(device) if device != "cpu" else torch.cpu
        default = self._module.current_stream()
        self._ids: dict[Any, int] = {_key(default): COMPUTE_STREAM}
        self._keep: list[Any] = [default]  # held so that ids of placeholder streams are never reused
        self.names: dict[int, str] = {COMPUTE_STREAM: COMPUTE_STREAM_NAME}

    def register(self, stream: Any, name: str) -> int:
        """Give ``stream`` the next id under ``name`` (its existing id if known)."""
        key = _key(stream)
        if key not in self._ids:
            sid = len(self.names)
            self._ids[key] = sid
            self._keep.append(stream)
            taken = set(self.names.values())
            label, n = name, 2
            while label in taken:  # a second FSDP root has a second set of streams
                label, n = f"{name} ({n})", n + 1
            self.names[sid] = label
        return self._ids[key]

    def id_of(self, stream: Any) -> int:
        """The id of ``stream``; a stream not seen before is registered as ``stream <id>``."""
        sid = self._ids.get(_key(stream))
        return sid if sid is not None else self.register(stream, f"stream {len(self.names)}")

    def current(self) -> int:
        """The id of the simulation device's current stream."""
        return self.id_of(self._module.current_stream())


def fsdp_stream_patches(registry: StreamRegistry) -> list[Patch]:
    """Name FSDP2's communication streams when each FSDP root creates them
    (:func:`hyperdryrun.compat.torch_streams.fsdp_stream_patches`)."""
    return torch_streams.fsdp_stream_patches(registry.register)


def record_stream_patch(registry: StreamRegistry, tracker_of: Callable[[], Any]) -> Patch:
    """While a tracker records, ``Tensor.record_stream`` records the stream on the tensor's block instead of
    calling the kernel; otherwise (a measured run on a real device) it is torch's own
    (:func:`hyperdryrun.compat.torch_streams.record_stream_patch`)."""

    def record(tensor: torch.Tensor, stream: Any) -> bool:
        tracker = tracker_of()
        if tracker is None or not tracker.active:
            return False
        tracker.record_stream(tensor, registry.id_of(stream))
        return True

    return torch_streams.record_stream_patch(record)


__all__ = ["FSDP_STREAMS", "StreamRegistry", "fsdp_stream_patches", "record_stream_patch"]
