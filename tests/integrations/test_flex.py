"""Compiled FlexAttention for a CUDA target: the block mask, flex_attention's outputs, saved tensors and backward
allocations, checked against shapes worked out by hand (torch 2.13's flex kernels; no torchtitan needed)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.attention.flex_attention import and_masks, create_block_mask, flex_attention
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import hyperdryrun
from hyperdryrun.trace.blocks import Phase

B, HQ, HKV, L, E = 2, 4, 2, 256, 16  # GQA; L = 2 blocks of 128 (the default sparse block size)
BF16, FP32, INT32, BOOL = 2, 4, 4, 1
N_BLOCKS = L // 128

compiled_flex = torch.compile(flex_attention)
compiled_block_mask = torch.compile(create_block_mask)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding_window(window: int):
    """torchtitan 0.3.0 get_sliding_window_mask_mod: causal, at most ``window`` tokens back."""

    def mask(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < window)

    return mask


def packed_documents(positions: torch.Tensor):
    """torchtitan 0.3.0 get_efficient_causal_mask_mod_for_packed_document for batch > 1: documents start where
    positions reset to 0; a key is visible up to the end of its document (combined with causal)."""
    batch, seq_len = positions.shape
    starts = positions == 0
    doc = torch.cumsum(starts.int(), dim=1).to(torch.int32) - 1
    token = torch.arange(seq_len, device=positions.device, dtype=torch.int32).expand_as(positions)
    next_start = torch.full((batch, seq_len), seq_len, device=positions.device, dtype=torch.int32)
    nxt = starts & (doc > 0)
    next_start.scatter_(
        1,
        torch.where(nxt, doc - 1, torch.full_like(doc, seq_len - 1)).to(torch.int64),
        torch.where(nxt, token, torch.full_like(token, seq_len)),
    )
    doc_end = next_start.gather(1, doc.to(torch.int64)) - 1

    def mask(b, h, q_idx, kv_idx):
        return q_idx <= doc_end[b, kv_idx]

    return and_masks(causal, mask)


class Attend(nn.Module):
    """bf16 projections and flex_attention (GQA)."""

    def __init__(self, compiled: bool) -> None:
        super().__init__()
        self.wq = nn.Linear(E, HQ * E, bias=False, dtype=torch.bfloat16)
        self.wkv = nn.Linear(E, 2 * HKV * E, bias=False, dtype=torch.bfloat16)
        self.compiled = compiled

    def forward(self, x: torch.Tensor, mask) -> torch.Tensor:
        q = self.wq(x).view(B, L, HQ, E).transpose(1, 2)
        k, v = self.wkv(x).view(B, L, 2, HKV, E).unbind(2)
        flex = compiled_flex if self.compiled else flex_attention
        return flex(q, k.transpose(1, 2), v.transpose(1, 2), block_mask=mask, enable_gqa=True)


class FlexBlock(nn.Module):
    """One attention layer: a block mask made in forward, then attention, selectively checkpointed if asked."""

    def __init__(
        self, mask: str = "causal", compiled: bool = True, policy: CheckpointPolicy | None = None
    ) -> None:
        super().__init__()
        self.attend = Attend(compiled)
        self.mask, self.compiled, self.policy = mask, compiled, policy

    def block_mask(self, x: torch.Tensor):
        make = compiled_block_mask if self.compiled else create_block_mask
        if self.mask == "documents":
            positions = (
                torch.arange(L, device=x.device).remainder(100).repeat(B, 1)
            )  # documents of 100 tokens
            mod = packed_documents(positions)
        else:
            mod = sliding_window(64) if self.mask == "sliding_window" else causal
        return make(mod, B, None, L, L, device=x.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = self.block_mask(x)
        if self.policy is None:
            return self.attend(x, mask)
        policy = self.policy

        def choose(ctx, func, *args, **kwargs):
            return policy if "flex_attention" in str(func) else CheckpointPolicy.PREFER_RECOMPUTE

        return checkpoint(
            self.attend,
            x,
            mask,
            use_reentrant=False,
            context_fn=lambda: create_selective_checkpoint_contexts(choose),
        )


def run(**model_kwargs):
    return hyperdryrun.simulate(
        lambda: FlexBlock(**model_kwargs),
        lambda i, device: torch.randn(B, L, E, device=device, dtype=torch.bfloat16),
        loss_fn=lambda model, x: model(x).float().sum(),
        world_size=1,
        capture_stacks=False,
    )


def blocks_of(trace, op: str):
    return [b for b in trace.blocks if b.op == op]


def made_before_flex(trace):
    """Blocks of the forward up to the flex_attention call: the projections and the block mask."""
    flex = trace.task_op.index("flex_attention")
    return [b for b in trace.blocks if b.phase == Phase.FORWARD and b.start < flex]


def first_backward_task(trace) -> int:
    return trace.task_phase.index(Phase.BACKWARD)


# bytes of each tensor, from the shapes alone
OUT = B * HQ * L * E * BF16  # out (B, Hq, L, Ev), query dtype
LSE = B * HQ * L * FP32  # logsumexp / max_scores / delta (B, Hq, L), fp32
GRAD_Q = B * HQ * L * E * BF16
GRAD_KV = B * HKV * L * E * BF16  # the kernel writes the KV heads' gradients directly
NUM_BLOCKS = B * 1 * N_BLOCKS * INT32  # kv/q_num_blocks (B, H=1, n_blocks)
INDICES = B * 1 * N_BLOCKS * N_BLOCKS * INT32  # kv/q_indices (B, H, Q_BLOCKS, KV_BLOCKS)
DENSE_MASK = B * 1 * L * L * BOOL  # what eager create_block_mask materialises


@pytest.mark.parametrize("mask", ["causal", "sliding_window", "documents"])
def test_compiled_block_mask_allocates_only_the_block_mask_tensors(mask):
    trace = run(mask=mask)
    made = blocks_of(trace, "create_block_mask")
    # kv_num_blocks, kv_indices, full_kv_*, q_num_blocks, q_indices, full_q_* (separate_full_blocks=True)
    assert sorted(b.requested for b in made) == sorted([NUM_BLOCKS, INDICES] * 4)
    assert all(b.size == 512 for b in made)  # each rounded up to the CUDA allocator's 512 B
    assert len({b.start for b in made}) == 1  # one task, as one compiled graph
    assert max(b.requested for b in made_before_flex(trace)) < DENSE_MASK


def test_eager_block_mask_materialises_the_dense_mask():
    trace = run(compiled=False)
    assert not blocks_of(trace, "create_block_mask")
    assert any(b.requested == DENSE_MASK for b in made_before_flex(trace))
    assert any("without torch.compile in 1 call(s)" in line for line in trace.limitations)


@pytest.mark.parametrize("mask", ["causal", "sliding_window", "documents"])
def test_flex_forward_outputs_and_saved_tensors(mask):
    trace = run(mask=mask)
    forward = blocks_of(trace, "flex_attention")
    assert sorted(b.requested for b in forward) == sorted([OUT, LSE, LSE])
    assert len({b.start for b in forward}) == 1
    backward_starts = first_backward_task(trace)
    out = next(b for b in forward if b.requested == OUT)
    max_scores, lse = sorted((b for b in forward if b.requested == LSE), key=lambda b: b.end)
    # out and logsumexp are saved for the backward kernel; max_scores is dropped when the call returns
    assert out.end > backward_starts and lse.end > backward_starts
    assert max_scores.end < backward_starts


def test_flex_backward_allocates_delta_and_the_gradients():
    trace = run()
    backward = blocks_of(trace, "flex_attention_backward")
    assert sorted(b.requested for b in backward) == sorted([LSE, GRAD_Q, GRAD_KV, GRAD_KV])
    assert all(b.phase == Phase.BACKWARD for b in backward)
    delta = next(b for b in backward if b.requested == LSE)
    grads = [b for b in backward if b is not delta]
    # delta is live while the backward kernel writes dq, dk, dv
    assert all(delta.start < g.start < delta.end for g in grads)


def test_no_attention_scores_are_materialised():
    trace = run()
    scores = B * HQ * L * L * FP32
    assert max(b.requested for b in trace.blocks) < scores
    assert "compiled create_block_mask and flex_attention modelled as Inductor's CUDA kernels" in " ".join(
        trace.limitations
    )


@pytest.mark.parametrize(
    "policy, recomputed",
    [(CheckpointPolicy.MUST_SAVE, False), (CheckpointPolicy.PREFER_RECOMPUTE, True)],
)
def test_selective_checkpointing_saves_or_recomputes_the_flex_call(policy, recomputed):
    trace = run(policy=policy)
    phases = [b.phase for b in blocks_of(trace, "flex_attention")]
    assert (Phase.RECOMPUTE in phases) is recomputed
    assert phases.count(Phase.FORWARD) == 3  # out, logsumexp, max_scores of the forward call


def test_cpu_target_keeps_torchs_answer():
    with pytest.raises(hyperdryrun.SimulationError, match="does not support backward on CPU"):
        hyperdryrun.simulate(
            FlexBlock,
            lambda i, device: torch.randn(B, L, E, device=device, dtype=torch.bfloat16),
            loss_fn=lambda model, x: model(x).float().sum(),
            target_device="cpu",
        )


class CompiledRegion(nn.Module):
    """A compiled block mask, then attention inside a ``fullgraph`` compiled region (torchtitan's per-block compile
    reaches flex_attention so): dynamo traces torch's flex_attention HOP into the region's graph."""

    def __init__(self) -> None:
        super().__init__()
        self.attend = Attend(compiled=False)
        self.attend.compile(fullgraph=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attend(x, compiled_block_mask(causal, B, None, L, L, device=x.device))


def test_flex_inside_a_compiled_region_is_lowered_as_the_cuda_templates():
    trace = hyperdryrun.simulate(
        CompiledRegion,
        lambda i, device: torch.randn(B, L, E, device=device, dtype=torch.bfloat16),
        loss_fn=lambda model, x: model(x).float().sum(),
        world_size=1,
        capture_stacks=False,
    )
    text = " ".join(trace.limitations)
    assert "torch.compile region Attend module: compiled by torch" in text
    assert "flex_attention inside compiled regions lowered as Inductor's CUDA Triton templates" in text
    for eager in ("could not be compiled", "could not lower", "ran eagerly", "without torch.compile"):
        assert eager not in text
    backward_starts = first_backward_task(trace)
    # forward template: out, logsumexp, max_scores in one call; out and logsumexp saved, max_scores dropped
    forward = blocks_of(trace, "flex_attention")
    assert sorted(b.requested for b in forward) == sorted([OUT, LSE, LSE])
    assert len({b.start for b in forward}) == 1
    out = next(b for b in forward if b.requested == OUT)
    max_scores, lse = sorted((b for b in forward if b.requested == LSE), key=lambda b: b.end)
    assert out.end > backward_starts and lse.end > backward_starts
    assert max_scores.end < backward_starts
    # backward template: dq (query heads), dk and dv (KV heads) in one call, while Inductor's fp32 delta is live
    backward = blocks_of(trace, "flex_attention_backward")
    assert sorted(b.requested for b in backward) == sorted([GRAD_Q, GRAD_KV, GRAD_KV])
    (call,) = {b.start for b in backward}
    assert any(
        b.requested == LSE and b.phase == Phase.BACKWARD and b.start < call < b.end
        for b in trace.blocks
        if b.op != "flex_attention_backward"
    )
    assert max(b.requested for b in trace.blocks) < B * HQ * L * L * BF16  # no attention scores
