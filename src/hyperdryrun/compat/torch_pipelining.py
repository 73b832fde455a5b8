"""torch's pipeline schedules (``torch/distributed/pipelining/schedules.py``), by release."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hyperdryrun.patches import Patch


def metadata_vote() -> bool:
    """Whether a schedule's first step runs a P2P vote on the stages' input/output metadata.

    torch 2.12 and later: ``_PipelineSchedule._warmup_p2p`` (called from ``_initialize_stages``) has every stage vote
    on whether its metadata is static (``InferenceMode`` in ``torch/distributed/pipelining/_utils.py``) and reads
    the outcome with ``.item()``, which fake tensors cannot answer (:func:`static_vote_patch` answers
    it). torch 2.11 has neither the vote nor ``InferenceMode``: a stage built with
    ``input_args``/``output_args`` uses them as they are (feature detection: ``hasattr``).
    """
    from torch.distributed.pipelining.schedules import _PipelineSchedule

    return hasattr(_PipelineSchedule, "_warmup_p2p")


def receive_buffer(info: Any) -> Any | None:
    """The buffer a ``PipelineStage`` receives one input or gradient into (an entry of its ``args_recv_info`` /
    ``grad_recv_info``), or None for a model input, which is passed in rather than received.

    torch 2.12 and later (``torch/distributed/pipelining/stage.py``): every entry is a ``_RecvInfo``, a model input
    one with ``is_root_arg=True`` and ``buffer=None``. torch 2.11: a model input is a ``_RootArgPlaceholder`` (no
    ``buffer``) and a ``_RecvInfo`` (no ``is_root_arg``) is always received into its ``buffer``. Decided by the
    attributes the entry has, so both shapes read the same.
    """
    if getattr(info, "is_root_arg", False):
        return None
    return getattr(info, "buffer", None)


def last_stage_outputs_unchecked(stage: Any) -> bool:
    """Whether torch leaves the last stage's forward outputs unvalidated where it validates the others' (so a
    static stage of ours checks them itself).

    torch 2.12 and later (``torch/distributed/pipelining/stage.py``, ``forward_one_chunk``): stage tensors are
    validated only under ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (``_runtime_validate``), and the outputs only of stages
    that send them (``not self.is_last``). torch 2.11 validates every stage's outputs, the last one's included
    (``_validate_fwd_outputs``), and has no ``_runtime_validate``: nothing is left to check.
    """
    return bool(getattr(stage, "_runtime_validate", False)) and stage.is_last


def static_vote_patch(refusal: Callable[[Any], Exception]) -> Patch:
    """``_PipelineSchedule._warmup_p2p`` that sets every stage's outcome to STATIC, raising ``refusal(stage)`` for a
    stage whose metadata is incomplete instead of guessing.

    torch 2.12 and later (``torch/distributed/pipelining/schedules.py``, ``InferenceMode`` in ``_utils.py``):
    ``_warmup_p2p`` runs a P2P vote on whether every stage has static metadata and reads its outcome with
    ``.item()``, a data-dependent read that fake tensors cannot answer. Only where :func:`metadata_vote` says the
    release runs it (torch 2.11 has neither)."""
    from torch.distributed.pipelining._utils import InferenceMode
    from torch.distributed.pipelining.schedules import _PipelineSchedule

    def warmup_static(self: Any, stages: list, has_backward: bool, p2p_done: bool) -> None:
        for stage in stages:
            if InferenceMode.needs_dynamic(stage._user_meta, has_backward):
                raise refusal(stage)
            stage._inference_mode = InferenceMode.STATIC

    return Patch(
        _PipelineSchedule,
        "_warmup_p2p",
        warmup_static,
        "torch 2.12+ _PipelineSchedule._warmup_p2p reads the P2P metadata vote with .item(), data-dependent on "
        "fake tensors (DataDependentOutputException)",
    )
