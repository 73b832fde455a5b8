"""torch's pipeline schedules (``torch/distributed/pipelining/schedules.py``), by release."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hyperdryrun.patches import Patch


def metadata_vote() -> bool:
    """Whether a schedule's first step runs a P2P vote on the stages' input/output metadata.

    torch 2.12 to 2.14: ``_PipelineSchedule._warmup_p2p`` (called from ``_initialize_stages``) has every stage vote
    on whether its metadata is static (``InferenceMode`` in ``torch/distributed/pipelining/_utils.py``) and reads
    the outcome with ``.item()``, which fake tensors cannot answer (:func:`static_vote_patch` answers
    it). torch 2.11 has neither the vote nor ``InferenceMode``: a stage built with
    ``input_args``/``output_args`` uses them as they are; torch 2.15 has no ``_warmup_p2p`` either (feature
    detection: ``hasattr``).
    """
    from torch.distributed.pipelining.schedules import _PipelineSchedule

    return hasattr(_PipelineSchedule, "_warmup_p2p")


def receive_buffer(info: Any) -> Any | None:
    """The buffer a ``PipelineStage`` receives one input or gradient into (an entry of its ``args_recv_info`` /
    ``grad_recv_info``), or None for a model input, which is passed in rather than received.

    torch 2.12 and later (``torch/distributed/pipelining/stage.py``; 2.15: ``_recv_buffers.py``): every entry is a
    ``_RecvInfo``, a model input one with ``is_root_arg=True`` and ``buffer=None``. torch 2.11: a model input is a
    ``_RootArgPlaceholder`` (no ``buffer``) and a ``_RecvInfo`` (no ``is_root_arg``) is always received into its
    ``buffer``. Decided by the attributes the entry has, so both shapes read the same. torch 2.15 allocates a buffer
    just before its receive (``_RecvInfo.allocate_buffer``) and hands it to the computation (``take_buffer``), so
    between steps every entry's ``buffer`` is None: nothing is kept.
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


class SentFakeOutputsReleased:
    """Mixin for a dry run's ``PipelineStage`` subclass (listed before ``PipelineStage``): a forward output that is
    a ``FakeTensor`` is released after its send as the plain tensor it stands for is on the target.

    torch 2.15 (``torch/distributed/pipelining/stage.py``: ``_output_slot_is_releasable``, ``_ForwardChunkState``,
    ``release_fwd_send_outputs``): once an output's send completes, the stage drops its reference and backward
    starts from the output's gradient edge, but only for an output whose type is exactly ``torch.Tensor`` (and not
    on the last stage, under DDP or with a custom ``dw_builder``). A dry run's outputs are ``FakeTensor``: refused
    ("output type FakeTensor"), each sent output stayed alive until its micro batch's backward, one activation per
    micro batch in flight more than real execution (+32,768 B on the accuracy matrix's pp=2 1F1B rank 0). The check
    is asked about a plain tensor in the fake one's place, so every other condition stays torch's. torch 2.11 to
    2.14 keep every output until backward and have no such check: the method is never called there.
    """

    def _output_slot_is_releasable(self, output: Any) -> tuple[bool, str]:
        import torch
        from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

        if type(output) is FakeTensor:  # what torch checks is the type: a real run's output is a torch.Tensor
            with unset_fake_temporarily():
                output = torch.empty(0, device="cpu")
        return super()._output_slot_is_releasable(output)  # type: ignore[misc]


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
