"""torch's fake-tensor dispatch cache (``torch/_subclasses/fake_tensor.py``), by release: the key of an op's arguments.

torch 2.11 to 2.15 ``FakeTensorMode._cached_dispatch_impl`` keys every op by its arguments flattened into one list
(``_cache_key`` -> ``_prep_args_for_hash``): each FakeTensor becomes its ``TensorMetadata``
(``extract_tensor_metadata``), flattened field by field (``TensorMetadata._flatten_into`` walks
``dataclasses.fields`` and calls ``_prep_args_for_hash`` again for the shape and the strides, each int as
``(int, value)``), and every call of ``_prep_args_for_hash`` runs two function-level imports. That is Python work
per argument per op: 52-79 of the 127-148 µs of a cached ``mm`` under a FakeTensorMode on this machine (15-18 µs
with the method below), on each of the ~85,000 cached dispatches of a 405B pipeline rank.

:func:`cache_key_flattener` gives the fake modes of the world (:class:`~hyperdryrun.trace.tracker.TrackingFakeTensorMode`,
a FakeTensorMode subclass: no patch of torch) a ``_prep_args_for_hash`` that appends the same list for what a training
step passes (FakeTensors that are the mode's own, strided, with concrete sizes and no constant; ints, floats, bools,
strings, None, dtypes, layouts, memory formats; tuples, lists, ``torch.Size``, dicts of those) and hands anything
else, from the call's start, to torch's own: symbolic sizes (whose keys record back-references in the key state),
devices (torch 2.15 pins an index-less device's index), functions, graph modules, other tensors, sparse or mkldnn
layouts. The same list means the same key, so entries are shared with torch's own modes. The fast path never
touches the key state or the id-hashed objects, so handing a call back leaves nothing half done. Used only on the
supported releases (:data:`~hyperdryrun.compat.versions.SUPPORTED_TORCH`: a release past them, run with
``HYPERDRYRUN_ALLOW_UNSUPPORTED_TORCH``, may key differently) and when torch's ``TensorMetadata`` has the fields this
module writes (:data:`METADATA_FIELDS`, the same from 2.11 to 2.15); else torch's own method. Tests:
``tests/compat/test_torch_fake_tensor.py`` (every key of a tensor- and pipeline-parallel dry run and of an
expert-parallel one equal to torch's, on every supported release).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch._prims_common import suggest_memory_format
from torch._subclasses.fake_tensor import FakeTensor

METADATA_FIELDS = (
    "dtype", "shape", "stride", "device", "layout", "memory_format", "storage_offset", "storage_bytes",
    "requires_grad", "is_quantized", "is_conj", "is_neg", "is_inference", "is_sparse", "is_coalesced", "dense_dim",
    "sparse_dim",
)  # fmt: skip
"""torch's ``TensorMetadata`` fields, in order, as :func:`_flatten` writes them for a strided tensor."""


class _TorchsOwn(Exception):
    """Raised inside :func:`_flatten` for an argument it does not write: the whole call goes to torch's method."""


_SCALARS = frozenset({int, float, bool, str, type(None), torch.dtype, torch.layout, torch.memory_format})
"""Argument types torch's ``_prep_args_for_hash`` writes as ``(type, value)`` on every supported release (its last
branch): none of them is a tensor, a symbolic value, a container, a function or a device."""
_HEADED = frozenset({tuple, list, torch.Size})
_DICT_VIEWS = frozenset({type({}.keys()), type({}.values())})


def _flatten(mode: Any, result: list[object], args: Any) -> None:
    """torch's ``_prep_args_for_hash(result, args, ...)`` for the arguments named in the module docstring; raises
    :class:`_TorchsOwn` at anything else (``result`` is then cut back by the caller)."""
    append = result.append
    kind = type(args)
    if kind in _HEADED:
        append(kind)
        append(f"length_{len(args)}")
    elif kind is dict:
        append(dict)
        append(f"length_{len(args)}")
        _flatten(mode, result, args.keys())
        _flatten(mode, result, args.values())
        return
    elif kind not in _DICT_VIEWS:
        raise _TorchsOwn
    for arg in args:
        t = type(arg)
        if t in _SCALARS:
            append(t)
            append(arg)
        elif t is FakeTensor:
            if (
                arg.fake_mode is not mode
                or arg.constant is not None
                or arg.layout is not torch.strided
                or arg._has_symbolic_sizes_strides
            ):
                raise _TorchsOwn
            # extract_tensor_metadata(arg), then TensorMetadata._flatten_into: the shape and strides as headed
            # sequences of (int, value), the other fields as they are
            shape = arg.shape
            stride = arg.stride()
            ndim = len(shape)
            # suggest_memory_format: channels-last only for 4 and 5 dimensions
            memory_format = suggest_memory_format(arg) if ndim == 4 or ndim == 5 else torch.contiguous_format
            if not arg.is_contiguous(memory_format=memory_format):
                memory_format = None
            append(arg.dtype)
            append(torch.Size)
            append(f"length_{ndim}")
            for d in shape:
                append(int)
                append(d)
            append(tuple)
            append(f"length_{len(stride)}")
            for s in stride:
                append(int)
                append(s)
            result += (
                arg.device,
                torch.strided,
                memory_format,
                arg.storage_offset(),
                arg.untyped_storage().nbytes(),
                arg.requires_grad,
                arg.is_quantized,
                arg.is_conj(),
                arg.is_neg(),
                arg.is_inference(),
                arg.is_sparse,
                None,  # is_coalesced: sparse only
                None,  # dense_dim
                None,  # sparse_dim
            )
        elif t in _HEADED or t is dict:
            _flatten(mode, result, arg)
        else:
            raise _TorchsOwn


def cache_key_flattener() -> Callable[..., None]:
    """The ``_prep_args_for_hash`` for a FakeTensorMode subclass: the fast one (module docstring) when torch's
    ``TensorMetadata`` has :data:`METADATA_FIELDS` on a supported release, else torch's own."""
    from torch._subclasses import fake_tensor

    from hyperdryrun.compat.versions import SUPPORTED_TORCH, release, torch_version

    torchs = fake_tensor.FakeTensorMode._prep_args_for_hash
    found = release(torch_version())
    if found is None or not SUPPORTED_TORCH[0] <= found <= SUPPORTED_TORCH[1]:
        return torchs
    metadata = getattr(fake_tensor, "TensorMetadata", None)
    if metadata is None or tuple(f.name for f in dataclasses.fields(metadata)) != METADATA_FIELDS:
        return torchs

    def _prep_args_for_hash(self, result, args, state, id_hashed_objects):
        start = len(result)
        try:
            _flatten(self, result, args)
        except _TorchsOwn:
            del result[start:]
            torchs(self, result, args, state, id_hashed_objects)

    _prep_args_for_hash.__doc__ = torchs.__doc__
    return _prep_args_for_hash
