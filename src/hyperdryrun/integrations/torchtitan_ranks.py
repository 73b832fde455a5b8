"""A torchtitan job's ranks: which are alike (:func:`rank_classes`, what a step-time estimate needs of it), its
layouts as torchtitan's degree flags (:func:`with_layout`), the world its degrees imply, and the MoE routing of a
measured step handed to a dry run (:func:`measured_routing`, :func:`routing_from_report`)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from hyperdryrun.integrations.torchtitan import TorchtitanJob, torchtitan_job
from hyperdryrun.integrations.torchtitan_config import TorchtitanError, load_config


def measured_routing(trace: Any) -> dict[str, list[int]]:
    """The MoE routing of a measured torchtitan step (``measure_torchtitan``'s trace) as the dry run's ``routing=``:
    per routed-experts module, the per-expert token counts its calls had (one list: its forward and any
    activation-checkpoint recompute route the same tokens). A module whose calls routed differently (several
    micro batches) cannot be given one list: :class:`TorchtitanError`."""
    record = trace.metadata.get("torchtitan", {}).get("routing") or {}
    out = {}
    for name, calls in sorted(record.items()):
        distinct = {tuple(c) for c in calls}
        if len(distinct) != 1:
            raise TorchtitanError(
                f"routing: module {name!r} routed {len(distinct)} different ways in the measured step (one per "
                "micro batch); the dry run's routing rule gives one count list per module"
            )
        out[name] = list(calls[0])
    return out


def routing_from_report(path: str) -> dict[str, list[int]]:
    """The measured MoE routing in a ``--measure`` report (``rank_<r>_memory.json``) as the dry run's ``routing=``
    (``--routing-from``); a file that is not one is a :class:`TorchtitanError` naming the flag and the path."""
    import json
    from pathlib import Path
    from types import SimpleNamespace

    try:
        metadata = json.loads(Path(path).read_text())["metadata"]
        record = metadata["torchtitan"]["routing"] if metadata.get("mode") == "measured" else None
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise TorchtitanError(
            f"--routing-from: not a readable report ({type(err).__name__}: {err}) (got {path!r})"
        ) from None
    valid = isinstance(record, dict) and all(
        isinstance(calls, list)
        and calls
        and all(isinstance(c, list) and all(type(n) is int and n >= 0 for n in c) for c in calls)
        for calls in record.values()
    )
    if not record or not valid:
        raise TorchtitanError(
            "--routing-from: the report holds no measured MoE routing (metadata.torchtitan.routing of a --measure "
            f"report of a MoE job) (got {path!r})"
        )
    return measured_routing(SimpleNamespace(metadata={"torchtitan": {"routing": record}}))


def infer_world_size(argv: Sequence[str]) -> int | None:
    """The world size the parallelism degrees of a torchtitan command line imply, when none is -1 (inferred)."""
    config = load_config(argv)
    p = config.parallelism
    degrees = [
        p.data_parallel_replicate_degree,
        p.data_parallel_shard_degree,
        p.context_parallel_degree,
        p.tensor_parallel_degree,
        p.pipeline_parallel_degree,
    ]
    return None if any(d < 1 for d in degrees) else math.prod(degrees)


# ------------------------------------------------------------------------------------------------- many ranks
def _step_figures(job: TorchtitanJob, model: nn.Module) -> dict[str, Any]:
    """What the roofline needs of a prepared job: FLOPs per token, the job's tokens per step, the pipeline degree
    and micro batches (its bubble counted as for one stage per rank: the stages a schedule gives each rank are
    known only once torchtitan's pipelining function has run), and the batch and AC a fit table shows."""
    t, p = job.config.training, job.metadata["parallel"]
    _, flops = job.config.model_spec.model.get_nparams_and_flops(model, t.seq_len)
    pipeline = job.metadata.get("pipeline") or {}
    return {
        "flops_per_token": float(flops),
        "tokens_per_step": job.metadata["tokens_per_step"] * p["dp_replicate"] * p["dp_shard"],
        "pp": p["pp"],
        "micro_batches": pipeline.get("num_micro_batches", 1),
        "micro_batch_size": job.metadata["micro_batch_size"],
        "num_micro_batches": job.gradient_accumulation_steps * job.pp_microbatches,
        "ac": job.metadata["activation_checkpointing"]["mode"],
    }


LAYOUT_FLAGS = {
    "dp_replicate": "--parallelism.data_parallel_replicate_degree",
    "dp_shard": "--parallelism.data_parallel_shard_degree",
    "tp": "--parallelism.tensor_parallel_degree",
    "pp": "--parallelism.pipeline_parallel_degree",
    "cp": "--parallelism.context_parallel_degree",
    "ep": "--parallelism.expert_parallel_degree",
}
"""The torchtitan flag of each parallel degree (``--fit`` sets them; the last of a repeated flag wins)."""


def with_layout(argv: Sequence[str], layout: dict[str, int]) -> list[str]:
    """``argv`` with the degrees of ``layout`` appended (torchtitan's config parser takes the last value given)."""
    return [*argv, *(x for name, degree in layout.items() for x in (LAYOUT_FLAGS[name], str(degree)))]


def rank_classes(
    argv: Sequence[str], world_size: int, n_layers: int | None = None, step: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """The rank classes of a torchtitan job over ``world_size`` ranks, ``[{"ranks", "key", "what"}]`` in order of
    their lowest rank: ranks that run the same step (the rules of :mod:`hyperdryrun.search.classes`) share a class.

    torchtitan's mesh is laid out as the recipe's (``pp, dp_replicate, dp_shard, cp, tp``, row-major), so
    :meth:`~hyperdryrun.parallel_dims.ParallelDims.coordinates` places each rank. The pipeline stage and the
    context-parallel position always set ranks apart; the data-parallel replica never does; ``dp_shard`` and ``tp``
    positions only where a parameter of the model (built on meta) splits unevenly over TP and FSDP (``torch.chunk``
    leaves the last ranks smaller shards), or with EP (its token routing and expert shards, kept apart whole).
    ``step``, when given, is filled with what a step-time estimate needs: torchtitan's training FLOPs per token
    (``get_nparams_and_flops``), the whole job's tokens per step, the pipeline degree, micro batches and stages
    per rank. Bad input raises :class:`TorchtitanError`."""
    from hyperdryrun.parallel_dims import ParallelDims

    with torchtitan_job(argv, world_size=world_size, n_layers=n_layers) as job:
        degrees = job.metadata["parallel"]
        with torch.device("meta"):
            model = job.build_model()
            shapes = [tuple(p.shape) for p in model.parameters()]
        if step is not None:
            step.update(_step_figures(job, model))
    tp, fsdp = degrees["tp"], degrees["dp_shard"] * degrees["cp"]
    # TP splits one dim of a parameter, FSDP2 dim 0 of the TP-local tensor: even when every dim divides by tp and
    # dim 0 by tp * fsdp (n % (tp * f) == 0 makes both n and n / tp divide by f)
    even = all(
        all(n % tp == 0 for n in shape) and (not shape or shape[0] % (tp * fsdp) == 0) for shape in shapes
    )
    dims = ParallelDims(
        world_size,
        degrees["dp_replicate"],
        degrees["dp_shard"],
        degrees["cp"],
        tp,
        degrees["pp"],
        degrees["ep"],
    )
    groups: dict[str, dict[str, Any]] = {}
    for rank in range(world_size):
        c = dims.coordinates(rank)
        key = {"pp": c.pp, "cp": c.cp}
        if not even or degrees["ep"] > 1:
            key.update(dp_shard=c.dp_shard, tp=c.tp)
        name = json.dumps(key, sort_keys=True)
        group = groups.setdefault(name, {"ranks": [], "key": key})
        group["ranks"].append(rank)
    for group in groups.values():
        group["what"] = ", ".join(f"{k} {v}" for k, v in group["key"].items())
    return list(groups.values())


__all__ = ["infer_world_size", "measured_routing", "rank_classes", "routing_from_report", "with_layout"]
