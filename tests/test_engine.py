"""The engine: one JobPlan, set up by one ``prepare`` and run by both the dry run and ``measure``; the recipe's
plan; and the DTensor speed-up patch, which changes no result and is undone after every run.

Expected bytes come from the layer shapes and dtype sizes of the small models below, never from the code under test.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

import hyperdryrun
import hyperdryrun.recipe as recipe
from hyperdryrun.compat.torch_dtensor import foreach_strategy_expansion
from hyperdryrun.engine import JobPlan, SimulationError, job_plan, micro_batch_step, prepare, simulate_plan
from hyperdryrun.measure.step import measure_job, measure_plan
from hyperdryrun.report import build_report
from hyperdryrun.trace.blocks import Category, Phase

from .conftest import dry_run, job

F32 = 4
WIDTH = 16
PARAM_BYTES = 2 * (WIDTH * WIDTH + WIDTH) * F32  # two Linear(16, 16) with bias, fp32


def two_layers() -> nn.Module:
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH))


def ones_batch(i: int, device: torch.device) -> torch.Tensor:
    return torch.ones(8, WIDTH, device=device)


def mean_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).square().mean()


def plan_of(**over) -> JobPlan:
    return job_plan(two_layers, ones_batch, loss_fn=mean_loss, target_device="cpu", **over)


# ----------------------------------------------------------------------------------------------- the plan
@pytest.mark.parametrize(
    ("value", "shown"), [(0, "0"), (10**400, "an integer of about 401 digits"), (2.5, "2.5"), (True, "True")]
)
def test_a_plan_refuses_micro_batches_out_of_bounds_naming_the_value(value, shown):
    # 10**400 overflowed inside the step (exit 3), 2.5 and True ran (issue 30)
    with pytest.raises(
        ValueError, match=rf"^num_micro_batches: must be an integer from 1 to 10,000 \(got {shown}\)$"
    ):
        JobPlan(two_layers, ones_batch, micro_batch_step(mean_loss, 1), num_micro_batches=value)


def test_prepare_reaches_the_steady_state_of_step_two_on_fake_and_on_real_tensors():
    steps, inits = [], []
    inner = micro_batch_step(mean_loss, 2)

    def step(model, optimizer, batches):
        steps.append(len(list(batches)))
        inner(model, optimizer, iter([ones_batch(0, torch.device("cpu"))] * 2))

    def init(model):
        inits.append(model)
        for p in model.parameters():
            p.fill_(0.5)

    plan = JobPlan(two_layers, ones_batch, step, init_fn=init, num_micro_batches=2, target_device="cpu")
    for real in (False, True):
        stages: list[str] = []
        world = plan.world(simulation_device="cpu")
        with world:
            model, optimizer = prepare(world, plan, stages, real=real)
            params = list(model.parameters())
            assert all(isinstance(p, FakeTensor) is not real for p in params)
            # AdamW's states exist and no gradient is left: what a step after the first one starts from.
            assert all(optimizer.state[p]["exp_avg"].shape == p.shape for p in params)
            assert all(p.grad is None for p in params)
        assert stages == ["model", "parallelize", "materialize", "optimizer", *(["warm-up"] if real else [])]
    # Only the real set-up fills values and runs a warm-up step, over every micro batch.
    assert len(inits) == 1 and steps == [2]


def test_one_plan_gives_the_same_residents_and_roles_in_the_dry_run_and_measured():
    plan = plan_of()
    dry, real = simulate_plan(plan), measure_plan(plan)
    for trace in (dry, real):
        # fp32 parameters and AdamW's exp_avg and exp_avg_sq; no gradient before the step.
        assert trace.initial == 3 * PARAM_BYTES
        at_peak = build_report(trace)["summary"]["breakdown_at_peak"]
        assert (at_peak["Parameter"], at_peak["Optstate"]) == (PARAM_BYTES, 2 * PARAM_BYTES)
        grads = [b for b in trace.blocks if b.category is Category.GRADIENT]
        assert sorted(b.size for b in grads) == sorted([WIDTH * WIDTH * F32, WIDTH * F32] * 2)
        assert {b.phase for b in grads} == {Phase.BACKWARD}
    world = ("world_size", "rank", "local_rank", "target_device", "simulation_device", "mesh_shape")
    assert (
        [dry.metadata[k] for k in world] == [real.metadata[k] for k in world] == [1, 0, 0, "cpu", "cpu", [1]]
    )
    assert real.metadata["mode"] == "measured" and "mode" not in dry.metadata


@pytest.mark.parametrize("run", [simulate_plan, measure_plan])
def test_a_failing_stage_is_named_alike_by_the_dry_run_and_measure(run):
    def boom(model, mesh):
        raise RuntimeError("no such layout")

    with pytest.raises(SimulationError, match="^parallelize: RuntimeError: no such layout$"):
        run(plan_of(parallelize_fn=boom))


# ----------------------------------------------------------------------------------------------- the recipe's plan
def test_the_recipe_plan_picks_the_step_of_the_layout_and_says_what_it_approximates():
    plain = recipe.plan(job(world__world_size=2))
    assert plain.held_fn is None and plain.limitations == []
    assert (plain.world_size, plain.mesh_shape, plain.target_device) == (2, (1, 1, 2, 1, 1), "cuda")
    pp = recipe.plan(job(world__world_size=2, world__rank=1, parallel__pp=2, training__num_micro_batches=2))
    assert pp.held_fn is not None and list(pp.held_fn()) == []  # no schedule before the first step
    assert [x.split(":")[0] for x in pp.limitations] == ["pipeline"]
    assert pp.metadata["pipeline"]["stage_indices"] == [1]
    cp = recipe.plan(job(world__world_size=2, parallel__cp=2))
    assert cp.held_fn is None and [x.split(":")[0] for x in cp.limitations] == ["context parallel"]
    moe = recipe.plan(job(model__name="moe-tiny"))
    assert [x.split(":")[0] for x in moe.limitations] == ["MoE routing is a scenario, not data"]


def test_run_and_measure_execute_the_same_recipe_plan(monkeypatch):
    planned = []
    real_plan = recipe.plan

    def plan(cfg):
        p = real_plan(cfg)
        planned.append(cfg)
        p.metadata["planned"] = len(planned)
        return p

    monkeypatch.setattr(recipe, "plan", plan)
    cfg = job(target_device="cpu", training__seq_len=16)
    assert recipe.run_job(cfg, capture_stacks=False).metadata["planned"] == 1
    assert measure_job(cfg, capture_stacks=False).metadata["planned"] == 2
    assert planned == [cfg, cfg]


# ----------------------------------------------------------------------------------------------- DTensor speed-up
_CSV_SCRIPT = """
import sys
import hyperdryrun.engine as engine
from hyperdryrun.config import build_config
from hyperdryrun.recipe import run_job
from hyperdryrun.report import blocks_csv
if sys.argv[1] == "unpatched":
    engine.dtensor_speedups = lambda: []
