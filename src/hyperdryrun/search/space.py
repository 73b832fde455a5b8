"""The candidate layouts of a search: every combination of the degrees, schedules, micro batches and AC modes asked
for that fills the world and splits the global batch, each checked with the layout's own rules.

A candidate is the base job (model, dtypes, sequence length, optimizer: everything not searched) with these fields
set; :func:`candidates` yields them in a fixed order, each with its validation outcome.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hyperdryrun.bounds import MAX_MICRO_BATCHES, MAX_RANKS, MAX_TOKENS, shown_number
from hyperdryrun.parallel_dims import MULTI_STAGE_SCHEDULES, PIPELINE_SCHEDULES, V_SCHEDULES, ParallelDims

if TYPE_CHECKING:
    from hyperdryrun.config import JobConfig

AC_MODES = ("none", "selective", "full")
DEFAULT_TOP = 1
"""A search stops once this many fitting layouts, the fastest, are known: the fastest 70B layouts on 64 GPUs are
8-stage pipelines, 8 rank classes each, one to two minutes of CPU per class on a shared 2-core machine."""


@dataclass(frozen=True)
class SearchSpace:
    """The values each searched field may take (``None``: every divisor of the world, up to ``max_degree``)."""

    tp: tuple[int, ...] = (1, 2, 4, 8)
    pp: tuple[int, ...] = (1, 2, 4, 8)
    cp: tuple[int, ...] = (1,)
    ep: tuple[int, ...] = (1, 2, 4, 8)
    """Expert parallel degrees (MoE models; 1 for a dense one)."""
    dp_replicate: tuple[int, ...] = (1,)
    pp_schedules: tuple[str, ...] = ("1F1B",)
    """1F1B by default: its micro batches extrapolate exactly (:mod:`hyperdryrun.search.extrapolate`), so a step
    of 64 micro batches costs about a dozen; the multi-stage schedules run every micro batch."""
    pp_virtual_stages: tuple[int, ...] = (2,)
    """Stages per rank of the multi-stage schedules (a V schedule always has 2)."""
    micro_batch_sizes: tuple[int, ...] = (1, 2)
    ac: tuple[str, ...] = AC_MODES
    max_micro_batches: int = 64
    """Layouts that need more micro batches per step than this to reach the global batch are left out."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "cp", "ep", "dp_replicate", "pp_virtual_stages", "micro_batch_sizes"):
            values = getattr(self, name)
            top = MAX_TOKENS if name == "micro_batch_sizes" else MAX_RANKS
            if not values or any(not isinstance(v, int) or not 1 <= v <= top for v in values):
                shown = ", ".join(map(shown_number, values))
                raise ValueError(f"search.{name}=[{shown}]: must be integers from 1 to {top:,}")
        for s in self.pp_schedules:
            if s not in PIPELINE_SCHEDULES:
                raise ValueError(f"search.pp_schedules: {s!r} is not one of {', '.join(PIPELINE_SCHEDULES)}")
        for a in self.ac:
            if a not in AC_MODES:
                raise ValueError(f"search.ac: {a!r} is not one of {', '.join(AC_MODES)}")
        if not 1 <= self.max_micro_batches <= MAX_MICRO_BATCHES:
            raise ValueError(
                f"search.max_micro_batches={shown_number(self.max_micro_batches)}: must be from 1 to "
                f"{MAX_MICRO_BATCHES:,}"
            )


@dataclass(frozen=True)
class Layout:
    """The searched fields of one candidate."""

    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    cp: int
    ep: int
    etp: int
    pp_schedule: str
    pp_virtual_stages: int | None
    micro_batch_size: int
    num_micro_batches: int
    ac: str

    def label(self) -> str:
        """``dp2x16 tp4 pp2 1F1B`` and so on: the degrees that are not 1, the schedule when pipelined."""
        dp = f"dp{self.dp_replicate}x{self.dp_shard}" if self.dp_replicate > 1 else f"dp{self.dp_shard}"
        parts = [dp] + [f"{n}{getattr(self, n)}" for n in ("tp", "cp", "pp", "ep") if getattr(self, n) > 1]
        if self.pp > 1:
            v = f" v{self.pp_virtual_stages}" if self.pp_virtual_stages and self.pp_virtual_stages > 1 else ""
            parts.append(f"{self.pp_schedule}{v}")
        return " ".join(parts)

    def overrides(self) -> dict[str, dict[str, Any]]:
        """The job config sections this layout sets."""
        return {
            "parallel": {
                "dp_replicate": self.dp_replicate,
                "dp_shard": self.dp_shard,
                "tp": self.tp,
                "pp": self.pp,
                "cp": self.cp,
                "ep": self.ep,
                "etp": self.etp,
                "pp_schedule": self.pp_schedule,
                "pp_virtual_stages": self.pp_virtual_stages,
                "pp_stage_layers": None,
            },
            "training": {
                "micro_batch_size": self.micro_batch_size,
                "num_micro_batches": self.num_micro_batches,
                "ac": self.ac,
            },
        }

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass
class Candidate:
    """A layout, and either its job config or why it is invalid."""

    index: int
    layout: Layout
    cfg: JobConfig | None = None
    problem: str | None = None


