"""Hugging Face transformers internals a dry run works around (``transformers/masking_utils.py``), by release."""

from __future__ import annotations

import sys
from collections.abc import Callable

from hyperdryrun.patches import Patch

PACKED_SEQUENCES_OP = "hf.packed_sequences"
"""The value point of transformers' packed-sequence check: whether the position ids of a batch pack several
sequences into one row (a ``branch`` value rule for this op answers it; the default is one sequence per row)."""

_REASON = (
    "transformers 5.x masking_utils.find_packed_sequence_indices reads the position ids' values (a new sequence "
    "wherever a position does not follow the previous one by 1) and returns None for one sequence per row; on fake "
    "position ids it cannot read them (is_tracing is true for a FakeTensor) and reports packed sequences, so "
    "create_causal_mask materialises the causal mask, SDPA gets that mask instead of is_causal, and "
    "sdpa_attention_forward repeats the key/value heads instead of enable_gqa (use_gqa_in_sdpa needs no mask). A "
    "real run on the model's own positions (arange when position_ids is None) finds one sequence per row"
)


def packed_sequence_patches(packed: Callable[[], bool]) -> list[Patch]:
    """transformers' packed-sequence check answered on fake position ids as a real run answers it on its values.

    ``transformers.masking_utils.find_packed_sequence_indices`` (5.x; the same in 5.17 and 5.25) decides from the
    position ids' values whether a row packs several sequences; where it finds none it returns None and the model
    runs SDPA with ``is_causal``, no mask and ``enable_gqa``. It cannot read fake values (``is_tracing`` is true for
    a FakeTensor) and always reports packing, which materialises the causal mask (bool, then the additive form SDPA
    saves per layer) and the repeated key/value heads per layer. Fake position ids get ``packed()``'s answer: False
    (one sequence per row, always true of the positions a model makes itself) returns None; True runs transformers'
    own code, whose fake result is the packed path. Real position ids (a measured run) run transformers' own code.
    No patch where transformers' masking utilities are not loaded (no Hugging Face model in this process)."""
    masking_utils = sys.modules.get("transformers.masking_utils")
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:
        return []
    from torch._subclasses.fake_tensor import FakeTensor

    def find_packed_sequence_indices(position_ids, *args, **kwargs):
        if isinstance(position_ids, FakeTensor) and not packed():
            return None
        return original(position_ids, *args, **kwargs)

    return [Patch(masking_utils, "find_packed_sequence_indices", find_packed_sequence_indices, _REASON)]
