"""Activation checkpointing: full < selective < none for the activation peak, and full AC keeps exactly each
layer's inputs."""

from __future__ import annotations

import pytest

from hyperdryrun.trace.blocks import Category, Phase
from tests.conftest import dry_run

SEQ = 256


def activation_bytes_at(trace, task: int) -> int:
    return sum(b.size for b in trace.blocks if b.category is Category.ACTIVATION and b.start <= task < b.end)


def activation_peak(trace) -> int:
    return max(activation_bytes_at(trace, t) for t in range(trace.num_tasks))


def end_of_forward(trace) -> int:
    return max(t for t, p in enumerate(trace.task_phase) if p is Phase.FORWARD)


@pytest.fixture(scope="module")
def peaks():
    runs = {
        "none": {},
        "selective-op": {"training__ac": "selective", "training__ac_selective": "op"},
        "selective-every-2": {"training__ac": "selective", "training__ac_selective": "2"},
        "full": {"training__ac": "full"},
    }
    return {
        name: activation_peak(dry_run(model__n_layers=4, training__seq_len=SEQ, **over))
        for name, over in runs.items()
    }


def test_full_is_below_selective_is_below_none(peaks):
    assert peaks["full"] < peaks["selective-op"] < peaks["none"]
    assert peaks["full"] < peaks["selective-every-2"] < peaks["none"]


def test_full_ac_keeps_only_the_inputs_of_each_layer():
    # llama-tiny, bs 1, dim 64. A fully checkpointed layer saves exactly its inputs: the bf16 hidden states
    # (FSDP2 mixed precision, param_dtype bf16) and the RoPE table, a buffer that is shared by every layer and not
    # an activation (complex, so FSDP2's cast_forward_inputs leaves it alone). Each extra layer therefore adds
    # seq*dim*2 bytes (512-rounded on a CUDA target) of activations at the end of the forward.
    def r512(n: int) -> int:
        return (n + 511) // 512 * 512

    held = {}
    for layers in (2, 4):
        trace = dry_run(model__n_layers=layers, training__seq_len=SEQ, training__ac="full")
        held[layers] = activation_bytes_at(trace, end_of_forward(trace))
    per_layer = r512(SEQ * 64 * 2)
    assert held[4] - held[2] == 2 * per_layer
