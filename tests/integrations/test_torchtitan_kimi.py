"""torchtitan 0.3.0's kimi_k2_7 (its debug config ``kimi_k2_5_debugmodel``: DeepSeek-V3-style MLA and MoE layers,
a vision encoder, DistMuon for the matrices and AdamW for the rest) on one rank: the dry run equals its real CPU
execution (``--measure``) with the measured routing.

Job: the debug model cut to 2 layers, world 1 (torchtitan still wraps it with FSDP2 over one rank), local batch
2 x 64 tokens, ``--attention sdpa`` (no FlexAttention backward on the CPU). Left out of the comparison, as in
test_torchtitan_moe.py: host tensors, CPU-only wrapped scalars and the kernels' scratch. And one difference the
tests derive: the batches are text only, so the vision encoder gets no gradient and AdamW, which skips a parameter
without one, never makes its states in the measured run, while the dry run makes every trainable parameter's
states before the step (as a job whose batches reach the vision encoder holds them): two fp32 states per fp32
parameter, twice the encoder's parameter bytes, at every point of the step.

On more than one rank kimi_k2_7 is refused (test_torchtitan_families.py): DistMuon's compute layouts need the
``spmd_types`` backend, whose ``fully_shard`` support torch 2.13 lacks.
"""

from __future__ import annotations

import pytest

pytest.importorskip(
    "torchtitan", reason="torchtitan is not installed (pip install 'hyperdryrun[torchtitan]')"
)

from hyperdryrun.integrations.torchtitan import simulate_torchtitan  # noqa: E402
from hyperdryrun.integrations.torchtitan_ranks import measured_routing  # noqa: E402
from hyperdryrun.measure.torchtitan import measure_torchtitan  # noqa: E402
from tests.integrations.test_torchtitan_moe import assert_measured_step  # noqa: E402

pytestmark = pytest.mark.slow  # two real steps of a 2-layer model (about 20 s)

JOB = [
    *("--module", "kimi_k2_7", "--config", "kimi_k2_5_debugmodel"),
    *("--training.seq_len", "64", "--training.local_batch_size", "2"),
]
ARGS = dict(world_size=1, rank=0, n_layers=2, attention="sdpa")


def vision(blocks, category: str) -> int:
    return sum(
        b.size for b in blocks if b.module.startswith("vision_encoder") and str(b.category) == category
    )


@pytest.fixture(scope="module")
def measured_and_dry():
    from torch.distributed.device_mesh import DeviceMesh
    from torchtitan.distributed.flex_shard.dist_muon import DistMuon

    own = DistMuon.__dict__["_validate_parameter_storage"], DeviceMesh.__dict__["mesh"]
    measured = measure_torchtitan(JOB, **ARGS)
    routing = measured_routing(measured)
    dry = simulate_torchtitan(JOB, **ARGS, target_device="cpu", capture_stacks=False, routing=routing)
    assert (DistMuon.__dict__["_validate_parameter_storage"], DeviceMesh.__dict__["mesh"]) == own
    return measured, dry


def test_the_vision_encoder_has_optimizer_states_only_in_the_dry_run(measured_and_dry):
    measured, dry = measured_and_dry
    params = vision(measured.blocks, "Parameter")
    assert params > 0 and vision(dry.blocks, "Parameter") == params
    assert vision(measured.blocks, "Optstate") == 0
    assert vision(dry.blocks, "Optstate") == 2 * params  # exp_avg and exp_avg_sq, fp32 like the parameters


def test_dry_run_equals_the_measured_step_but_the_vision_encoder_states(measured_and_dry):
    measured, dry = measured_and_dry
    assert_measured_step(measured, dry, dry_only_optstate=2 * vision(measured.blocks, "Parameter"))


def test_the_dry_run_says_which_parameters_got_no_gradient(measured_and_dry):
    _, dry = measured_and_dry
    said = [x for x in dry.limitations if x.startswith("no gradient in this step:")]
    assert len(said) == 1 and "vision_encoder" in said[0]
