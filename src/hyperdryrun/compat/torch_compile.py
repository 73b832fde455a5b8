"""torch.compile's eager stance and higher-order operators (``torch/_dynamo/eval_frame.py``, ``torch/_ops.py``), by
release: what the world patches to see which compiled regions ran and to give its fake mode the HOPs' rules."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

from hyperdryrun.patches import Patch

TORCH_INTERNAL_REGIONS = {
    "torch.nn.attention.flex_attention.flex_attention.<locals>._flex_attention_hop_wrapper"
}
"""torch.compile calls torch makes itself (torch 2.11 to 2.14 ``torch/nn/attention/flex_attention.py``: eager
flex_attention compiles its HOP call with the eager backend)."""


def stance_recording_patch(eval_frame: Any, on_compiled_call: Callable[[FrameType], None]) -> Patch:
    """``eval_frame._callback_from_stance`` that first calls ``on_compiled_call(frame)`` with the frame of the
    compile wrapper asking (its ``fn`` local is the function it compiles), for a real callback only.

    torch 2.11 to 2.14 ``torch/_dynamo/eval_frame.py``: ``_TorchDynamoContext.__call__``'s wrapper
    (``compile_wrapper``) asks ``_callback_from_stance(callback)`` for the frame callback on every call; under
    ``force_eager`` it answers None (run eagerly)."""
    original = eval_frame._callback_from_stance

    def callback_from_stance(callback: Any) -> Any:
        if callback not in (None, False):
            on_compiled_call(sys._getframe(1))
        return original(callback)

    return Patch(
        eval_frame,
        "_callback_from_stance",
        callback_from_stance,
        reason="torch 2.13 compile wrappers ask _callback_from_stance for the frame callback on every call; "
        "under force_eager it answers None (run eagerly). Wrapped to record which compiled regions ran eagerly.",
    )


def _passes_through(hop: Any) -> Callable[..., Any]:
    def rule(mode: Any, *args: Any, **kwargs: Any) -> Any:
        return hop(
            *args, **kwargs
        )  # HigherOrderOperator.dispatch has popped ``mode``: the modes below run it

    return rule


@contextlib.contextmanager
def hop_rules(mode_class: type, pass_through: type) -> Iterator[None]:
    """Give ``mode_class`` every higher-order operator's ``FakeTensorMode`` rule, and let HOPs pass through
    ``pass_through`` (a mode above it) to it; all removed again on exit.

    torch 2.11 to 2.14 ``HigherOrderOperator.dispatch`` (``torch/_ops.py``) looks up
    ``python_key_table[type(mode)]`` for the active mode: a FakeTensorMode subclass has no rule ("There was no rule
    registered for HigherOrderOperator flex_attention and mode ..."), although FakeTensorMode's rule
    (``mode.__torch_dispatch__(hop, ...)``) is exactly what it needs.
    """
    from torch._ops import _higher_order_ops
    from torch._subclasses.fake_tensor import FakeTensorMode

    added: list[tuple[Any, type]] = []
    try:
        for hop in list(_higher_order_ops.values()):
            rule = hop.python_key_table.get(FakeTensorMode)
            if rule is None:
                continue
            for cls, new in ((mode_class, rule), (pass_through, _passes_through(hop))):
                if cls is not FakeTensorMode and cls not in hop.python_key_table:
                    hop.python_key_table[cls] = new
                    added.append((hop, cls))
            hop._dispatch_cache.clear()
        yield
    finally:
        for hop, cls in added:
            hop.python_key_table.pop(cls, None)
            hop._dispatch_cache.clear()
