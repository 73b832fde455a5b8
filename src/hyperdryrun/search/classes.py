"""Rank classes: which ranks of a job provably have the same memory profile, from the layout alone.

Two ranks run the same step (same ops on tensors of the same shapes, hence the same blocks) when they hold

- the same pipeline stage(s) (``pp`` coordinate): stages differ in layers, embedding and head, and in the 1F1B
  warm-up depth;
- the same context-parallel position (``cp`` coordinate): torch 2.13 ring attention computes a different half of
  the chunk at each step depending on the rank (``i <= rank``), so positions are kept apart;
- the same local shard shape of every parameter: TP (``tp``), EP (``ep``) and FSDP2 (``dp_shard`` x ``cp``) each
  split one tensor dimension with ``torch.chunk`` semantics (chunks of ``ceil(n / k)``, the ranks past the last chunk
  get an empty shard; FSDP2's ``_chunk_with_empty``), one after the other on the local tensor, so an uneven split
  makes the ranks past ``n // ceil(n / k)`` differ;
- the same expert load under the routing scenario (``ep`` > 1): the tokens each of its local experts receives in
  every MoE layer of its stages (a hotspot singles out the rank of the hot expert).

The data-parallel replica (``dp_replicate``) never changes what a rank computes. Every other coordinate is compared
through the shapes it produces, so a rank class never merges ranks that differ in any of these. The parameter
shapes and splits below mirror the built-in recipe's plans (:mod:`hyperdryrun.parallel.tp`,
:mod:`hyperdryrun.parallel.expert`, :mod:`hyperdryrun.parallel.fsdp`); ``tests/search/test_classes.py`` checks them
against the real parallelized model and the classes against every rank simulated.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hyperdryrun.config import JobConfig
    from hyperdryrun.parallel_dims import ParallelDims, RankCoordinates

Split = tuple[str, int]
"""(group, tensor dim): the tensor dim split over the group: ``tp``, ``ep``, ``fsdp`` (dp_shard x cp, the mesh
FSDP2 shards over) or ``efsdp`` (dp_shard / ep, the mesh FSDP2 shards routed experts over with EP)."""


@dataclass(frozen=True)
class ParamSpec:
    """One parameter as the recipe lays it out: FQN pattern, global shape, the splits in the order applied, how many
    parameters of a stage have it."""

    name: str
    shape: tuple[int, ...]
    splits: tuple[Split, ...]
    count: int = 1


def chunk_size(n: int, k: int, i: int) -> int:
    """Length of chunk ``i`` of ``torch.chunk(range(n), k)``, 0 past the last chunk (FSDP2's empty shard)."""
    if n == 0:
        return 0
    size = math.ceil(n / k)
    return max(0, min(size, n - i * size))


def local_shape(spec: ParamSpec, sizes: dict[str, int], index: dict[str, int]) -> tuple[int, ...]:
    """The shape one rank holds of ``spec`` with groups of ``sizes`` at positions ``index``."""
    shape = list(spec.shape)
    for group, dim in spec.splits:
        shape[dim] = chunk_size(shape[dim], sizes[group], index[group])
    return tuple(shape)


# ------------------------------------------------------------------------------------------------- parameters
def _linear(
    name: str, out: int, inp: int, tp_dim: int | None
) -> list[tuple[str, tuple[int, ...], int | None]]:
    return [(f"{name}.weight", (out, inp), tp_dim)]


def _norm(name: str, dim: int) -> list[tuple[str, tuple[int, ...], int | None]]:
    return [(f"{name}.weight", (dim,), None)]


def _attention(args: Any, moe: bool) -> list[tuple[str, tuple[int, ...], int | None]]:
    d, h = args.dim, args.n_heads
    if moe and args.attention == "mla":
        qk = args.qk_nope_head_dim + args.qk_rope_head_dim
        if args.q_lora_rank:
            q = [
                *_linear("attention.wq_a", args.q_lora_rank, d, None),
                *_norm("attention.q_norm", args.q_lora_rank),
                *_linear("attention.wq_b", h * qk, args.q_lora_rank, 0),
            ]
        else:
            q = _linear("attention.wq", h * qk, d, 0)
        return [
            *q,
            *_linear("attention.wkv_a", args.kv_lora_rank + args.qk_rope_head_dim, d, None),
            *_norm("attention.kv_norm", args.kv_lora_rank),
            *_linear("attention.wkv_b", h * (args.qk_nope_head_dim + args.v_head_dim), args.kv_lora_rank, 0),
            *_linear("attention.wo", d, h * args.v_head_dim, 1),
        ]
    hd, kv = args.head_dim, args.n_kv_heads
    if args.fuse_qkv:
        # One projection laid out by KV group, so a colwise TP shard holds whole groups (models/llama.py, moe.py).
        qkv = _linear("attention.wqkv", (h + 2 * kv) * hd, d, 0)
    else:
        qkv = [
            w for x, n in (("q", h), ("k", kv), ("v", kv)) for w in _linear(f"attention.w{x}", n * hd, d, 0)
        ]
    out = [*qkv, *_linear("attention.wo", d, h * hd, 1)]
    if moe and args.qk_norm:
        out += [*_norm("attention.q_norm", hd), *_norm("attention.k_norm", hd)]
    return out


def _ffn(name: str, dim: int, hidden: int) -> list[tuple[str, tuple[int, ...], int | None]]:
    return [
        *_linear(f"{name}.w1", hidden, dim, 0),
        *_linear(f"{name}.w2", dim, hidden, 1),
        *_linear(f"{name}.w3", hidden, dim, 0),
    ]


def layer_params(cfg: JobConfig, layer: int) -> list[ParamSpec]:
    """The parameters of decoder layer ``layer`` with their splits (``layers.<layer>`` prefix left out)."""
    from hyperdryrun.recipe import fsdp_applied

    args, p, moe = cfg.model.args(), cfg.parallel, cfg.model.is_moe
    d = args.dim
    plain = [*_norm("attention_norm", d), *_attention(args, moe), *_norm("ffn_norm", d)]
    experts: list[ParamSpec] = []
    if moe and layer >= args.n_dense_layers:
        plain += _linear("moe.router.gate", args.num_experts, d, None)
        if args.num_shared_experts:
            plain += _ffn("moe.shared_experts", d, args.num_shared_experts * args.moe_ffn_dim)
        experts = _expert_params(cfg)
    else:
        plain += _ffn("feed_forward", d, args.ffn_dim)
    fsdp = (("fsdp", 0),) if fsdp_applied(cfg) else ()
    out = []
    for name, shape, tp_dim in plain:
        tp = (("tp", tp_dim),) if p.tp > 1 and tp_dim is not None else ()
        out.append(ParamSpec(name, shape, tp + fsdp))
    return out + experts


def _expert_params(cfg: JobConfig) -> list[ParamSpec]:
    """Routed experts (E, hidden, dim) / (E, dim, hidden): EP on the expert dim, TP on the hidden dim (torchtitan's
    ``TensorParallel`` / ``ExpertTensorParallel``), FSDP2 over ``dp_shard`` (ep = 1) or ``dp_shard / ep`` on the
    expert dim, or on dim 1 when the ranks sharding them outnumber the experts (``apply_moe_fsdp``: ep x efsdp with
    EP; without EP, torchtitan 0.3.0's units compare every FSDP rank, its 2024 units never shard on dim 1)."""
    from hyperdryrun.recipe import fsdp_applied

    args, p = cfg.model.args(), cfg.parallel
    e, f, d = args.num_experts, args.moe_ffn_dim, args.dim
    out = []
    for name, shape, tp_dim in (("w1", (e, f, d), 1), ("w2", (e, d, f), 2), ("w3", (e, f, d), 1)):
        splits: list[Split] = []
        if p.ep > 1:
            splits.append(("ep", 0))
        if p.tp > 1:
            splits.append(("tp", tp_dim))
        if fsdp_applied(cfg):
            if p.ep > 1:
                efsdp = p.dp_shard // p.ep
                splits.append(("efsdp", 1 if efsdp * p.ep > e else 0))
            else:
                ranks = p.dp_replicate * p.dp_shard * p.cp
                splits.append(("fsdp", 1 if p.fsdp_wrap == "torchtitan" and ranks > e else 0))
        out.append(ParamSpec(f"moe.experts.{name}", shape, tuple(splits)))
    return out


def stage_params(cfg: JobConfig, stages: tuple[int, ...]) -> list[ParamSpec]:
    """Every parameter of the stages a rank holds (the whole model without pipelining), equal layers folded into
    one spec with its ``count``."""
    from hyperdryrun.recipe import fsdp_applied

    args, p = cfg.model.args(), cfg.parallel
    if p.pp > 1:
        from hyperdryrun.parallel.pipeline import stage_layer_ranges

        ranges = stage_layer_ranges(cfg.model.args().n_layers, cfg.dims)
        layers = [i for s in stages for i in ranges[s]]
        first, last = 0 in stages, p.pp_num_stages - 1 in stages
    else:
        layers, first, last = list(range(args.n_layers)), True, True
    kinds: dict[bool, int] = {}
    n_dense = args.n_dense_layers if cfg.model.is_moe else args.n_layers
    for i in layers:
        kinds[i < n_dense] = kinds.get(i < n_dense, 0) + 1
    out: list[ParamSpec] = []
    for dense, count in kinds.items():
        sample_layer = 0 if dense else n_dense
        out += [
            ParamSpec(f"layers.*.{s.name}", s.shape, s.splits, count) for s in layer_params(cfg, sample_layer)
        ]
    fsdp = (("fsdp", 0),) if fsdp_applied(cfg) else ()
    tp = (("tp", 0),) if p.tp > 1 else ()
    if first:
        out.append(ParamSpec("tok_embeddings.weight", (args.vocab_size, args.dim), tp + fsdp))
    if last:
        out.append(ParamSpec("norm.weight", (args.dim,), fsdp))
        if not args.tie_embeddings:
            out.append(ParamSpec("output.weight", (args.vocab_size, args.dim), tp + fsdp))
    return out


def group_sizes(dims: ParallelDims) -> dict[str, int]:
    """The size of each split group of :data:`Split`."""
    return {"tp": dims.tp, "ep": dims.ep, "fsdp": dims.dp_shard * dims.cp, "efsdp": dims.dp_shard // dims.ep}


def group_index(dims: ParallelDims, c: RankCoordinates) -> dict[str, int]:
    """A rank's position in each split group: FSDP2's ``dp_shard_cp`` is ``mesh["dp_shard", "cp"]`` flattened
    (row-major), EP unflattens ``dp_shard`` into ``(dp_shard // ep, ep)``."""
    return {"tp": c.tp, "ep": c.ep, "fsdp": c.dp_shard * dims.cp + c.cp, "efsdp": c.dp_shard // dims.ep}


# ------------------------------------------------------------------------------------------------- expert load
def expert_load(cfg: JobConfig, stages: tuple[int, ...], ep_rank: int) -> tuple[tuple[int, ...], ...]:
    """Tokens each local expert of EP rank ``ep_rank`` receives per micro batch, in every MoE layer of ``stages``
    (what the routing scenario gives ``ExpertParallel``'s dispatch), or () without EP."""
    args, p = cfg.model.args(), cfg.parallel
    if not cfg.model.is_moe or p.ep == 1:
        return ()
    rules = cfg.values.value_rules()
    tokens = cfg.training.micro_batch_size * cfg.training.seq_len
    local = args.num_experts // p.ep
    out = []
    for i in _layers_of(cfg, stages):
        if i < args.n_dense_layers:
            continue
        counts = rules.token_counts(f"layers.{i}.moe.experts", tokens, args.num_experts, args.top_k)
        out.append(tuple(counts[ep_rank * local : (ep_rank + 1) * local]))
    return tuple(out)


def _layers_of(cfg: JobConfig, stages: tuple[int, ...]) -> Iterator[int]:
    if cfg.parallel.pp == 1:
        yield from range(cfg.model.args().n_layers)
        return
    from hyperdryrun.parallel.pipeline import stage_layer_ranges

    ranges = stage_layer_ranges(cfg.model.args().n_layers, cfg.dims)
    for s in stages:
        yield from ranges[s]


# ------------------------------------------------------------------------------------------------- classes
@dataclass(frozen=True)
class RankClass:
    """Ranks with the same memory profile: ``representative`` (the lowest) is simulated for all of ``ranks``."""

    index: int
    ranks: tuple[int, ...]
    pp: int
    stages: tuple[int, ...]
    cp: int
    shards: int
    """Which distinct set of local shard shapes (0 = the first seen, in rank order)."""
    experts: tuple[tuple[int, ...], ...]
    """Tokens per local expert in each MoE layer (EP only)."""

    @property
    def representative(self) -> int:
        return self.ranks[0]

    def describe(self) -> str:
        """What sets the class apart, in a few words."""
        parts = [f"pp {self.pp} (stage {','.join(map(str, self.stages))})", f"cp {self.cp}"]
        parts.append(f"shard shapes #{self.shards}")
        if self.experts:
            parts.append(f"expert tokens {[sum(layer) for layer in self.experts][:1]}/layer")
        return ", ".join(parts)


def rank_key(
    cfg: JobConfig, rank: int, params: dict[tuple[int, ...], list[ParamSpec]] | None = None
) -> tuple:
    """What decides rank ``rank``'s memory profile (see the module docstring); equal keys, equal profiles."""
    dims = cfg.dims
    c = dims.coordinates(rank)
    specs = (params or {}).get(c.stages) or stage_params(cfg, c.stages)
    sizes, index = group_sizes(dims), group_index(dims, c)
    shapes = tuple(local_shape(s, sizes, index) for s in specs)
    return (c.pp, c.cp, shapes, expert_load(cfg, c.stages, c.ep))


def rank_classes(cfg: JobConfig) -> list[RankClass]:
    """The classes of every rank of ``cfg``'s job, in order of their lowest rank."""
    dims = cfg.dims
    params: dict[tuple[int, ...], list[ParamSpec]] = {}
    for pp in range(dims.pp):
        stages = dims.stage_indices(pp)
        params[stages] = stage_params(cfg, stages)
    loads: dict[tuple[tuple[int, ...], int], tuple] = {}
    groups: dict[tuple, list[int]] = {}
    shard_ids: dict[tuple, int] = {}
    for rank in range(dims.world_size):
        c = dims.coordinates(rank)
        sizes, index = group_sizes(dims), group_index(dims, c)
        shapes = tuple(local_shape(s, sizes, index) for s in params[c.stages])
        load_key = (c.stages, c.ep)
        if load_key not in loads:
            loads[load_key] = expert_load(cfg, c.stages, c.ep)
        key = (c.pp, c.cp, shapes, loads[load_key])
        groups.setdefault(key, []).append(rank)
        shard_ids.setdefault((c.pp, shapes), len([k for k in shard_ids if k[0] == c.pp]))
    out = []
    for i, (key, ranks) in enumerate(sorted(groups.items(), key=lambda kv: kv[1][0])):
        pp, cp, shapes, load = key
        out.append(RankClass(i, tuple(ranks), pp, dims.stage_indices(pp), cp, shard_ids[(pp, shapes)], load))
    return out


def class_of(classes: list[RankClass]) -> dict[int, RankClass]:
    """Every rank -> its class."""
    return {r: c for c in classes for r in c.ranks}


# ------------------------------------------------------------------------------------------------- reporting
def rank_ranges(ranks: tuple[int, ...] | list[int]) -> str:
    """``0-7,16-23,40``: consecutive ranks as ranges."""
    out: list[str] = []
    start = prev = None
    for r in sorted(ranks):
        if start is None:
            start = prev = r
        elif r == prev + 1:
            prev = r
        else:
            out.append(f"{start}-{prev}" if prev != start else str(start))
            start = prev = r
    if start is not None:
        out.append(f"{start}-{prev}" if prev != start else str(start))
    return ",".join(out)


def classes_report(
    job: dict[str, Any], world_size: int, classes: list[dict[str, Any]], outcomes: list[Any]
) -> dict[str, Any]:
    """``rank_classes.json`` of any front door's job: every rank mapped to its class and the peak of the class's
    representative (its lowest rank; ``outcomes``: the :class:`~hyperdryrun.runner.RankOutcome` of each
    representative). ``job`` says what the job is (``{"model", "world_size", "parallel"}`` for the built-in recipe,
    ``{"script": spec}``, ``{"torchtitan": {"argv"}}``), its keys first; a class is ``{"ranks", "what"}``."""
    by_rank = {o.rank: o for o in outcomes}
    rows = []
    rank_class = [0] * world_size
    for i, c in enumerate(classes):
        o = by_rank.get(c["ranks"][0])
        summary = (o.report or {}).get("summary", {}) if o is not None and not o.error else {}
        for r in c["ranks"]:
            rank_class[r] = i
        rows.append(
            {
                "class": i,
                "representative": c["ranks"][0],
                "ranks": rank_ranges(c["ranks"]),
                "num_ranks": len(c["ranks"]),
                "what": c["what"],
                "peak_bytes": summary.get("peak_bytes"),
                "peak_reserved_bytes": summary.get("peak_reserved_bytes"),
                "peak_device_bytes": summary.get("peak_device_bytes"),
                "error": None if o is None else o.error,
                "report": o.paths[0] if o is not None and o.paths else None,
            }
        )
    return {**job, "world_size": world_size, "classes": rows, "rank_class": rank_class}


def print_rank_classes(report: dict[str, Any]) -> None:
    """The class table: which ranks each simulated rank stands for, and its peak."""
    from rich.table import Table

    from hyperdryrun.report.console import output_console
    from hyperdryrun.report.schema import human_bytes

    console = output_console()
    rows = report["classes"]
    t = Table(
        title=f"{len(rows)} rank classes cover all {report['world_size']} ranks",
        title_justify="left",
        title_style="bold",
        show_edge=False,
        pad_edge=False,
    )
    for col in ("class", "simulated rank", "ranks", "count", "peak", "what"):
        t.add_column(col, justify="right" if col in ("class", "simulated rank", "count", "peak") else "left")
    for r in rows:  # the peak as the ranks table gives it (a small model's in MiB, not "0.00" GiB)
        peak = "error" if r["error"] else ("" if r["peak_bytes"] is None else human_bytes(r["peak_bytes"]))
        t.add_row(str(r["class"]), str(r["representative"]), r["ranks"], str(r["num_ranks"]), peak, r["what"])
    console.print(t)


def write_rank_classes(
    job: dict[str, Any], classes: list[dict[str, Any]], cfg: Any, outcomes: list[Any], quiet: bool = False
) -> str | None:
    """``<output_dir>/rank_classes.json`` of :func:`classes_report` (written atomically) and, unless ``quiet``, the
    class table; returns the path. The one writer of every front door's ``--all-ranks``."""
    import json
    import sys
    from pathlib import Path

    from hyperdryrun.report.writer import atomic_write

    report = classes_report(job, cfg.world.world_size, classes, outcomes)
    path = Path(cfg.output_dir) / "rank_classes.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps(report, indent=1) + "\n")
    except OSError as err:  # the rank reports failed the same way and set the exit code
        sys.stderr.write(
            f"hyperdryrun: error: --output-dir {cfg.output_dir!r}: cannot write rank_classes.json: {err}\n"
        )
        return None
    if not quiet:
        print_rank_classes(report)
        from rich.console import Console

        Console().print(f"[dim]wrote {path}[/]", soft_wrap=True)
    return str(path)
