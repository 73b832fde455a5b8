"""FSDP2's gradient-accumulation copies (gradient sync off, as in pipeline stages) are gradients, not temporaries."""

from __future__ import annotations

from hyperdryrun.trace.blocks import Category, Phase
from tests.conftest import dry_run


def r512(n: int) -> int:
    return (n + 511) // 512 * 512


def test_unsharded_accumulated_gradients_under_pipelining_are_gradients():
    # llama-tiny with 4 layers over pp=2 (GPipe, 2 micro batches), FSDP over the 2 data-parallel ranks: stage 0
    # holds the embedding (256 x 64) and layers 0-1. With gradient sync off until the last micro batch, FSDP2 casts
    # each parameter's unsharded bf16 gradient to an fp32 copy once (torch 2.13 FSDPParam.to_accumulated_grad_if_
    # needed) and adds later micro batches into it: one full-size fp32 block per parameter of the stage (a layer:
    # the fused wqkv (q 64 + k 32 + v 32 rows), wo, w1, w2, w3 and two norms).
    d, kv, f = 64, 32, 128
    layer = [(d + 2 * kv) * d, d * d, f * d, d * f, f * d, d, d]
    expected = r512(256 * d * 4) + 2 * sum(r512(n * 4) for n in layer)
    trace = dry_run(
        world__world_size=4,
        parallel__pp=2,
        parallel__pp_schedule="GPipe",
        training__num_micro_batches=2,
        model__n_layers=4,
    )
    copies = [
        b
        for b in trace.blocks
        if b.phase is Phase.BACKWARD and b.op == "_to_copy" and b.category is Category.GRADIENT
    ]
    assert len(copies) == 1 + 2 * len(layer)
    assert sum(b.size for b in copies) == expected
