"""One job interface for every front door: the built-in recipe (``run``, Hugging Face configs included), your own
script (``script``) and torchtitan jobs (``torchtitan``) each say, as a :class:`Job`,

- how the runner builds and steps one rank (:meth:`Job.execute`, the runner's ``execute``; None: the built-in
  recipe's ``run_job``),
- which ranks are alike (:meth:`Job.rank_classes`: ``[{"ranks", "what"}]``, one simulated per class),
- which layouts it can take (:meth:`Job.layouts`, the order ``--fit`` tries them in),
- what a step-time estimate needs where it can (:meth:`Job.step`: FLOPs per token and tokens per step; None where
  the job does not say, a script's),
- and what ``rank_classes.json`` says the job is (:meth:`Job.describe`).

The one runner of their ranks, classes, layouts, verdicts and exit codes is :mod:`hyperdryrun.commands.frontdoor`;
the commands only parse flags into a :class:`Job`, a job config and a
:class:`~hyperdryrun.world.target.DeviceTarget`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from hyperdryrun.config import JobConfig


@dataclass(frozen=True)
class StepFacts:
    """What a job says about one layout's step for the fit table and the roofline (None: not known)."""

    flops_per_token: float | None = None
    tokens_per_step: int | None = None
    """The whole job's tokens per optimizer step."""
    pp: int = 1
    micro_batches: int = 1
    micro_batch_size: int | None = None
    num_micro_batches: int | None = None
    ac: str | None = None

    def step_time(self, world_size: int, rates: Any) -> Any:
        """The roofline's compute estimate (:func:`hyperdryrun.search.roofline.flops_step_time`), None without
        FLOPs."""
        if self.flops_per_token is None or self.tokens_per_step is None:
            return None
        from hyperdryrun.search.roofline import flops_step_time

        return flops_step_time(
            self.flops_per_token, self.tokens_per_step, world_size, rates, self.pp, self.micro_batches
        )

    @property
    def batch(self) -> str | None:
        if self.micro_batch_size is None or self.num_micro_batches is None:
            return None
        return f"{self.micro_batch_size} x {self.num_micro_batches}"


class Job(Protocol):
    """A training job behind a front door (see the module docstring)."""

    title: str
    """What tables name the job by: the model, the script, torchtitan's command line."""

    def describe(self, world_size: int) -> dict[str, Any]: ...

    def execute(self, layout: dict[str, Any]) -> Any: ...

    def rank_classes(self, world_size: int, layout: dict[str, Any]) -> list[dict[str, Any]]: ...

    def layouts(self, world_size: int) -> list[dict[str, Any]]: ...

    def step(self, world_size: int, layout: dict[str, Any]) -> StepFacts: ...

    def routing_line(self) -> str | None: ...

    def with_routing(self, routing: Any, cfg: Any) -> tuple[Any, Any]: ...


def routing_title(spec: Any, where: str = "") -> str:
    """The title line of the routing a job's verdicts assume (:class:`~hyperdryrun.world.routing.RoutingSpec`)."""
    from hyperdryrun.world.routing import RoutingSpec

    return f"MoE routing{where}: {(spec or RoutingSpec()).describe()}"


@dataclass
class RecipeJob:
    """The built-in recipe's job (a preset or a Hugging Face config): its layout is the config's; ``fit`` searches
    its layouts with :mod:`hyperdryrun.search` (extrapolation, bounds, the full roofline)."""

    cfg: JobConfig

    @property
    def title(self) -> str:
        return self.cfg.model.name

    def describe(self, world_size: int) -> dict[str, Any]:
        return {"model": self.cfg.model.name, "world_size": world_size, "parallel": self.cfg.dims.degrees()}

    def execute(self, layout: dict[str, Any]) -> Any:
        return None  # the runner's default: recipe.run_job

    def rank_classes(self, world_size: int, layout: dict[str, Any]) -> list[dict[str, Any]]:
        from hyperdryrun.search.classes import rank_classes

        return self.class_dicts(rank_classes(self.cfg))

    @staticmethod
    def class_dicts(classes: Sequence[Any]) -> list[dict[str, Any]]:
        """:class:`~hyperdryrun.search.classes.RankClass` es as every job gives its classes."""
        return [{"ranks": list(c.ranks), "what": c.describe()} for c in classes]

    def layouts(self, world_size: int) -> list[dict[str, Any]]:
        return [self.cfg.dims.degrees()]

    def routing_line(self) -> str | None:
        return routing_title(self.cfg.values) if self.cfg.model.is_moe else None

    def with_routing(self, routing: Any, cfg: Any) -> tuple[RecipeJob, Any]:
        """This job, and the runner's ``cfg`` (this job's config, maybe another output), under ``routing`` (a
        :class:`~hyperdryrun.world.routing.RoutingSpec`); the value rules of ``values.rules`` kept."""
        from hyperdryrun.config import build_config

        values = {
            **routing.model_dump(exclude_unset=True),
            "rules": [r.model_dump() for r in cfg.values.rules],
        }
        new = build_config({**cfg.model_dump(), "values": values})
        return RecipeJob(new), new

    def step(self, world_size: int, layout: dict[str, Any]) -> StepFacts:
        from hyperdryrun.search.roofline import flops_per_token

        t, p = self.cfg.training, self.cfg.parallel
        tokens = t.micro_batch_size * t.num_micro_batches * p.dp_replicate * p.dp_shard * t.seq_len
        return StepFacts(
            flops_per_token(self.cfg), tokens, p.pp, t.num_micro_batches, t.micro_batch_size,
            t.num_micro_batches, t.ac,
        )  # fmt: skip