cfg = build_config({"model": {"name": "llama-tiny"}, "training": {"seq_len": 64},
                    "world": {"world_size": 4}, "parallel": {"tp": 2}})
sys.stdout.write(blocks_csv(run_job(cfg)))
"""


def _fresh_process_csv(mode: str) -> str:
    # A fresh process each: the first run in a process sees torch's DTensor caches cold (see docs/PERFORMANCE.md).
    env = dict(os.environ, PYTHONPATH=str(Path(hyperdryrun.__file__).resolve().parent.parent))
    proc = subprocess.run(
        [sys.executable, "-c", _CSV_SCRIPT, mode], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_dtensor_speedup_changes_no_block():
    # FSDP over TP-sharded parameters: the foreach optimizer ops have _StridedShard inputs, the patch's other branch.
    patched = _fresh_process_csv("patched")
    assert patched.count("\n") > 100
    assert _fresh_process_csv("unpatched") == patched


def test_a_torch_without_strided_shard_flag_propagation_gets_no_speedup(monkeypatch):
    """torch 2.11 has no _propagate_use_strided_shard_flag: nothing to patch, so the world starts (on 2.11 the patch
    stopped every job with an AttributeError)."""
    from hyperdryrun import engine
    from hyperdryrun.compat import torch_dtensor

    monkeypatch.setattr(torch_dtensor, "strided_shard_flag_propagation", lambda: None)
    assert "_propagate_use_strided_shard_flag" not in {p.name for p in engine.dtensor_speedups()}
    monkeypatch.setattr(torch_dtensor, "foreach_strategy_expansion", lambda: None)
    assert engine.dtensor_speedups() == []


def test_dtensor_speedup_patches_undone_after_run_and_after_failure():
    import torch.distributed.tensor._sharding_prop as sharding_prop

    from hyperdryrun import engine, simulate

    names = ("_propagate_use_strided_shard_flag", "_expand_single_dim_strategy_to_mesh")
    assert {p.name for p in engine.dtensor_speedups()} == {n for n in names if hasattr(sharding_prop, n)}

    def patched():
        return {name: getattr(sharding_prop, name, None) for name in names}

    original = patched()
    dry_run(world__world_size=2)
    assert patched() == original

    def boom(model, batch):
        raise RuntimeError("loss exploded")

    with pytest.raises(SimulationError, match="step: RuntimeError: loss exploded"):
        simulate(
            lambda: torch.nn.Linear(4, 4), lambda i, d: torch.ones(2, 4, device=d), loss_fn=boom, world_size=2
        )
    assert patched() == original


def test_an_interrupt_that_torchs_unwinding_turns_into_another_error_still_stops_the_run():
    """A Ctrl-C inside torch's ``fake_tensor.in_kernel_invocation_manager`` leaves the mode's flag set, and the next
    fake op on the way out raises ``AssertionError: False, True`` over the interrupt (seen in
    tests/test_cancellation.py: "rank 0: optimizer failed: AssertionError: False, True", exit 3 and a report). The
    interrupt is what the run ends with: no SimulationError, and the world undone."""
    import torch.distributed as dist

    from hyperdryrun import simulate

    def interrupted(model, batch):
        try:
            raise KeyboardInterrupt
        finally:
            raise AssertionError("False, True")  # what torch raises while the interrupt unwinds

    with pytest.raises(KeyboardInterrupt) as caught:
        simulate(
            lambda: torch.nn.Linear(4, 4),
            lambda i, d: torch.ones(2, 4, device=d),
            loss_fn=interrupted,
            world_size=2,
        )
    assert caught.value.__cause__ is None and not dist.is_initialized()


def test_interrupt_behind_finds_only_an_interrupt():
    from hyperdryrun.commands import Terminated
    from hyperdryrun.engine import interrupt_behind

    def raised(first: BaseException, then: BaseException) -> BaseException:
        try:
            try:
                raise first
            finally:
                raise then
        except BaseException as err:
            return err

    assert interrupt_behind(RuntimeError("a bug")) is None
    assert interrupt_behind(raised(SystemExit(1), RuntimeError("x"))) is None
    assert interrupt_behind(raised(RuntimeError("x"), ValueError("y"))) is None
    term = Terminated()
    assert interrupt_behind(raised(raised(term, KeyError("k")), AssertionError("False, True"))) is term
    looped = RuntimeError("loop")
    looped.__context__ = looped
    assert interrupt_behind(looped) is None


def _foreach_ops_expand_single_dim_strategies() -> bool:
    """Whether DTensor propagates AdamW's foreach ops through single-dim strategies, which the speed-up expands
    (torch 2.12 and later; 2.11 has list strategies of its own for them, and the patch changes nothing there)."""
    from torch.distributed.tensor import DTensor

    funcs = DTensor._op_dispatcher.sharding_propagator.op_single_dim_strategy_funcs
    return foreach_strategy_expansion() is not None and torch.ops.aten._foreach_add_.List in funcs


@pytest.mark.skipif(
    not _foreach_ops_expand_single_dim_strategies(),
    reason=f"torch {torch.__version__} expands no foreach strategy per element",
)
@pytest.mark.parametrize(
    "parallel", [{"dp_shard": 4}, {"dp_shard": 2, "tp": 2}], ids=["fsdp", "fsdp-over-tp-strided"]
)
def test_foreach_strategies_expanded_once_per_distinct_element_are_torchs_own_for_every_element(
    monkeypatch, parallel
):
    """Every foreach op's strategy the speed-up gives (one expansion per distinct element, shared) equals torch's
    own unpatched expansion of every element, child by child, costs included; and it did share (fewer distinct
    strategies than elements: llama-tiny's two layers have equal shards). FSDP over TP gives _StridedShard
    inputs."""
    import torch.distributed.tensor._sharding_prop as sharding_prop

    from hyperdryrun import engine
    from hyperdryrun.compat import torch_dtensor
    from hyperdryrun.patches import Patch

    original = sharding_prop._expand_single_dim_strategy_to_mesh
    checked: list[tuple[int, int]] = []

    def costs(strategy):
        return [[spec.redistribute_cost for spec in child.strategies] for child in strategy.children]

    def checking() -> list[Patch]:
        (speedup,) = torch_dtensor.foreach_strategy_patches()

        def expand(mesh, op_schema, info, meta):
            fast = speedup.new(mesh, op_schema, info, meta)
            if getattr(fast, "__name__", None) != "expanded_foreach_strategy":
                return fast

            def both(op, args, kwargs):
                got = fast(op, args, kwargs)
                want = original(mesh, op_schema, info, meta)(op, args, kwargs)
                assert list(got.children) == list(want.children)
                assert costs(got) == costs(want)
                checked.append((len(want.children), len({id(c) for c in got.children})))
                return got

            return both

        return [Patch(sharding_prop, "_expand_single_dim_strategy_to_mesh", expand, reason="test")]

    monkeypatch.setattr(engine, "dtensor_speedups", checking)
    dry_run(world__world_size=4, parallel=parallel)
    assert checked, "AdamW's foreach ops propagated through the speed-up"
    assert any(distinct < elements for elements, distinct in checked)
    assert sharding_prop._expand_single_dim_strategy_to_mesh is original


@pytest.mark.parametrize(
    "parallel", [{"dp_shard": 4}, {"dp_shard": 2, "tp": 2}], ids=["fsdp", "fsdp-over-tp-strided"]
)
def test_foreach_output_metadata_from_distinct_elements_is_torchs_own_for_every_element(
    monkeypatch, parallel
):
    """DTensor's global-shape shape inference of a foreach op, run by the world on one element per distinct
    element and spread back, equals torch's own run over every element (its unpatched function, in a fresh fake
    mode); and some op was shared."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.utils._python_dispatch import _disable_current_modes

    from hyperdryrun.compat import torch_dtensor

    original = ShardingPropagator._propagate_tensor_meta_non_cached
    distinct = torch_dtensor._distinct_foreach_elements
    checked: list[tuple[int, int]] = []
    lists: list[int] = []  # out-of-place foreach ops (AdamW's _foreach_sqrt ...): metadata per element

    def checking(op_schema):
        found = distinct(op_schema)
        if found is not None:
            reduced, slots = found
            propagator = DTensor._op_dispatcher.sharding_propagator
            with _disable_current_modes():
                want = original(propagator, op_schema)
                got = original(propagator, reduced)
            if want is not None:
                assert type(got)(got[j] for j in slots) == want
                lists.append(len(want))
            else:
                assert got is None
            checked.append((len(slots), max(slots) + 1))
        return found

    monkeypatch.setattr(torch_dtensor, "_distinct_foreach_elements", checking)
    dry_run(world__world_size=4, parallel=parallel)
    assert any(distinct_count < count for count, distinct_count in checked)
    assert lists


