"""Comparing two records of one layer: byte totals, op names, allocations and saved tensors."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from hyperdryrun.trace.blocks import ALIGNMENT, round_size


def summary(rec: dict[str, Any], alignment: int = ALIGNMENT) -> dict[str, int]:
    """Byte totals of one layer record: new storages per phase (raw and rounded) and saved tensors."""
    out = {}
    for phase in ("forward", "backward", "step"):
        sizes = [s for _, new in rec.get(phase, []) for s in new]
        out[f"{phase}_bytes"] = sum(sizes)
        out[f"{phase}_blocks"] = sum(round_size(s, alignment) for s in sizes)
    out["saved_bytes"] = sum(b for _, _, b in rec.get("saved", []))
    return out


def _alloc_multiset(events: list) -> Counter:
    return Counter((op, tuple(new)) for op, new in events if new)


class KnownDifference(list):
    """The differences of a layer where an audited, unmodelled difference (a
    :class:`~hyperdryrun.world.cuda_target.KernelDifference` with no ``handled_by``, e.g. BatchNorm's cuDNN kernel)
    is expected, and every byte total agrees: only op names and empty tensors differ. Not a failure."""

    def __init__(self, problems: list[str], difference: Any) -> None:
        super().__init__(problems)
        self.difference = difference


def expected_difference(name: str) -> Any:
    """The audited difference the kernel audit expects to find in layer ``name`` unmodelled, or None."""
    from hyperdryrun.world.cuda_target import DIFFERENCES

    return next((d for d in DIFFERENCES if name in d.audit_layers and not d.handled_by), None)


def judge_layer(name: str, reference: dict[str, Any], simulated: dict[str, Any]) -> list[str]:
    """:func:`diff_layer`, as a :class:`KnownDifference` where the layer's difference is an audited, unmodelled
    one and the byte totals (:func:`summary`: new storages per phase, saved tensors) agree."""
    problems = diff_layer(reference, simulated)
    known = expected_difference(name)
    if (
        problems
        and known is not None
        and "error" not in reference
        and "error" not in simulated
        and summary(reference) == summary(simulated)
    ):
        return KnownDifference(problems, known)
    return problems


def diff_layer(reference: dict[str, Any], simulated: dict[str, Any]) -> list[str]:
    """Human-readable differences between two records of one layer (empty when they agree)."""
    if "error" in reference or "error" in simulated:
        return [f"not recorded: reference {reference.get('error')!r}, simulated {simulated.get('error')!r}"]
    problems = []
    ref_sum, sim_sum = summary(reference), summary(simulated)
    for key in ref_sum:
        if ref_sum[key] != sim_sum[key]:
            problems.append(f"{key}: reference {ref_sum[key]}, simulated {sim_sum[key]}")
    for phase in ("forward", "backward", "step"):
        ref_ops = Counter(op for op, _ in reference.get(phase, []))
        sim_ops = Counter(op for op, _ in simulated.get(phase, []))
        if ref_ops != sim_ops:
            problems.append(
                f"{phase} ops: only in reference {sorted((ref_ops - sim_ops).elements())}, "
                f"only simulated {sorted((sim_ops - ref_ops).elements())}"
            )
        ref, sim = _alloc_multiset(reference.get(phase, [])), _alloc_multiset(simulated.get(phase, []))
        if ref != sim:
            only_ref, only_sim = ref - sim, sim - ref
            problems.append(
                f"{phase} allocations: only in reference {sorted(only_ref.elements())}, "
                f"only simulated {sorted(only_sim.elements())}"
            )
    ref_saved = Counter(json.dumps(s) for s in reference.get("saved", []))
    sim_saved = Counter(json.dumps(s) for s in simulated.get("saved", []))
    if ref_saved != sim_saved:
        problems.append(
            f"saved: only in reference {sorted((ref_saved - sim_saved).elements())}, "
            f"only simulated {sorted((sim_saved - ref_saved).elements())}"
        )
    return problems


__all__ = ["KnownDifference", "diff_layer", "expected_difference", "judge_layer", "summary"]