@dataclass
class ScriptJob:
    """Your own script's job: its layouts are what its ``hyperdryrun_layouts(world_size)`` declares, its classes
    what its ``rank_class`` says (:func:`hyperdryrun.integrations.script`); ``probed``: what the probe child found
    (the launched world, each layout's classes). It gives no FLOPs: no step time."""

    spec: str
    argv: tuple[str, ...] = ()
    probed: dict[str, Any] = field(default_factory=dict)
    routing: Any = None
    """The routing option (:class:`~hyperdryrun.world.routing.RoutingSpec`; None: balanced)."""

    @property
    def title(self) -> str:
        return self.spec

    def describe(self, world_size: int) -> dict[str, Any]:
        return {"script": self.spec}

    def execute(self, layout: dict[str, Any]) -> Any:
        from hyperdryrun.integrations.script import ScriptExecute

        return ScriptExecute(self.spec, dict(layout), self.argv, self.routing)

    def _index(self, layout: dict[str, Any]) -> int:
        return self.probed.get("layouts", [{}]).index(layout)

    def rank_classes(self, world_size: int, layout: dict[str, Any]) -> list[dict[str, Any]]:
        return [
            {
                "ranks": c["ranks"],
                "what": "no rank_class declared" if c["key"] is None else f"rank_class {c['key']!r}",
            }
            for c in self.probed["classes"][self._index(layout)]
        ]

    def layouts(self, world_size: int) -> list[dict[str, Any]]:
        return list(self.probed.get("layouts", [{}]))

    def step(self, world_size: int, layout: dict[str, Any]) -> StepFacts:
        return StepFacts()

    def routing_line(self) -> str | None:
        return routing_title(self.routing, " (of the layers that ask for it)")

    def with_routing(self, routing: Any, cfg: Any) -> tuple[ScriptJob, Any]:
        return replace(self, routing=routing), cfg