def _schedules(space: SearchSpace, pp: int) -> list[tuple[str, int | None]]:
    if pp == 1:
        return [("1F1B", None)]
    out: list[tuple[str, int | None]] = []
    for s in space.pp_schedules:
        if s in V_SCHEDULES:
            out.append((s, 2))
        elif s in MULTI_STAGE_SCHEDULES:
            out.extend((s, v) for v in space.pp_virtual_stages if v > 1)
        else:
            out.append((s, None))
    return out


def layouts(
    space: SearchSpace, world_size: int, global_batch_seqs: int, is_moe: bool
) -> Iterator[tuple[Layout, str | None]]:
    """Every combination of the space that fills ``world_size``, with why it cannot run when it cannot split the
    global batch of ``global_batch_seqs`` sequences or needs more than ``max_micro_batches``."""
    for dp_replicate in space.dp_replicate:
        for tp in space.tp:
            for pp in space.pp:
                for cp in space.cp:
                    others = dp_replicate * tp * pp * cp
                    if world_size % others:
                        continue
                    dp_shard = world_size // others
                    for ep in space.ep if is_moe else (1,):
                        etp = tp if (ep > 1 and tp > 1) else 1
                        for schedule, v in _schedules(space, pp):
                            for mbs in space.micro_batch_sizes:
                                for ac in space.ac:
                                    per_step = dp_replicate * dp_shard * mbs
                                    n_mb, rest = divmod(global_batch_seqs, per_step)
                                    layout = Layout(
                                        dp_replicate, dp_shard, tp, pp, cp, ep, etp, schedule, v, mbs,
                                        max(n_mb, 1), ac,
                                    )  # fmt: skip
                                    problem = None
                                    if rest or n_mb < 1:
                                        problem = (
                                            f"the global batch of {global_batch_seqs} sequences does not split "
                                            f"into dp {dp_replicate * dp_shard} x micro batches of {mbs}"
                                        )
                                    elif n_mb > space.max_micro_batches:
                                        problem = (
                                            f"needs {n_mb} micro batches per step, more than max_micro_batches="
                                            f"{space.max_micro_batches}"
                                        )
                                    yield layout, problem


def candidates(base: JobConfig, space: SearchSpace, global_batch_seqs: int) -> Iterator[Candidate]:
    """The candidates of a search on the job ``base`` (:func:`base_job`, world size included): each with its
    config (``base`` with the layout's fields, :meth:`JobConfig.with_changes`), or with the first problem its layout
    has (:meth:`ParallelDims.problems`, then the job config's own checks)."""
    from hyperdryrun.config import ConfigError

    args, is_moe = base.model.args(), base.model.is_moe
    world = base.world.world_size
    for i, (item, problem) in enumerate(layouts(space, world, global_batch_seqs, is_moe)):
        if problem:
            yield Candidate(i, item, problem=problem)
            continue
        over = item.overrides()
        parallel = {**dict(base.parallel), **over["parallel"]}
        dims = ParallelDims(world_size=world, **{k: v for k, v in parallel.items() if k in _DIM_FIELDS})
        training = base.training.model_copy(update=over["training"])
        problems = dims.problems(args, training, base.target_device, model_name=base.model.name)
        if problems:
            yield Candidate(i, item, problem=problems[0])
            continue
        try:
            yield Candidate(i, item, cfg=base.with_changes(**over))
        except ConfigError as err:
            yield Candidate(i, item, problem=str(err))


_DIM_FIELDS = (
    "dp_replicate", "dp_shard", "cp", "tp", "pp", "ep", "etp", "pp_schedule", "pp_virtual_stages",
    "pp_stage_layers", "sequence_parallel",
)  # fmt: skip


def base_job(cfg: JobConfig) -> JobConfig:
    """The parts of ``cfg`` a search keeps for every candidate (its parallel degrees and batch are searched): rank 0
    of its world, without the verdict's capacity and margin (the search judges against its own)."""
    return cfg.with_changes(
        world={"rank": 0, "local_rank": None}, device_memory_gib=None, margin_gib=None, margin_pct=None
    )
