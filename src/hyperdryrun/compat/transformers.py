"""Hugging Face transformers internals a dry run works around (``transformers/masking_utils.py``), by release."""

from __future__ import annotations

from hyperdryrun.patches import Patch


def one_sequence_per_row_patches() -> list[Patch]:
    """Packed-sequence detection off: every row is one sequence (the recipe's positions are 0..seq_len-1).

    transformers 5.x ``masking_utils.find_packed_sequence_indices`` cannot read fake position ids (``is_tracing``
    is true for a FakeTensor) and reports packed sequences, so the causal mask would be materialised where a real
    run runs SDPA with ``is_causal`` and no mask."""
    from transformers import masking_utils

    return [
        Patch(
            masking_utils,
            "find_packed_sequence_indices",
            lambda position_ids: None,
            "transformers 5.x find_packed_sequence_indices cannot read fake position ids (is_tracing is true for a "
            "FakeTensor) and reports packed sequences, so the causal mask is materialised; a real run finds one "
            "sequence per row (the recipe's positions are 0..seq_len-1) and runs SDPA with is_causal and no mask",
        )
    ]