def test_a_foreach_ops_scalar_list_keeps_elements_with_other_scalars_apart(monkeypatch):
    """A ScalarList foreach op is shared per distinct element too, an element being its tensor metadata and its own
    scalar, type and value: int tensors times [2, 2.5, 2] give int64, float32, int64 (type promotion by the
    scalar), as the per-element op does; elements 0 and 2 share one run."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from hyperdryrun.compat import torch_dtensor
    from hyperdryrun.world.simulated import SimulatedWorld

    distinct = torch_dtensor._distinct_foreach_elements
    slots: list[list[int] | None] = []

    def spy(op_schema):
        found = distinct(op_schema)
        if str(op_schema.op) == "aten._foreach_mul.ScalarList":
            slots.append(None if found is None else found[1])
        return found

    monkeypatch.setattr(torch_dtensor, "_distinct_foreach_elements", spy)
    with SimulatedWorld(world_size=2) as world:
        mesh = init_device_mesh(torch.device(world.device).type, (2,))
        with world.fake():
            xs = [
                DTensor.from_local(torch.ones(4, 3, dtype=torch.int64, device=world.device), mesh, [Shard(0)])
                for _ in range(3)
            ]
            out = torch._foreach_mul(xs, [2, 2.5, 2])
            each = [torch.mul(x, s) for x, s in zip(xs, [2, 2.5, 2])]
    assert slots == [[0, 1, 0]]
    assert [o.dtype for o in out] == [e.dtype for e in each] == [torch.int64, torch.float32, torch.int64]
    assert [o.shape for o in out] == [e.shape for e in each]


def test_what_torch_logs_at_warning_during_the_step_goes_to_the_limitations_and_its_handlers_come_back(capfd):
    """torch._logging gives ``torch`` and its registered loggers stderr handlers of their own (propagate off);
    inside the simulation a WARNING they log is a limitation line, counted, and nothing reaches the terminal."""
    import logging

    from hyperdryrun.engine import warnings_as_limitations

    torch._logging._internal._init_logs()  # the handlers torch sets up (idempotent)
    dynamo = logging.getLogger("torch._dynamo")
    before = {name: list(logging.getLogger(name).handlers) for name in ("torch", "torch._dynamo")}
    assert before["torch"], "torch._logging gives the torch logger a handler"
    with warnings_as_limitations() as warned:
        dynamo.warning("a graph break in %s", "f")
        dynamo.warning("a graph break in %s", "f")
        dynamo.info("not a warning")
    assert warned() == [
        "warned during the simulated step (2 times): WARNING torch._dynamo: a graph break in f"
    ]
    assert capfd.readouterr().err == ""
    assert {name: list(logging.getLogger(name).handlers) for name in before} == before
