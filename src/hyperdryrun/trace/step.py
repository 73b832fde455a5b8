"""A traced step as plain data: what the dry run, a measured run and every ingested source produce, and what every
report, comparison and later analysis reads (no reference into the tracing machinery)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hyperdryrun.trace.blocks import Block, Phase
from hyperdryrun.trace.stacks import StackTable


class ModuleStats:
    """One module's memory over the step: its parameter and buffer bytes, the largest input and output it saw, and
    its forward and backward local peaks (live bytes while it ran, its children included)."""

    __slots__ = (
        "fqn",
        "param_bytes",
        "buffer_bytes",
        "input_bytes",
        "output_bytes",
        "fw_peak",
        "bw_peak",
        "calls",
    )

    def __init__(self, fqn: str) -> None:
        self.fqn = fqn
        self.param_bytes = self.buffer_bytes = self.input_bytes = self.output_bytes = 0
        self.fw_peak = self.bw_peak = 0
        self.calls = 0


WARNED = "warned during the simulated step"
"""How a limitation of ``engine.warnings_as_limitations`` begins (a warning raised inside the step)."""


@dataclass
class StepTrace:
    """Everything the reports need, as plain data (no reference into the tracing machinery)."""

    blocks: list[Block]
    num_tasks: int
    task_phase: list[Phase]
    task_op: list[str]
    peak: int
    peak_task: int
    current: int
    phase_peak: dict[Phase, int]
    modules: dict[str, ModuleStats]
    stacks: StackTable
    initial: int
    metadata: dict[str, Any] = field(default_factory=dict)
    limitations: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
