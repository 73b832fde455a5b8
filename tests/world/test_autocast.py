"""``torch.autocast("cuda", ...)`` in a CUDA-target dry run applies CUDA's autocast lists on the fake "cpu" tensors.

Expected values come from outside the code under test: the saved tensors and bytes of a block derived by hand from
torch 2.13's CUDA lists (aten/src/ATen/autocast_mode.h, ``AT_FORALL_*``); the set of ops the installed torch
registers for AutocastCUDA; torch's own AutocastCUDA C++ kernels, which run on fake "cuda" tensors of the CPU build
under ``no_grad`` (autograd on fake "cuda" aborts that build, so they cannot give saved tensors); real CPU autocast
where CPU's and CUDA's lists agree.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from hyperdryrun.world import SimulatedWorld
from hyperdryrun.world.autocast import CUDA_POLICIES, CudaAutocast, autocast_state, cpu_only_ops

_BF16, _F32 = torch.bfloat16, torch.float32


class OpLog(TorchDispatchMode):
    """Every aten op below autocast with its tensor arguments' (shape, dtype) and its dtype keyword."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.ops.prim.device.default:
            tensors = [(tuple(a.shape), a.dtype) for a in args if isinstance(a, torch.Tensor)]
            self.ops.append((str(func), tuple(tensors), kwargs.get("dtype")))
        return func(*args, **kwargs)


def _saved(into: list[tuple]) -> Any:
    def pack(t: torch.Tensor) -> torch.Tensor:
        into.append((tuple(t.shape), t.dtype))
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


# --------------------------------------------------------------------------- the block, derived by hand
T, D, H, V = 64, 32, 128, 256  # tokens, model dim, hidden, vocabulary: every large tensor a multiple of 512 B


