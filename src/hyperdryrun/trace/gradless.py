"""Parameters an optimizer steps without a gradient: the dry run makes every trainable parameter's optimizer
states before the step, which a job whose steps never reach a parameter never has."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from hyperdryrun.trace.optimizer_state import state_tensors
from hyperdryrun.trace.tensors import clean_fqn


@contextlib.contextmanager
def gradless_parameters(model: nn.Module) -> Iterator[Callable[[], list[str]]]:
    """Watch every optimizer step of the body (a global step pre-hook, removed on exit) for parameters stepped
    without a gradient; yields a function that gives one limitation line naming them (or none).

    torch's optimizers skip a parameter whose ``grad`` is None, so a job whose steps never reach it (a multimodal
    model's vision encoder under text-only batches) never makes its states, while the dry run makes every
    trainable parameter's states before the step (the steady state of a job that trains them all)."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    names = {id(p): name for name, p in model.named_parameters()}
    without: dict[int, tuple[str, Any, Any]] = {}
    with_grad: set[int] = set()

    def pre_hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    without.setdefault(id(p), (names.get(id(p), "?"), p, optimizer))
                else:
                    with_grad.add(id(p))

    def line() -> list[str]:
        found = sorted(
            (v for k, v in without.items() if k not in with_grad and v[0] != "?"), key=lambda v: v[0]
        )
        if not found:
            return []
        ids = {id(p) for _, p, _ in found}
        state = sum(
            v.untyped_storage().nbytes()
            for optimizer in {id(o): o for _, _, o in found}.values()
            for p, v in state_tensors(optimizer)
            if p is not None and id(p) in ids
        )
        fqns = [clean_fqn(name) for name, _, _ in found]
        prefix = []
        for parts in zip(*(f.split(".")[:-1] for f in fqns), strict=False):
            if len(set(parts)) > 1:
                break
            prefix.append(parts[0])
        under = f" under {'.'.join(prefix)}" if prefix else ""
        shown = ", ".join(fqns[:3]) + (f" and {len(fqns) - 3} more" if len(fqns) > 3 else "")
        plural = "s" if len(found) != 1 else ""
        return [
            f"no gradient in this step: {len(found)} parameter{plural}{under} ({shown}) got none, so the optimizer "
            f"skipped them; their optimizer states ({state:,} B) are counted, as a job whose steps reach them holds "
            "them (one whose steps never do, e.g. text-only batches for a vision encoder, never makes them)"
        ]

    handle = register_optimizer_step_pre_hook(pre_hook)
    try:
        yield line
    finally:
        handle.remove()
