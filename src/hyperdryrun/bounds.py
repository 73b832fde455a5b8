"""The bounds of every number a user gives, in one place (issue 30, item 4).

Each is generous for any real job and small enough that what the step computes from it (bytes as int64, seconds
as floats, a product of degrees) neither overflows nor runs for hours: a number past one is bad input, refused on
one line naming the field or flag and the value (exit 2), before any work. The job's fields use them
(:mod:`hyperdryrun.config`), as do ``fit``'s own flags, the verdict's margin and a script job's values.
"""

from __future__ import annotations

import math
from typing import Any

GIB = 1 << 30

MAX_WIDTH = 1 << 22
"""dim, ffn_dim and moe_ffn_dim (the largest published: 53,248)."""
MAX_VOCAB = 1 << 24
MAX_LAYERS = 10_000
MAX_HEADS = 1 << 16
MAX_TOKENS = 1 << 30
"""seq_len and micro_batch_size, each."""
MAX_MICRO_BATCHES = 10_000
MAX_RANKS = 1 << 24
"""A world size or a parallel degree (the simulated world is further limited by ``HYPERDRYRUN_MAX_WORLD_SIZE``)."""
MAX_GIB = float(1 << 20)
"""A device's capacity or a margin in GiB (1 PiB: a byte count that fits int64 many times over)."""
MAX_GLOBAL_SEQS = MAX_RANKS * MAX_MICRO_BATCHES
"""Sequences per optimizer step of ``fit``: every rank's micro batches at most."""
MAX_RATE = 1e21
"""A throughput (FLOP/s or bytes/s) of ``fit``'s roofline (a zettaFLOP per second per GPU)."""
TENSOR_BYTES = (1 << 63) - 1
"""The most bytes one tensor may hold (torch sizes and strides are int64)."""


def check_number(name: str, value: Any, low: float, high: float, integer: bool = False) -> None:
    """``low <= value <= high`` (a finite int, or float unless ``integer``); ``ValueError`` naming ``name`` and
    the value otherwise (a long number shown by its digit count, not whole)."""
    ok = isinstance(value, int) and not isinstance(value, bool)
    if not integer:
        ok = ok or (isinstance(value, float) and math.isfinite(value))
    if ok and low <= value <= high:
        return
    kind = "an integer" if integer else "a number"
    raise ValueError(
        f"{name}: must be {kind} from {_bound(low)} to {_bound(high)} (got {shown_number(value)})"
    )


def _bound(x: float) -> str:
    return f"{int(x):,}" if float(x).is_integer() else f"{x:g}"


def shown_number(value: Any) -> str:
    """``value`` for a message: an integer of more than 30 digits by its digit count."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 100:
        return f"an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    return repr(value)