class Block(nn.Module):
    """embedding -> linear (bias) -> SiLU -> softmax -> matmul -> layer_norm -> linear -> cross_entropy, fp32
    parameters; each intermediate dropped as soon as it is used, so its lifetime is the one derived below."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.lin1 = nn.Linear(D, H)
        self.m = nn.Parameter(torch.empty(H, D))
        self.norm = nn.LayerNorm(D)
        self.lin2 = nn.Linear(D, V, bias=False)

    def forward(self, tok: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        x = self.emb(tok)
        h = self.lin1(x)
        del x
        a = F.silu(h)
        del h
        p = F.softmax(a, -1)
        del a
        o = torch.matmul(p, self.m)
        del p
        n = self.norm(o)
        del o
        logits = self.lin2(n)
        del n
        loss = F.cross_entropy(logits, tgt)
        del logits
        return loss


def _round(n: int) -> int:
    return -(-n // 512) * 512


# Under CUDA autocast bf16 (lists of torch 2.13 autocast_mode.h), op by op:
#   embedding        unlisted: x fp32 (T,D); saves tok
#   linear           lower_precision_fp, casts right to left: bias, weight (fp32 leaves requiring grad: cached
#                    until the region exits), x (not cached: not a leaf); addmm saves x_bf16 and weight_bf16.t()
#   silu             unlisted: bf16; saves its input h
#   softmax.int      fp32_set_opt_dtype, no dtype given -> dtype=fp32: a temporary fp32 copy of a, then
#                    _softmax; saves its fp32 result
#   matmul           lower_precision_fp: m (cached), p -> bf16; mm saves p_bf16 and m_bf16
#   layer_norm       fp32: o -> fp32 (weight, bias already fp32); native_layer_norm saves o_fp32, weight, bias,
#                    mean and rstd (T,1) fp32
#   linear (no bias) lower_precision_fp: weight (cached), n -> bf16; mm saves n_bf16 and weight_bf16.t()
#   cross_entropy    unlisted on CUDA (listed fp32 on CPU): log_softmax.int is given dtype=bf16 explicitly, kept:
#                    bf16 result saved; nll_loss fp32: log-probs -> fp32, saved with target and total_weight
SAVED_BY_HAND = sorted(
    [
        ((T,), torch.int64),  # embedding: tok
        ((T, D), _BF16),  # addmm: x_bf16
        ((D, H), _BF16),  # addmm: lin1.weight_bf16.t()
        ((T, H), _BF16),  # silu: h
        ((T, H), _F32),  # softmax: result
        ((T, H), _BF16),  # mm: p_bf16
        ((H, D), _BF16),  # mm: m_bf16
        ((T, D), _F32),  # native_layer_norm: o_fp32
        ((D,), _F32),  # weight
        ((D,), _F32),  # bias
        ((T, 1), _F32),  # mean
        ((T, 1), _F32),  # rstd
        ((T, D), _BF16),  # mm: n_bf16
        ((D, V), _BF16),  # mm: lin2.weight_bf16.t()
        ((T, V), _BF16),  # log_softmax: result
        ((T, V), _F32),  # nll_loss: log-probs fp32
        ((T,), torch.int64),  # nll_loss: target
        ((), _F32),  # nll_loss: total_weight
    ],
    key=str,
)

# Bytes, each storage rounded up to 512 B; (live bytes after the op) in forward order.
_x, _xb, _w1b, _b1b, _h = T * D * 4, T * D * 2, H * D * 2, _round(H * 2), T * H * 2
_a, _a32, _p, _pb, _mb, _o = T * H * 2, T * H * 4, T * H * 4, T * H * 2, H * D * 2, T * D * 2
_o32, _n, _stat, _nb, _w2b, _logits = T * D * 4, T * D * 4, _round(T * 4), T * D * 2, V * D * 2, T * V * 2
_lsm, _lsm32, _scalar = T * V * 2, T * V * 4, _round(4)
LIVE_BY_HAND: list[int] = []
_live = 0
for delta in (
    _x,  # embedding
    _b1b + _w1b + _xb + _h,  # linear
    -_x,  # del x
    _a,  # silu (h stays: saved)
    _a32 + _p,  # softmax: fp32 copy and result
    -_a32,  # the copy is a temporary
    -_a,  # del a (not saved)
    _mb + _pb + _o,  # matmul
    _o32 + _n + 2 * _stat,  # layer_norm
    -_o,  # del o
    _w2b + _nb + _logits,  # linear
    -_n,  # del n
    _lsm + _lsm32 + 2 * _scalar,  # cross_entropy: log_softmax, fp32 copy, loss, total_weight
    -_logits,  # del logits
):
    _live += delta
    LIVE_BY_HAND.append(_live)
PEAK_BY_HAND = max(LIVE_BY_HAND)
AFTER_REGION_BY_HAND = (
    LIVE_BY_HAND[-1] - _b1b
)  # exiting the region drops the cache; only the bias copy was unsaved


def test_the_hand_derivation_is_self_consistent():
    # the bytes left after the forward are exactly the saved storages plus the loss
    saved_storages = (
        _xb + _w1b + _h + _p + _pb + _mb + _o32 + 2 * _stat + _nb + _w2b + _lsm + _lsm32 + _scalar
    )
    assert AFTER_REGION_BY_HAND == saved_storages + _scalar
    assert PEAK_BY_HAND == 248_320 and AFTER_REGION_BY_HAND == 215_040


def _block_in_world(enter: Callable[[], Any], target_device: str = "cuda") -> dict:
    with torch.device("meta"):
        block = Block()  # built on meta outside the fake mode and materialised in it, as the engine does
    with SimulatedWorld(target_device=target_device, simulation_device="cpu") as world, world.fake():
        block.to_empty(device="cpu")
        tok = torch.randint(0, V, (T,))
        tgt = torch.randint(0, V, (T,))
        tracker = world.track(capture_stacks=False)
        saved: list[tuple] = []
        tracker.start()
        with _saved(saved):
            with enter():
                loss = block(tok, tgt)
                in_region = tracker.current
            after = tracker.current
            peak = tracker.peak
        loss.backward()
        tracker.stop()
        return {
            "saved": sorted(saved, key=str),
            "in_region": in_region,
            "after": after,
            "peak": peak,
            "loss": loss.dtype,
            "grads": {n: p.grad.dtype for n, p in block.named_parameters()},
        }


def test_a_block_under_cuda_autocast_saves_and_peaks_as_derived_by_hand_from_cudas_lists():
    got = _block_in_world(lambda: torch.autocast("cuda", dtype=torch.bfloat16))
    assert got["saved"] == SAVED_BY_HAND
    assert got["in_region"] == LIVE_BY_HAND[-1]
    assert got["peak"] == PEAK_BY_HAND
    assert got["after"] == AFTER_REGION_BY_HAND
    assert got["loss"] == torch.float32
    assert set(got["grads"].values()) == {torch.float32}  # gradients reach the fp32 parameters


def test_the_same_block_without_autocast_runs_in_fp32_so_the_derivation_is_not_vacuous():
    import contextlib

    got = _block_in_world(contextlib.nullcontext)
    assert {dtype for _, dtype in got["saved"]} == {torch.float32, torch.int64}
    assert got["peak"] != PEAK_BY_HAND


@pytest.mark.parametrize(
    "spelling",
    [
        lambda: torch.autocast("cuda", dtype=torch.bfloat16),
        lambda: torch.amp.autocast("cuda", dtype=torch.bfloat16),
        lambda: torch.autocast(device_type="cuda", dtype=torch.bfloat16),
        lambda: torch.cuda.amp.autocast(dtype=torch.bfloat16),
    ],
    ids=["torch.autocast", "torch.amp.autocast", "keyword", "torch.cuda.amp.autocast"],
)
def test_every_spelling_of_cuda_autocast_is_simulated(spelling):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.cuda.amp.autocast's deprecation, as on a GPU
        got = _block_in_world(spelling)
    assert got["saved"] == SAVED_BY_HAND and got["peak"] == PEAK_BY_HAND


def test_no_cuda_is_not_available_warning_and_cuda_state_answers_as_on_a_gpu():
    with SimulatedWorld(target_device="cuda", simulation_device="cpu"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                inside = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
                with torch.autocast("cuda", enabled=False):
                    disabled = torch.is_autocast_enabled("cuda"), torch.is_autocast_enabled("cpu")
            outside = torch.is_autocast_enabled("cuda")
    assert not [w for w in caught if "autocast" in str(w.message).lower()]
    assert inside == (True, torch.bfloat16) and disabled == (False, False) and outside is False


def test_a_cpu_target_keeps_cpu_semantics():
    with SimulatedWorld(target_device="cpu", simulation_device="cpu"), FakeTensorMode():
        with pytest.warns(UserWarning, match="CUDA is not available"):
            ctx = torch.autocast("cuda", dtype=torch.bfloat16)
        with ctx:
            assert F.linear(torch.randn(4, 8), torch.randn(16, 8)).dtype == torch.float32
        with torch.autocast("cpu", dtype=torch.bfloat16):  # CPU's own list: cross_entropy_loss is fp32 there
            y = torch.randn(4, 8, dtype=torch.bfloat16)
            assert F.cross_entropy(y, torch.zeros(4, dtype=torch.long)).dtype == torch.float32


# --------------------------------------------------------------------------- against torch's own kernels
def test_the_policy_table_names_exactly_the_ops_torch_registers_for_autocast_cuda():
    registered = {
        n.removeprefix("aten::")
        for n in torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA")
    }
    assert set(CUDA_POLICIES) == registered


def _cases(dev: str) -> list[tuple[str, Callable[[], Any]]]:
    """Calls that run on fake "cuda" of the CPU build without a device guard (no indexing), on inputs made here."""

    def t(*shape: int, dtype: torch.dtype = _F32) -> torch.Tensor:
        return torch.empty(shape, device=dev, dtype=dtype)

    # No tensor requires grad: torch's weight cache aborts the CPU build on fake "cuda" ("not linked with support
    # for cuda devices"); the cache is checked against real CPU autocast below and in the hand-derived block.
    w, b = t(16, 8), t(16)
    x, xb, xb3 = t(4, 8), t(4, 8, dtype=_BF16), t(2, 4, 8, dtype=_BF16)
    lbl = torch.zeros(4, dtype=torch.long, device=dev)
    q = t(1, 2, 4, 8)
    return [
        ("linear", lambda: F.linear(x, w, b)),
        ("linear twice", lambda: (F.linear(x, w), F.linear(xb, w))),
        ("matmul 3d", lambda: torch.matmul(xb3, t(8, 5))),
        ("bmm", lambda: torch.bmm(t(2, 4, 8), t(2, 8, 3, dtype=_BF16))),
        ("baddbmm", lambda: torch.baddbmm(t(2, 4, 3), t(2, 4, 8), t(2, 8, 3))),
        ("mm bf16 x fp32", lambda: torch.mm(xb, t(8, 3))),
        ("einsum", lambda: torch.einsum("ij,jk->ik", x, t(8, 2))),
        ("softmax", lambda: F.softmax(xb, -1)),
        ("softmax dtype", lambda: F.softmax(xb, -1, dtype=_BF16)),
        ("log_softmax", lambda: F.log_softmax(xb, -1)),
        ("layer_norm", lambda: F.layer_norm(xb, (8,), t(8), t(8))),
        ("rms_norm", lambda: F.rms_norm(xb, (8,), t(8, dtype=_BF16))),
        ("group_norm", lambda: F.group_norm(t(2, 4, 3, dtype=_BF16), 2)),
        ("cross_entropy", lambda: F.cross_entropy(xb, lbl)),
        ("cross_entropy fp32", lambda: F.cross_entropy(x, lbl)),
        ("mse_loss", lambda: F.mse_loss(xb, x)),
        ("sum", lambda: (xb.sum(), xb.sum(-1), x.sum(dtype=_BF16))),
        ("cumsum", lambda: torch.cumsum(xb, 0)),
        ("prod", lambda: torch.prod(xb)),
        ("pow exp rsqrt log", lambda: (xb.pow(2), torch.exp(xb), torch.rsqrt(xb), torch.log(xb))),
        ("norm", lambda: (torch.norm(xb), xb.norm(2, -1))),
        ("linalg_vector_norm", lambda: torch.linalg.vector_norm(xb)),
        ("logsumexp", lambda: torch.logsumexp(xb, -1)),
        ("addcmul promote", lambda: torch.addcmul(xb, xb, x)),
        ("addcmul bf16", lambda: torch.addcmul(xb, xb, xb)),
        ("dot promote", lambda: torch.dot(t(8, dtype=_BF16), t(8))),
        ("cat: CPU lists it, CUDA does not", lambda: torch.cat([xb, x])),
        ("stack: CPU lists it, CUDA does not", lambda: torch.stack([xb, xb])),
        ("fp64 untouched", lambda: F.linear(t(4, 8, dtype=torch.float64), t(3, 8, dtype=torch.float64))),
        ("conv2d", lambda: F.conv2d(t(1, 2, 5, 5), t(3, 2, 3, 3))),
        ("silu gelu unlisted", lambda: (F.silu(x), F.gelu(xb))),
        ("sdpa casts", lambda: F.scaled_dot_product_attention(q, q * 2, q * 3)),
    ]


def _record(dev: str, enter: Callable[[], Any]) -> dict[str, list]:
    out: dict[str, list] = {}
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        cases = _cases(dev)
    for name, call in cases:
        log = OpLog()
        with torch.no_grad(), enter(), mode, log:
            call()
        out[name] = log.ops
    return out


def _cuda_kernels():
    """torch's own AutocastCUDA kernels: the state set directly (the Python class refuses on a CPU-only build)."""
    import contextlib

    @contextlib.contextmanager
    def region():
        saved = autocast_state()
        torch.set_autocast_enabled("cuda", True)
        torch.set_autocast_dtype("cuda", torch.bfloat16)
        torch.autocast_increment_nesting()
        try:
            yield
        finally:
            if torch.autocast_decrement_nesting() == 0:
                torch.clear_autocast_cache()
            torch.set_autocast_enabled("cuda", saved[2])
            torch.set_autocast_dtype("cuda", saved[3])

    return region