@dataclass
class TorchtitanFrontJob:
    """A torchtitan job as it is (its own command line): its classes follow torchtitan's mesh
    (:func:`hyperdryrun.integrations.torchtitan_ranks.rank_classes`), its layouts are torchtitan's parallelism degrees
    over the ``--fit-*`` space, its FLOPs per token torchtitan's own ``get_nparams_and_flops``."""

    argv: tuple[str, ...]
    n_layers: int | None = None
    attention: str | None = None
    measure: bool = False
    space: Any = None
    """The :class:`~hyperdryrun.search.space.SearchSpace` of ``--fit`` (tp, pp, cp, ep degrees)."""
    routing: Any = None
    """The routing option (:class:`~hyperdryrun.world.routing.RoutingSpec`; None: balanced, a measured run's own)."""
    _steps: dict[str, dict[str, Any]] = field(default_factory=dict, repr=False)

    @property
    def title(self) -> str:
        return f"torchtitan {' '.join(self.argv)}"

    def describe(self, world_size: int) -> dict[str, Any]:
        return {"torchtitan": {"argv": list(self.argv)}}

    def argv_of(self, layout: dict[str, Any]) -> list[str]:
        from hyperdryrun.integrations.torchtitan_ranks import with_layout

        return with_layout(self.argv, layout)

    def execute(self, layout: dict[str, Any]) -> Any:
        return TorchtitanExecute(
            tuple(self.argv_of(layout)), self.n_layers, self.attention, self.measure, self.routing
        )

    def rank_classes(self, world_size: int, layout: dict[str, Any]) -> list[dict[str, Any]]:
        """Raises :class:`~hyperdryrun.integrations.torchtitan.TorchtitanError` for a layout torchtitan rejects."""
        from hyperdryrun.integrations.torchtitan_ranks import rank_classes

        step: dict[str, Any] = {}
        classes = rank_classes(self.argv_of(layout), world_size, self.n_layers, step)
        self._steps[repr(sorted(layout.items()))] = step
        return [{"ranks": c["ranks"], "what": c["what"]} for c in classes]

    def layouts(self, world_size: int) -> list[dict[str, Any]]:
        """Every layout of the space that fills the world (dp_shard takes the rest; least tp, then pp, cp, ep)."""
        from hyperdryrun.integrations.torchtitan import load_config
        from hyperdryrun.search.space import SearchSpace, layouts

        replicate = max(1, load_config(list(self.argv)).parallelism.data_parallel_replicate_degree)
        s = self.space or SearchSpace()
        space = SearchSpace(
            tp=s.tp, pp=s.pp, cp=s.cp, ep=s.ep, dp_replicate=(replicate,), micro_batch_sizes=(1,), ac=("none",),
            max_micro_batches=world_size,
        )  # fmt: skip
        chosen: list[dict[str, Any]] = []
        for layout, _ in layouts(space, world_size, world_size, is_moe=True):
            degrees = {k: getattr(layout, k) for k in ("dp_shard", "tp", "pp", "cp", "ep")}
            if degrees not in chosen:
                chosen.append(degrees)
        return chosen

    def routing_line(self) -> str | None:
        from hyperdryrun.integrations.torchtitan import load_config

        layers = load_config(list(self.argv)).model_spec.model.layers
        if not any(getattr(layer, "moe", None) is not None for layer in layers):
            return None
        if self.measure and self.routing is None:
            return "MoE routing: as each router decides (measured)"
        return routing_title(self.routing, " (forced on the routers)" if self.measure else "")

    def with_routing(self, routing: Any, cfg: Any) -> tuple[TorchtitanFrontJob, Any]:
        return replace(self, routing=routing), cfg

    def step(self, world_size: int, layout: dict[str, Any]) -> StepFacts:
        got = self._steps.get(repr(sorted(layout.items())))
        if not got:
            return StepFacts()
        return StepFacts(
            got["flops_per_token"], got["tokens_per_step"], got["pp"], got["micro_batches"],
            got["micro_batch_size"], got["num_micro_batches"], got["ac"],
        )  # fmt: skip


@dataclass(frozen=True)
class TorchtitanExecute:
    """How the runner runs a rank of a torchtitan job: ``execute(cfg, capture_stacks=...) -> StepTrace`` (module
    level and picklable, so a worker process runs it). ``cfg`` carries the rank, the target device and the
    capacity; torchtitan's command line and the command's own job options travel here."""

    argv: tuple[str, ...]
    n_layers: int | None = None
    attention: str | None = None
    measure: bool = False
    routing: Any = None

    def __call__(self, cfg: Any, capture_stacks: bool = True) -> Any:
        from hyperdryrun.engine import SimulationError
        from hyperdryrun.integrations.torchtitan import JobArgs, TorchtitanError, simulate_torchtitan

        world = cfg.world
        job = JobArgs(
            world_size=world.world_size,
            rank=world.rank,
            local_rank=world.local_rank,
            n_layers=self.n_layers,
            attention=self.attention,
            cuda=cfg.cuda,
            routing_spec=self.routing,
        )
        try:
            if self.measure:
                from hyperdryrun.measure.torchtitan import measure_torchtitan

                return measure_torchtitan(self.argv, capture_stacks=capture_stacks, **job)
            return simulate_torchtitan(
                self.argv, capture_stacks=capture_stacks, target_device=cfg.target_device, **job
            )
        except TorchtitanError as err:  # bad input: the runner reports it as such, in one line
            raise SimulationError("config", err) from err

    def job_metadata(self, cfg: Any) -> dict[str, Any]:
        """What a report (an error report too) says about the job: torchtitan's command line."""
        return {
            "mode": "measured" if self.measure else "dry-run",
            "rank": cfg.world.rank,
            "world_size": cfg.world.world_size,
            "torchtitan": {"argv": list(self.argv)},
        }


def layout_name(layout: dict[str, Any]) -> str:
    """``dp_shard=2 tp=1``: a layout as tables and the chosen line name it."""
    return " ".join(f"{k}={v}" for k, v in layout.items()) or "(empty)"


def representatives(classes: Sequence[dict[str, Any]]) -> list[int]:
    """The rank simulated for each class: its lowest."""
    return [c["ranks"][0] for c in classes]


__all__ = [
    "Job",
    "RecipeJob",
    "ScriptJob",
    "StepFacts",
    "TorchtitanExecute",
    "TorchtitanFrontJob",
    "layout_name",
    "representatives",
]
