"""torch's dispatch modes (``torch/utils/_python_dispatch.py``, ``TorchDispatchMode``), by release: the Dynamo
wrapper on each subclass's ``__torch_dispatch__``.

torch 2.11 to 2.15 ``TorchDispatchMode.__init_subclass__`` replaces every subclass's own ``__torch_dispatch__`` with
``torch._disable_dynamo(raw, recursive=True)``: each call sets Dynamo's frame callback off, asks
``_callback_from_stance`` and restores it (about 1 µs on this machine). The world's fake mode is three such classes
deep (``FakeTensorMode`` <- ``TrackingFakeTensorMode`` <- ``TargetFakeTensorMode``), each calling the one below
through its wrapper: three wrappers an op where the outermost one already holds the callback off for every frame
below it (recursive). A 405B pipeline rank dispatches ~260,000 ops. The subclasses therefore call the class below
by :func:`unwrapped_dispatch`; the outermost wrapper stays, so no frame below it runs under Dynamo's callback.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch


def _probe() -> None:
    return None


_DISABLE_WRAPPER = torch._disable_dynamo(_probe, recursive=True).__code__
"""The code of ``torch._disable_dynamo``'s wrapper (``torch/_compile.py``, ``inner``): every wrapper it makes shares it
(made without importing Dynamo: that happens on the wrapper's first call)."""


def unwrapped_dispatch(cls: type) -> Callable[..., Any]:
    """``cls``'s own ``__torch_dispatch__`` without torch's Dynamo wrapper, to be called from a subclass's
    ``__torch_dispatch__`` (itself wrapped); the function as it is where ``cls`` defines it unwrapped."""
    fn = cls.__dict__["__torch_dispatch__"]
    if getattr(fn, "__code__", None) is _DISABLE_WRAPPER and callable(getattr(fn, "__wrapped__", None)):
        return fn.__wrapped__
    return fn


@functools.cache
def fake_tensor_dispatch() -> Callable[..., Any]:
    """``FakeTensorMode.__torch_dispatch__`` unwrapped (:func:`unwrapped_dispatch`), answering ``NotImplemented`` at
    once for an op on DTensors, as FakeTensorMode itself answers it after trying its cache.

    torch 2.11 to 2.15 ``FakeTensorMode.dispatch``: below DTensor's autograd, every DTensor op reaches the fake mode
    (modes come before subclasses) with the DTensors as arguments; unless the op is one of the few it answers
    directly (``_DISPATCH_META_HANDLERS``, ``_DISPATCH_HANDLE_DIRECTLY``), it computes a cache key, which fails on
    the first DTensor ("non-fake tensor"), then ``_dispatch_impl`` flattens the arguments, finds the DTensor
    (``_check_for_subclass``: a DTensor is neither a FakeTensor, nor a plain Tensor or Parameter) and returns
    ``NotImplemented``, handing the op to ``DTensor.__torch_dispatch__``. A 405B pipeline rank sends ~32,000 ops
    that way. ``types`` (the overloaded argument types the dispatcher collected) holding ``DTensor`` itself means
    a DTensor is among the arguments; anything else takes FakeTensorMode's own path. Made once: the tracking and
    the target fake modes call the same function."""
    from torch._subclasses import fake_tensor
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor import DTensor

    raw = unwrapped_dispatch(FakeTensorMode)
    answered_directly = frozenset(
        id(f) for f in (*fake_tensor._DISPATCH_META_HANDLERS, *fake_tensor._DISPATCH_HANDLE_DIRECTLY)
    )

    def dispatch(mode: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if DTensor in types and id(func) not in answered_directly:
            return NotImplemented
        return raw(mode, func, types, args, kwargs)

    return dispatch