def _casts_only(ops: list) -> list:
    """The leading casts (the kernels after them differ: SDPA picks the math path on fake "cuda" without a GPU)."""
    out = []
    for op in ops[2:]:  # after q * 2, q * 3
        if op[0] != "aten._to_copy.default":
            break
        out.append(op)
    return out


@pytest.fixture(scope="module")
def by_torch() -> dict[str, list]:
    return _record("cuda", _cuda_kernels())


@pytest.fixture(scope="module")
def simulated() -> dict[str, list]:
    with CudaAutocast("cpu"):
        return _record("cpu", lambda: torch.autocast("cuda", dtype=torch.bfloat16))


@pytest.mark.parametrize("name", [name for name, _ in _cases("meta")])
def test_each_op_casts_as_torchs_autocast_cuda_kernels_do(name, by_torch, simulated):
    if name == "sdpa casts":
        # q, k, v to bf16 (right to left); then torch's math path casts back up, the simulation's fused op does not
        assert _casts_only(simulated[name])[:3] == _casts_only(by_torch[name])[:3]
        assert [op[2] for op in _casts_only(by_torch[name])[:3]] == [torch.bfloat16] * 3
    else:
        assert simulated[name] == by_torch[name]


def test_the_oracle_sees_casts_so_the_comparison_is_not_vacuous(by_torch):
    assert [op[2] for op in by_torch["linear"]].count(torch.bfloat16) == 3
    # the bf16 input cast up, then the op (after making its weight and bias)
    assert [(op[0], op[2]) for op in by_torch["layer_norm"]][2:] == [
        ("aten._to_copy.default", torch.float32),
        ("aten.native_layer_norm.default", None),
    ]


