"""Dry run vs. real execution of one job on the CPU: the figures the accuracy suite asserts and documents."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hyperdryrun.config import build_config
from hyperdryrun.report.build import phases
from hyperdryrun.trace.blocks import STEP_PHASES

BASE: dict[str, Any] = {"model": {"name": "llama-tiny"}, "training": {"seq_len": 64}, "target_device": "cpu"}
"""Every row: the small preset on CPU semantics (both sides allocate exact bytes)."""


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Nested dict update (``over`` wins), leaving both inputs untouched."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in base.items()}
    for k, v in over.items():
        out[k] = merge(out.get(k) or {}, v) if isinstance(v, dict) else v
    return out


MATRIX: list[tuple[str, dict[str, Any]]] = [
    ("w1 fp32 AdamW", {"training": {"param_dtype": "fp32"}}),
    ("w1 bf16 AdamW", {"training": {"dtype": "bf16", "param_dtype": "bf16"}}),
    ("w1 fp32 SGD AC=full", {"training": {"param_dtype": "fp32", "optimizer": "SGD", "ac": "full"}}),
    ("w1 fp32 AC=selective(op)", {"training": {"param_dtype": "fp32", "ac": "selective"}}),
    ("w1 fp32 2 micro batches", {"training": {"param_dtype": "fp32", "num_micro_batches": 2}}),
    (
        "w1 llama3-8b shape, 2 layers, width 128",
        {
            "model": {
                "name": "llama3-8b",
                "dim": 128,
                "n_layers": 2,
                "n_heads": 4,
                "n_kv_heads": 1,
                "ffn_dim": 448,
                "vocab_size": 512,
            },
            "training": {"param_dtype": "fp32"},
        },
    ),
    ("w2 FSDP reshard, bf16 params", {"world": {"world_size": 2}}),
    (
        "w2 FSDP no reshard, bf16 params",
        {"world": {"world_size": 2}, "parallel": {"reshard_after_forward": False}},
    ),
    (
        "w2 TP+SP fp32",
        {"world": {"world_size": 2}, "parallel": {"tp": 2}, "training": {"param_dtype": "fp32"}},
    ),
    (
        "w2 TP+SP bf16 AC=selective SGD",
        {
            "world": {"world_size": 2},
            "parallel": {"tp": 2},
            "training": {"dtype": "bf16", "param_dtype": "bf16", "ac": "selective", "optimizer": "SGD"},
        },
    ),
    ("w4 HSDP 2x2", {"world": {"world_size": 4}, "parallel": {"dp_replicate": 2}}),
    ("w4 FSDP+TP 2x2", {"world": {"world_size": 4}, "parallel": {"tp": 2}}),
    (
        "w4 FSDP 4 AC=full SGD 2 micro batches",
        {"world": {"world_size": 4}, "training": {"ac": "full", "optimizer": "SGD", "num_micro_batches": 2}},
    ),
    (
        "w4 FSDP+TP AC=selective 2 micro batches, rank 3",
        {
            "world": {"world_size": 4, "rank": 3},
            "parallel": {"tp": 2},
            "training": {"ac": "selective", "num_micro_batches": 2},
        },
    ),
]
"""A covering set of the issue's matrix (worlds 1/2/4; FSDP reshard on/off, HSDP, TP+SP, FSDP+TP; bf16/fp32;
AdamW/SGD; AC none/full/selective; 1/2 micro batches), small enough for CI on two cores."""

_PP2: dict[str, Any] = {"model": {"n_layers": 4}, "training": {"num_micro_batches": 4, "param_dtype": "fp32"}}
_PP4: dict[str, Any] = {
    "model": {"n_layers": 4},
    "world": {"world_size": 4},
    "parallel": {"pp": 4, "pp_schedule": "1F1B", "pp_stage_layers": [1, 1, 1, 1]},
    "training": {"num_micro_batches": 4},
}
_INTERLEAVED: dict[str, Any] = {
    "model": {"n_layers": 6},
    "parallel": {"pp": 2, "pp_schedule": "Interleaved1F1B"},
    "training": {"num_micro_batches": 4, "param_dtype": "fp32"},
}
PIPELINE_MATRIX: list[tuple[str, dict[str, Any]]] = [
    *(
        (
            f"w2 pp=2 1F1B fp32 4 layers 4 micro batches, rank {r}",
            merge(
                _PP2, {"world": {"world_size": 2, "rank": r}, "parallel": {"pp": 2, "pp_schedule": "1F1B"}}
            ),
        )
        for r in range(2)
    ),
    *(
        (f"w4 pp=4 1F1B one layer per stage 4 micro batches, rank {r}", merge(_PP4, {"world": {"rank": r}}))
        for r in range(4)
    ),
    (
        "w2 pp=2 GPipe fp32 4 layers 4 micro batches, rank 0",
        merge(_PP2, {"world": {"world_size": 2, "rank": 0}, "parallel": {"pp": 2, "pp_schedule": "GPipe"}}),
    ),
    *(
        (
            f"w2 pp=2 Interleaved1F1B (4 stages) fp32 6 layers 4 micro batches, rank {r}",
            merge(_INTERLEAVED, {"world": {"world_size": 2, "rank": r}}),
        )
        for r in range(2)
    ),
    *(
        (
            f"w2 pp=2 {schedule} (V, 4 stages) fp32 6 layers 4 micro batches, rank 0",
            merge(
                _INTERLEAVED, {"world": {"world_size": 2, "rank": 0}, "parallel": {"pp_schedule": schedule}}
            ),
        )
        for schedule in ("ZBVZeroBubble", "DualPipeV")
    ),
    (
        "w2 pp=2 InterleavedZeroBubble (4 stages) fp32 6 layers 4 micro batches, rank 0",
        merge(
            _INTERLEAVED,
            {"world": {"world_size": 2, "rank": 0}, "parallel": {"pp_schedule": "InterleavedZeroBubble"}},
        ),
    ),
    (
        "w4 pp=2 x FSDP 2 1F1B bf16 params 4 layers 4 micro batches, rank 3",
        {
            "model": {"n_layers": 4},
            "world": {"world_size": 4, "rank": 3},
            "parallel": {"pp": 2, "pp_schedule": "1F1B"},
            "training": {"num_micro_batches": 4},
        },
    ),
]
"""Pipeline rows: every stage of 1F1B at pp=2 and pp=4 (even layers, so the per-stage peaks follow the micro
batches in flight), GPipe, Interleaved 1F1B (both ranks, two stages each), the zero-bubble V schedules (backward
split into input and weight parts) and pipeline combined with FSDP."""

KNOWN_PHASE_GAPS: dict[str, str] = {}
"""Rows whose step peak agrees but one phase peak does not, with the cause: the suite asserts the gap is still
there (so a fix makes the test fail until the entry is removed)."""


@dataclass(frozen=True)
class Accuracy:
    """One row: the dry run's peak against the measured one, with and without kernel scratch."""

    name: str
    dry_peak: int
    measured_peak: int
    measured_peak_without_scratch: int
    dry_peak_phase: str
    measured_peak_phase: str
    phase_peaks: dict[str, tuple[int, int]]
    """Per step phase: (dry-run peak, measured peak without kernel scratch)."""

    @property
    def diff(self) -> int:
        """Measured (without kernel scratch) minus dry-run bytes: positive means the dry run under-estimates."""
        return self.measured_peak_without_scratch - self.dry_peak

    @property
    def rel(self) -> float:
        return self.diff / self.measured_peak_without_scratch

    @property
    def worst_phase_rel(self) -> float:
        """Largest relative difference among the per-phase peaks (0 when both sides have the same phases)."""
        worst = 0.0
        for dry, measured in self.phase_peaks.values():
            worst = max(worst, abs(measured - dry) / max(measured, dry, 1))
        return worst

    @property
    def scratch(self) -> int:
        return self.measured_peak - self.measured_peak_without_scratch


