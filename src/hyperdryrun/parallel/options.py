"""What a model family's parallelize function applies besides the degrees: the options of the job's parallelisms
(torchtitan passes its config sections, ``training``, ``parallelism`` and ``activation_checkpoint``; these are the
fields the parallelize functions read, so :mod:`hyperdryrun.parallel` never needs the job config)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hyperdryrun.parallel.fsdp import FSDPOptions


class LayoutUnsupported(RuntimeError):
    """A layout the parallelisms cannot apply with the installed torch (the message names the job's fields and the
    way out): bad input, as a :class:`~hyperdryrun.config.ConfigError` is, which this layer cannot import."""


@dataclass(frozen=True)
class ParallelizeOptions:
    """The options of TP, AC and FSDP2 for one job; the degrees are its :class:`~hyperdryrun.parallel_dims.ParallelDims`.

    ``ac``/``ac_selective``: ``training.ac`` and ``training.ac_selective`` (:func:`hyperdryrun.parallel.ac.apply_ac`);
    ``loss_parallel``: ``parallel.loss_parallel`` (the head's output stays vocab-sharded under TP); ``fsdp``: what
    FSDP2 is applied with."""

    fsdp: FSDPOptions = field(default_factory=FSDPOptions)
    ac: str = "none"
    ac_selective: str = "op"
    loss_parallel: bool = True