# --------------------------------------------------------------------------- against real CPU autocast
def test_where_cpu_and_cuda_lists_agree_real_cpu_autocast_runs_the_same_ops():
    # linear and matmul are lower_precision_fp in both lists; silu is in neither. Real tensors, real kernels.
    def run(dev_autocast: str, ctx: Callable[[], Any]) -> list:
        torch.manual_seed(0)
        lin = nn.Linear(8, 16)
        m = nn.Parameter(torch.randn(16, 4))
        x = torch.randn(4, 8, requires_grad=True)
        log = OpLog()
        saved: list[tuple] = []
        with ctx(), log, _saved(saved):
            y = torch.matmul(F.silu(lin(x)), m)
            y = torch.matmul(F.silu(lin(x)), m)  # the weight cache: no second cast of lin's weight or m
        return [log.ops, sorted(saved, key=str), y.dtype]

    real_cpu = run("cpu", lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    with CudaAutocast("cpu"):
        simulated_cuda = run("cuda", lambda: torch.autocast("cuda", dtype=torch.bfloat16))
    assert simulated_cuda == real_cpu
    assert real_cpu[2] == torch.bfloat16


# --------------------------------------------------------------------------- restored on exit
def _globals() -> dict:
    from torch.amp.autocast_mode import autocast

    return {
        "init": autocast.__dict__["__init__"],
        "enter": autocast.__dict__["__enter__"],
        "exit": autocast.__dict__["__exit__"],
        "clear": torch.clear_autocast_cache,
        "rms_norm": F.rms_norm,
        "sdpa": F.scaled_dot_product_attention,
        "state": autocast_state(),
        "cpu_kernels": sorted(torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCPU")),
    }


def _cpu_autocast_works() -> tuple:
    """CPU's own C++ kernels: mm in bf16, cat promoted, cross_entropy_loss fp32 (CUDA lists none of the last two)."""
    a, b = torch.randn(4, 4), torch.randn(4, 4, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return (
            torch.mm(a, a).dtype,
            torch.cat([a, b]).dtype,
            F.cross_entropy(b, torch.zeros(4, dtype=torch.long)).dtype,
            torch.sum(b).dtype,
        )


class Boom(Exception):
    pass


def test_exit_restores_globals_the_autocast_state_and_cpus_own_kernels():
    before, cpu_before = _globals(), _cpu_autocast_works()
    assert cpu_before == (torch.bfloat16, torch.float32, torch.float32, torch.bfloat16)
    with SimulatedWorld(target_device="cuda", simulation_device="cpu"):
        assert _globals()["init"] is not before["init"]
        assert _cpu_autocast_works()[3] == torch.float32  # CUDA's sum (fp32_set_opt_dtype) replaced CPU's
    assert _globals() == before
    assert _cpu_autocast_works() == cpu_before


def test_an_exception_inside_an_autocast_region_restores_everything():
    before = _globals()
    with pytest.raises(Boom):
        with SimulatedWorld(target_device="cuda", simulation_device="cpu") as world, world.fake():
            region = torch.autocast("cuda", dtype=torch.bfloat16)
            region.__enter__()  # never exited by the body: the world restores the thread's state
            torch.autocast("cpu", dtype=torch.float16).__enter__()
            raise Boom
    assert _globals() == before
    assert _cpu_autocast_works() == (torch.bfloat16, torch.float32, torch.float32, torch.bfloat16)
    torch.autocast_decrement_nesting()  # the two regions left entered above
    torch.autocast_decrement_nesting()


def test_cpu_only_ops_are_cpus_registrations_outside_cudas_lists():
    assert {"cat", "stack", "cross_entropy_loss"} <= set(cpu_only_ops())
    assert not set(cpu_only_ops()) & set(CUDA_POLICIES)


# --------------------------------------------------------------------------- rewrites and recompute
def test_rms_norm_is_cast_to_fp32_before_the_fused_cuda_kernel():
    # aten::rms_norm is fp32 in CUDA's list: the bf16 input becomes an fp32 copy, the weight is fp32 already, so
    # the fused kernel runs (weight dtype == input dtype) and saves input, weight and rstd (T,1), all fp32.
    with SimulatedWorld(target_device="cuda", simulation_device="cpu") as world, world.fake():
        x = torch.randn(T, D, dtype=torch.bfloat16, requires_grad=True)
        weight = nn.Parameter(torch.ones(D))
        saved: list[tuple] = []
        log = OpLog()
        with _saved(saved), torch.autocast("cuda", dtype=torch.bfloat16), log:
            y = F.rms_norm(x, (D,), weight, 1e-6)
    assert y.dtype == torch.float32
    assert sorted(saved, key=str) == sorted([((T, D), _F32), ((D,), _F32), ((T, 1), _F32)], key=str)
    assert [op[0] for op in log.ops] == ["aten._to_copy.default", "aten._fused_rms_norm.default"]


def test_a_checkpoints_recompute_casts_as_its_forward_did():
    # torch.utils.checkpoint restores the autocast state of the inputs' device ("cpu" here) when it recomputes in
    # backward, outside the region; the recomputed tensors must match the forward's (checkpoint checks metadata).
    from torch.utils.checkpoint import checkpoint

    with SimulatedWorld(target_device="cuda", simulation_device="cpu") as world, world.fake():
        lin = nn.Linear(D, H)
        x = torch.randn(T, D, requires_grad=True)
        recomputed: list[torch.dtype] = []

        def part(x: torch.Tensor) -> torch.Tensor:
            h = lin(x)
            recomputed.append(h.dtype)
            return F.silu(h)

        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = checkpoint(part, x, use_reentrant=False)
        y.float().sum().backward()
    assert recomputed == [torch.bfloat16, torch.bfloat16]
    assert lin.weight.grad.dtype == torch.float32
