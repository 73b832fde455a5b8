"""torchtitan's DeepSeek-V3 and Qwen3-MoE debug jobs under skew 2: the dry run equals the real CPU execution of the
same step (``--measure``) with every router forced to the same counts, and the command takes the routing flags as
``run``, ``script`` and ``fit`` do.

The jobs, and what the comparison leaves out (what a CPU run alone puts on the device allocator), are
test_torchtitan_moe.py's: world 2, FSDP 2 x EP 2, rank 0, 2 x 64 tokens, ``--attention sdpa``. Skew 2 by its
definition: expert 0 of each routed layer gets round(2 x T x top_k / E) of the T = 128 tokens' rows, the other
experts share the rest evenly (the remainder to the lowest): DeepSeek-V3 debug (8 experts, top 3, balanced 48): 96,
then 288 = 7 x 41 + 1; Qwen3-MoE debug (64 experts, top 8, balanced 16): 32, then 992 = 63 x 15 + 47."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip(
    "torchtitan", reason="torchtitan is not installed (pip install 'hyperdryrun[torchtitan]')"
)

from hyperdryrun.integrations.torchtitan import load_config, simulate_torchtitan  # noqa: E402
from hyperdryrun.integrations.torchtitan_ranks import measured_routing  # noqa: E402
from hyperdryrun.measure.torchtitan import measure_torchtitan  # noqa: E402
from hyperdryrun.trace.blocks import Category  # noqa: E402
from hyperdryrun.world.routing import RoutingSpec  # noqa: E402
from tests.integrations.test_torchtitan_moe import (  # noqa: E402
    BF16,
    EP,
    FAMILIES,
    N_LAYERS,
    REPO,
    WORLD,
    _sinks_states,
    assert_measured_step,
    backward_unsharded_parameters,
    job,
    moe_layers,
)

pytestmark = pytest.mark.slow  # each job runs two real steps and a dry one (about a minute)

SKEW_2 = {
    "deepseek_v3_debugmodel": [96, 42] + [41] * 6,
    "qwen3_moe_debug": [32] + [16] * 47 + [15] * 16,
}


@pytest.fixture(scope="module", params=FAMILIES[:2], ids=[c for _, c in FAMILIES[:2]])
def forced(request):
    argv = job(*request.param)
    kw = dict(world_size=WORLD, rank=0, n_layers=N_LAYERS, attention="sdpa")
    spec = RoutingSpec(skew=2.0)
    measured = measure_torchtitan(argv, **kw, routing_spec=spec)
    dry = simulate_torchtitan(argv, **kw, target_device="cpu", capture_stacks=False, routing_spec=spec)
    return request.param[1], argv, measured, dry


def test_the_measured_routers_were_forced_to_skew_2(forced):
    config, argv, measured, _ = forced
    routing = measured_routing(measured)  # what the routed experts received in the real step
    assert set(routing) == set(moe_layers(argv))
    for name, counts in routing.items():
        assert counts == SKEW_2[config], name
    assert any(x.startswith("MoE routing forced: ") for x in measured.limitations)


def test_the_dry_run_under_skew_2_equals_the_measured_step_with_that_routing_forced(forced):
    _, argv, measured, dry = forced
    for b in backward_unsharded_parameters(measured):
        assert b.category in (Category.PARAMETER, Category.TEMP), b
        b.category = Category.PARAMETER
    assert_measured_step(measured, dry, _sinks_states(argv))


def test_the_all_to_all_receives_the_skewed_counts(forced):
    config, argv, _, dry = forced
    dim = load_config(argv).model_spec.model.dim
    local = len(SKEW_2[config]) // EP
    received = EP * sum(SKEW_2[config][:local]) * dim * BF16
    sizes = {b.size for b in dry.blocks if b.op == "all_to_all_single" and str(b.phase) == "forward"}
    assert received in sizes, (received, sorted(sizes))


def command(argv: list[str], *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hyperdryrun.cli", "torchtitan", *argv]
        + [f"--world-size={WORLD}", f"--n-layers={N_LAYERS}", "--attention=sdpa", "--target-device=cpu"]
        + ["--no-stacks", *flags],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(REPO / "src")},
    )


@pytest.mark.parametrize("forced", FAMILIES[1:2], ids=[FAMILIES[1][1]], indirect=True)
def test_the_command_takes_the_same_flags(forced, tmp_path):
    """One family is enough for the command line: --skew 2 as run's, and --fit's title says the routing."""
    _, argv, _, dry = forced
    done = command(argv, "--rank=0", "--quiet", "--skew=2", "--output-dir", str(tmp_path / "dry"))
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "dry" / "rank_0" / "rank_0_memory.json").read_text())
    assert report["summary"]["peak_bytes"] == dry.peak
    [line] = [x for x in report["limitations"] if x.startswith("MoE routing:")]
    assert "skew 2: in every routed layer expert 0 gets 2x the balanced load" in line
    fit = command(
        argv, "--fit", "--fit-tp=1", "--fit-pp=1", "--fit-cp=1", "--fit-ep=2", "--device-memory-gib=80",
        "--skew=2", "--output-dir", str(tmp_path / "fit"),
    )  # fmt: skip
    assert fit.returncode == 0, fit.stderr
    assert "MoE routing: skew 2: in every routed layer expert 0 gets 2x the balanced load" in fit.stdout
    layout = json.loads((tmp_path / "fit" / "layout_0" / "rank_0" / "rank_0_memory.json").read_text())
    assert layout["summary"]["peak_bytes"] == dry.peak