def peak_error(dry: Any, measured: Any) -> tuple[int, float]:
    """(measured - dry, relative to measured) of two traces' peaks; the measured side without kernel scratch."""
    m = measured.metadata.get("kernel_scratch", {}).get("peak_bytes_excluding", measured.peak)
    return m - dry.peak, (m - dry.peak) / m


def compare_job(name: str, data: dict[str, Any]) -> Accuracy:
    """Dry-run and measure the job described by ``data`` (a config dict) and return the row."""
    from hyperdryrun.measure.step import measure_job
    from hyperdryrun.recipe import run_job

    cfg = build_config(data)
    dry = run_job(cfg, capture_stacks=False)
    measured = measure_job(cfg, capture_stacks=False)
    measured_phases = measured.metadata["kernel_scratch"]["phase_peak_bytes_excluding"]
    dry_phases = phases(dry)  # from block lifetimes, the definition the measured side uses
    return Accuracy(
        name=name,
        dry_peak=dry.peak,
        measured_peak=measured.peak,
        measured_peak_without_scratch=measured.metadata["kernel_scratch"]["peak_bytes_excluding"],
        dry_peak_phase=str(dry.task_phase[dry.peak_task]) if dry.peak_task >= 0 else "",
        measured_peak_phase=str(measured.task_phase[measured.peak_task]) if measured.peak_task >= 0 else "",
        phase_peaks={
            str(ph): (dry_phases.get(str(ph), {}).get("peak_bytes", 0), measured_phases.get(str(ph), 0))
            for ph in STEP_PHASES
            if str(ph) in dry_phases or str(ph) in measured_phases
        },
    )
