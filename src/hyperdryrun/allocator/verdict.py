"""The capacity verdict: "fits", "at risk" or "OOM", with a margin for the model's own error.

A dry run's device figure is a model: on the GPU rows of docs/ACCURACY.md it is within a measured error of what
nvidia-smi shows. A job whose figure is just under the capacity may therefore still run out of memory; the
verdict says so instead of "fits". With ``peak`` the figure judged (device bytes for a CUDA target, else allocated
bytes) and ``margin`` in bytes:

- ``peak > capacity``: **OOM**;
- ``capacity - margin < peak <= capacity``: **at risk** (within the model's error of the capacity);
- otherwise **fits**.

The margin is :data:`DEVICE_ERROR_FRACTION` of the capacity unless ``--margin-gib`` or ``--margin-pct`` (job
fields ``margin_gib``, ``margin_pct``) give another. A fraction of the capacity, not of the figure: if the real
figure can be up to ``e`` above the modelled one, the job is safe when ``peak * (1 + e) <= capacity``, i.e.
``peak <= capacity / (1 + e)``, and ``capacity * (1 - e)`` is below that, so the margin errs on the safe side.

Exit codes follow (:mod:`hyperdryrun.commands`): "at risk" fails the verdict (exit 1) like "OOM", since a CI gate
that passes a job that may not fit has not done its work; ``--margin-gib 0`` (or ``--margin-pct 0``) accepts the
model's figure as it is, and then only OOM fails.
"""

from __future__ import annotations

from dataclasses import dataclass

from hyperdryrun.bounds import MAX_GIB, check_number

GIB = 1 << 30

DEVICE_ERROR_FRACTION = 0.01
"""The default verdict margin, as a fraction of the capacity: the model's measured device error, rounded up.

The GPU table of docs/ACCURACY.md (six jobs on an H200, torch 2.11 cu130, against the dry run on the pinned torch):
the dry run's device figure is within 0.15% of the process's nvidia-smi memory on every row (p3: -32 MiB of
22.4 GiB), equal to the byte on four. Six jobs on one GPU with the fake process group do not exercise everything a
real job has: a real NCCL communicator's buffers (the NCCL line is a stated estimate, no GPU row measures it), the
history before step 1 (materialising and initialising the model on the device, which moved a 32 MiB segment on p3
and p6), other GPUs, drivers and torch releases. So the margin is 1%, about seven times the largest difference
measured; ``--margin-gib`` / ``--margin-pct`` set another."""

FITS, AT_RISK, OOM = "fits", "at risk", "OOM"
VERDICTS = (FITS, AT_RISK, OOM)
"""The verdict words, as ``summary.fit`` and ``hyperdryrun fit`` print them."""


@dataclass(frozen=True)
class Margin:
    """How far under the capacity a figure must stay to "fit": ``gib`` GiB, or ``pct`` percent of the capacity,
    or (neither given) :data:`DEVICE_ERROR_FRACTION` of it. Both given is an error."""

    gib: float | None = None
    pct: float | None = None

    def __post_init__(self) -> None:
        if self.gib is not None and self.pct is not None:
            raise ValueError(
                f"margin: give --margin-gib ({self.gib:g}) or --margin-pct ({self.pct:g}), not both"
            )
        for name, value, top in (("--margin-gib", self.gib, MAX_GIB), ("--margin-pct", self.pct, 100.0)):
            if value is not None:
                check_number(name, value, 0, top)

    def bytes_for(self, capacity: int) -> int:
        """The margin in bytes for a device of ``capacity`` bytes; ``ValueError`` for a ``gib`` margin that is not
        under the capacity (every peak would be "at risk")."""
        if self.gib is not None:
            margin = int(round(self.gib * GIB))
            if margin >= capacity:
                raise ValueError(
                    f"--margin-gib {self.gib:g}: must be less than the capacity ({capacity / GIB:.2f} GiB)"
                )
            return margin
        fraction = DEVICE_ERROR_FRACTION if self.pct is None else self.pct / 100
        return int(round(fraction * capacity))

    def source(self) -> str:
        """Where the margin comes from, for the report."""
        if self.gib is not None:
            return f"--margin-gib {self.gib:g}"
        if self.pct is not None:
            return f"--margin-pct {self.pct:g} of the capacity"
        return (
            f"the model's measured device error, {100 * DEVICE_ERROR_FRACTION:g}% of the capacity "
            "(hyperdryrun.allocator.verdict.DEVICE_ERROR_FRACTION, docs/ACCURACY.md)"
        )


def verdict_word(peak: int, capacity: int, margin: int) -> str:
    """:data:`OOM` over the capacity, :data:`AT_RISK` within ``margin`` bytes under it, else :data:`FITS`."""
    if peak > capacity:
        return OOM
    if peak > capacity - margin:
        return AT_RISK
    return FITS


def verdict_fields(peak: int, capacity: int, margin: Margin, oom: bool | None = None) -> dict[str, object]:
    """The summary keys of a verdict: ``fit`` (the word), ``oom``, ``at_risk``, ``margin_bytes`` and
    ``margin_source``. ``oom``: the allocator model's own answer where it ran (it replays under the capacity)."""
    nbytes = margin.bytes_for(capacity)
    word = verdict_word(peak, capacity, nbytes)
    if oom is not None:
        word = OOM if oom else (AT_RISK if word == OOM else word)  # fits under the replay: at most at risk
    return {
        "fit": word,
        "oom": word == OOM,
        "at_risk": word == AT_RISK,
        "margin_bytes": nbytes,
        "margin_source": margin.source(),
    }


__all__ = [
    "AT_RISK",
    "DEVICE_ERROR_FRACTION",
    "FITS",
    "OOM",
    "VERDICTS",
    "Margin",
    "verdict_fields",
    "verdict_word",
]
