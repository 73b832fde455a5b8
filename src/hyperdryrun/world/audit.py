"""Kernel audit: the aten ops, new storages and saved-for-backward tensors of common layers on fake tensors.

The same catalogue runs on the simulation device (fake "cpu" with the target-kernel patches of
:mod:`hyperdryrun.world.kernels`) and, on a CUDA build of torch, on fake "cuda" to record the reference::

    python -m hyperdryrun.world.audit --record tests/world/fixtures/cuda_kernels.json   # CUDA build, no GPU needed
    python -m hyperdryrun.world.audit --compare tests/world/fixtures/cuda_kernels.json  # any build

torch 2.13's autograd engine cannot run a backward on fake "cuda" tensors without a GPU
(``GraphTask::stash_current_streams`` calls ``hasPrimaryContext(0)``, which raises when no device exists), so the
reference runs the backward by calling every autograd node directly in the engine's order (:func:`walk_backward`);
on the simulation device the real engine runs, and the tests check that both give the same ops and bytes.
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._prims_common import is_non_overlapping_and_dense_or_false as is_non_overlapping_and_dense
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from hyperdryrun.trace.blocks import ALIGNMENT, round_size
from hyperdryrun.trace.tracker import METADATA_OPS, iter_tensors

SCHEMA_VERSION = 1

Event = tuple[str, list[int]]
"""One dispatched op: its name and the bytes of each new output storage (empty when it allocates nothing)."""


# ---------------------------------------------------------------------------------------------- recording
class OpRecorder(TorchDispatchMode):
    """Records every outermost aten op with the bytes of the new storages it returns (the tracker's rule:
    outputs on an input's storage, views and metadata queries are no allocation)."""

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type
        self.events: dict[str, list[Event]] = {}
        self.phase = "forward"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in METADATA_OPS or getattr(func, "is_view", False):
            return out
        inputs = {id(t.untyped_storage()) for t in iter_tensors(args)}
        inputs.update(id(t.untyped_storage()) for t in iter_tensors(kwargs))
        new: list[int] = []
        seen: set[int] = set()
        for t in iter_tensors(out):
            if not isinstance(t, FakeTensor) or t.device.type != self.device_type:
                continue  # host tensors of a CUDA step (e.g. a CPU scalar) are no device memory
            st = t.untyped_storage()
            key = id(st)
            if key in inputs or key in seen or st.nbytes() == 0:
                continue
            seen.add(key)
            new.append(int(st.nbytes()))
        name = str(func.overloadpacket.__name__) if hasattr(func, "overloadpacket") else str(func)
        self.events.setdefault(self.phase, []).append((name, new))
        return out


@contextmanager
def saved_tensors(into: list[list[Any]]) -> Iterator[None]:
    """Record (shape, dtype, storage bytes) of every tensor autograd saves for backward."""

    def pack(t: torch.Tensor) -> torch.Tensor:
        into.append([list(t.shape), str(t.dtype).removeprefix("torch."), int(t.untyped_storage().nbytes())])
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


def walk_backward(output: torch.Tensor, grad: torch.Tensor) -> None:
    """Backward of ``output`` without the autograd engine: every node is called directly, ready nodes in the
    engine's order (highest sequence number first, AccumulateGrad before all), gradients for one input summed
    out of place (the engine's InputBuffer does so for tensor subclasses such as FakeTensor), each gradient
    reduced and cast to its consumer's input metadata as the engine's ``validate_outputs`` does, and leaf gradients
    stored as the engine's AccumulateGrad does (the incoming tensor is stolen if it has the leaf's strides, else copied into
    that layout; an existing grad is added in place).
    """
    root = output.grad_fn
    if root is None:
        return
    deps: Counter = Counter()
    seen = {root}
    stack = [root]
    while stack:
        node = stack.pop()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            deps[nxt] += 1
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    buffers: dict[Any, list[torch.Tensor | None]] = {}

    def add(node: Any, idx: int, g: torch.Tensor | None) -> None:
        buf = buffers.setdefault(node, [None] * max(1, len(node._input_metadata)))
        if g is None:
            return
        buf[idx] = g if buf[idx] is None else buf[idx] + g

    add(root, output.output_nr, grad)
    counter = 0
    ready = [(-root._sequence_nr(), counter, root)]
    with torch.no_grad():
        while ready:
            _, _, node = heapq.heappop(ready)
            inputs = buffers.pop(node, [None])
            if type(node).__name__ == "AccumulateGrad":
                var, g = node.variable, inputs[0]
                if g is not None:
                    if var.grad is None:
                        var.grad = g if _obeys_layout_contract(g, var) else _clone_obey_contract(g, var)
                    else:
                        var.grad.add_(g)
                continue
            # C++ nodes are callable; a custom autograd.Function's node runs through .apply
            outs = node(*inputs) if callable(node) else node.apply(*inputs)
            if not isinstance(outs, tuple):
                outs = (outs,)
            del inputs
            for (nxt, idx), g in zip(node.next_functions, outs):
                if nxt is None:
                    continue
                if g is not None:
                    # the engine's validate_outputs: reduce a broadcast gradient, cast to the input's dtype
                    meta = nxt._input_metadata[idx]
                    if tuple(g.shape) != tuple(meta.shape):
                        g = g.sum_to_size(meta.shape)
                    if g.dtype != meta.dtype:
                        g = g.to(meta.dtype)
                add(nxt, idx, g)
                deps[nxt] -= 1
                if deps[nxt] == 0:
                    counter += 1
                    heapq.heappush(ready, (-nxt._sequence_nr(), counter, nxt))


def _obeys_layout_contract(grad: torch.Tensor, var: torch.Tensor) -> bool:
    """torch/csrc/autograd/utils/grad_layout_contract.h: a stolen grad must have the variable's strides."""
    if not is_non_overlapping_and_dense(var):
        return grad.is_contiguous()
    for size, gs, vs in zip(grad.shape, grad.stride(), var.stride()):
        if (size != 1 and gs != vs) or (size == 1 and gs == 0):
            return False
    return True


def _clone_obey_contract(grad: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    if is_non_overlapping_and_dense(var):
        return grad.new_empty_strided(var.shape, var.stride()).copy_(grad)
    return grad.clone(memory_format=torch.contiguous_format)


# ---------------------------------------------------------------------------------------------- catalogue
@dataclass
class Case:
    """What one layer runs: ``forward()`` returns the output to differentiate, or ``step()`` runs on its own."""

    forward: Callable[[], torch.Tensor] | None = None
    step: Callable[[], None] | None = None
    keep: list[Any] = field(default_factory=list)


Builder = Callable[[torch.device], Case]
LAYERS: dict[str, Builder] = {}


def layer(name: str) -> Callable[[Builder], Builder]:
    def register(fn: Builder) -> Builder:
        LAYERS[name] = fn
        return fn

    return register


def _module(factory: Callable[[], nn.Module], device: torch.device, dtype: torch.dtype) -> nn.Module:
    """Build on meta outside the fake mode and materialise on the (fake) device, as the engine does."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), torch.device("meta"):
        mod = factory().to(dtype)
    return mod.to_empty(device=device)


def _x(device: torch.device, *shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(*shape, device=device, dtype=dtype).requires_grad_()


B, S, D = 2, 48, 64


def _unary(fn: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype) -> Builder:
    def build(device: torch.device) -> Case:
        x = _x(device, B, S, D, dtype=dtype)
        return Case(forward=lambda: fn(x), keep=[x])

    return build


def _linear(bias: bool, dtype: torch.dtype) -> Builder:
    def build(device: torch.device) -> Case:
        mod = _module(lambda: nn.Linear(D, 96, bias=bias), device, dtype)
        x = _x(device, B, S, D, dtype=dtype)
        return Case(forward=lambda: mod(x), keep=[mod, x])

    return build


layer("linear_bias_fp32")(_linear(True, torch.float32))
layer("linear_bias_bf16")(_linear(True, torch.bfloat16))
layer("linear_nobias_bf16")(_linear(False, torch.bfloat16))


@layer("embedding_fp32")
def _embedding(device: torch.device) -> Case:
    mod = _module(lambda: nn.Embedding(256, D), device, torch.float32)
    idx = torch.randint(0, 256, (B, S), device=device)
    return Case(forward=lambda: mod(idx), keep=[mod, idx])


def _llama_rmsnorm(dtype: torch.dtype) -> Builder:
    def build(device: torch.device) -> Case:
        from hyperdryrun.models.llama import RMSNorm

        mod = _module(lambda: RMSNorm(D, 1e-5), device, dtype)
        x = _x(device, B, S, D, dtype=dtype)
        return Case(forward=lambda: mod(x), keep=[mod, x])

    return build


layer("rmsnorm_plain_bf16")(_llama_rmsnorm(torch.bfloat16))


def _f_rms_norm(dtype: torch.dtype) -> Builder:
    def build(device: torch.device) -> Case:
        w = torch.ones(D, device=device, dtype=dtype).requires_grad_()
        x = _x(device, B, S, D, dtype=dtype)
        return Case(forward=lambda: F.rms_norm(x, (D,), w, 1e-5), keep=[w, x])

    return build


layer("rms_norm_functional_fp32")(_f_rms_norm(torch.float32))
layer("rms_norm_functional_bf16")(_f_rms_norm(torch.bfloat16))


def _layernorm(dtype: torch.dtype) -> Builder:
    def build(device: torch.device) -> Case:
        mod = _module(lambda: nn.LayerNorm(D), device, dtype)
        x = _x(device, B, S, D, dtype=dtype)
        return Case(forward=lambda: mod(x), keep=[mod, x])

    return build


layer("layernorm_fp32")(_layernorm(torch.float32))
layer("layernorm_bf16")(_layernorm(torch.bfloat16))


def _norm2d(factory: Callable[[], nn.Module], dtype: torch.dtype, train: bool = True) -> Builder:
    def build(device: torch.device) -> Case:
        mod = _module(factory, device, dtype).train(train)
        for name, buf in list(mod.named_buffers()):  # to_empty leaves running statistics uninitialised
            setattr(mod, name, torch.zeros_like(buf))
        x = _x(device, B, 32, 8, 8, dtype=dtype)
        return Case(forward=lambda: mod(x), keep=[mod, x])

    return build


layer("batchnorm_train_fp32")(_norm2d(lambda: nn.BatchNorm2d(32), torch.float32))
layer("batchnorm_eval_fp32")(_norm2d(lambda: nn.BatchNorm2d(32), torch.float32, train=False))
layer("groupnorm_fp32")(_norm2d(lambda: nn.GroupNorm(4, 32), torch.float32))
layer("groupnorm_bf16")(_norm2d(lambda: nn.GroupNorm(4, 32), torch.bfloat16))
layer("silu_bf16")(_unary(F.silu, torch.bfloat16))
layer("gelu_bf16")(_unary(F.gelu, torch.bfloat16))
layer("gelu_tanh_bf16")(_unary(lambda x: F.gelu(x, approximate="tanh"), torch.bfloat16))
layer("softmax_fp32")(_unary(lambda x: F.softmax(x, -1), torch.float32))
layer("softmax_bf16")(_unary(lambda x: F.softmax(x, -1), torch.bfloat16))
layer("softmax_fp16_to_fp32")(_unary(lambda x: F.softmax(x, -1, dtype=torch.float32), torch.float16))
layer("softmax_bf16_to_fp32")(_unary(lambda x: F.softmax(x, -1, dtype=torch.float32), torch.bfloat16))
layer("log_softmax_fp32")(_unary(lambda x: F.log_softmax(x, -1), torch.float32))
layer("log_softmax_fp16_to_fp32")(_unary(lambda x: F.log_softmax(x, -1, dtype=torch.float32), torch.float16))
layer("logsigmoid_fp32")(_unary(F.logsigmoid, torch.float32))
layer("dropout_bf16")(_unary(lambda x: F.dropout(x, 0.1, training=True), torch.bfloat16))
layer("dropout_fp32")(_unary(lambda x: F.dropout(x, 0.25, training=True), torch.float32))


def _cross_entropy(dtype: torch.dtype, upcast: bool) -> Builder:
    def build(device: torch.device) -> Case:
        vocab = 256
        logits = _x(device, B * S, vocab, dtype=dtype)
        labels = torch.randint(0, vocab, (B * S,), device=device)

        def fwd() -> torch.Tensor:
            return F.cross_entropy(logits.float() if upcast else logits, labels)

        return Case(forward=fwd, keep=[logits, labels])

    return build


layer("cross_entropy_fp32")(_cross_entropy(torch.float32, False))
layer("cross_entropy_bf16")(_cross_entropy(torch.bfloat16, False))
layer("cross_entropy_bf16_upcast")(_cross_entropy(torch.bfloat16, True))


def _sdpa(
    heads: int = 8,
    kv_heads: int | None = None,
    head_dim: int = 64,
    dtype: torch.dtype = torch.bfloat16,
    mask: bool = False,
    causal: bool = True,
    dropout: float = 0.0,
) -> Builder:
    def build(device: torch.device) -> Case:
        kvh = kv_heads or heads
        q = _x(device, B, heads, S, head_dim, dtype=dtype)
        k = _x(device, B, kvh, S, head_dim, dtype=dtype)
        v = _x(device, B, kvh, S, head_dim, dtype=dtype)
        m = torch.ones(S, S, device=device, dtype=torch.bool).tril() if mask else None

        def fwd() -> torch.Tensor:
            return F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=m,
                dropout_p=dropout,
                is_causal=causal and not mask,
                enable_gqa=kvh != heads,
            )

        return Case(forward=fwd, keep=[q, k, v, m])

    return build


layer("sdpa_causal_bf16_mha")(_sdpa())
layer("sdpa_causal_bf16_gqa")(_sdpa(kv_heads=2))
layer("sdpa_causal_fp32_mha")(_sdpa(dtype=torch.float32))
layer("sdpa_causal_fp32_gqa")(_sdpa(kv_heads=2, dtype=torch.float32))
layer("sdpa_bool_mask_bf16")(_sdpa(mask=True))
layer("sdpa_bool_mask_fp32")(_sdpa(mask=True, dtype=torch.float32))
layer("sdpa_causal_bf16_hd256")(_sdpa(heads=2, head_dim=256))
layer("sdpa_causal_bf16_hd320")(_sdpa(heads=2, head_dim=320))
layer("sdpa_causal_bf16_hd100")(_sdpa(heads=2, head_dim=100))
layer("sdpa_causal_bf16_dropout")(_sdpa(dropout=0.125))


@layer("llama_block_bf16")
def _llama_block(device: torch.device) -> Case:
    from hyperdryrun.models.llama import PRESETS, TransformerBlock, rope_cache

    args = PRESETS["llama-tiny"]
    mod = _module(lambda: TransformerBlock(args), device, torch.bfloat16)
    rope = rope_cache(args.head_dim, S, args.rope_theta).to(device)
    x = _x(device, B, S, args.dim)
    return Case(forward=lambda: mod(x, rope), keep=[mod, rope, x])


def _optimizer(factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer]) -> Builder:
    def build(device: torch.device) -> Case:
        params = [nn.Parameter(torch.empty(n, device=device)) for n in (D * 96, 96, 1000)]
        for p in params:
            p.grad = torch.zeros_like(p)
        opt = factory(params)
        opt.step()  # steady state: states exist, as from step 2 onwards
        return Case(step=opt.step, keep=[params, opt])

    return build


layer("adamw_foreach")(_optimizer(lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True)))
layer("adamw_fused")(_optimizer(lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True)))
layer("adamw_default")(_optimizer(lambda ps: torch.optim.AdamW(ps, lr=1e-3)))
layer("adam_foreach")(_optimizer(lambda ps: torch.optim.Adam(ps, lr=1e-3, foreach=True)))
layer("sgd_foreach")(_optimizer(lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, foreach=True)))
layer("sgd_fused")(_optimizer(lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, fused=True)))
layer("sgd_default")(_optimizer(lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9)))


# ---------------------------------------------------------------------------------------------- running
def run_layer(name: str, device: str, backward: str = "engine") -> dict[str, Any]:
    """Record one layer on fake ``device`` (inside a fake mode the caller entered): ops, allocations, saves."""
    torch.manual_seed(0)
    case = LAYERS[name](torch.device(device))
    rec = OpRecorder(torch.device(device).type)
    saved: list[list[Any]] = []
    if case.step is not None:
        rec.phase = "step"
        with rec:
            case.step()
    else:
        assert case.forward is not None
        with rec, saved_tensors(saved):
            out = case.forward()
        grad = torch.ones_like(out)
        rec.phase = "backward"
        with rec:
            if backward == "walk":
                walk_backward(out, grad)
            else:
                out.backward(grad)
        del out, grad
    result: dict[str, Any] = {"saved": saved}
    for phase, events in rec.events.items():
        result[phase] = [[op, sizes] for op, sizes in events]
    return result


@contextmanager
def simulation(device: str) -> Iterator[None]:
    """The fake world the audit runs in: the project's SimulatedWorld for fake "cpu"; a plain fake mode plus
    the same target-kernel patches on fake "cuda" (a CUDA build; the device mesh needs no GPU-free process group)."""
    from hyperdryrun.world import SimulatedWorld
    from hyperdryrun.world.kernels import target_kernel_patches
    from hyperdryrun.world.patches import PatchSet

    with ExitStack() as stack:
        if device == "cpu":
            world = stack.enter_context(
                SimulatedWorld(world_size=1, target_device="cuda", simulation_device="cpu")
            )
            stack.enter_context(world.fake())
        else:
            stack.enter_context(PatchSet(target_kernel_patches("cuda", device)))
            stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        yield


def record(device: str, backward: str, names: list[str] | None = None) -> dict[str, Any]:
    """Run the catalogue (or ``names``) on fake ``device``; the result is what the reference fixture holds."""
    from hyperdryrun.world.kernels import DEFAULT_CUDA_TARGET, target_kernel_patches

    layers: dict[str, Any] = {}
    for name in names or list(LAYERS):
        try:
            with simulation(device):
                layers[name] = run_layer(name, device, backward)
        except Exception as err:  # a layer fake tensors cannot run here is recorded as such, not skipped
            layers[name] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0]}"}
    return {
        "schema_version": SCHEMA_VERSION,
        "torch_version": torch.__version__,
        "cuda_build": torch.version.cuda,
        "device": device,
        "backward": backward,
        "cuda_target": DEFAULT_CUDA_TARGET.as_dict(),
        # what this record did not observe but took from hyperdryrun.world.kernels (on fake "cuda" without a GPU:
        # the SDPA backend choice and the optimizer default); every other op ran as the device's own code
        "modelled": [f"{p.name}: {p.reason}" for p in target_kernel_patches("cuda", device)],
        "layers": layers,
    }


# ---------------------------------------------------------------------------------------------- comparing
def summary(rec: dict[str, Any], alignment: int = ALIGNMENT) -> dict[str, int]:
    """Byte totals of one layer record: new storages per phase (raw and rounded) and saved tensors."""
    out = {}
    for phase in ("forward", "backward", "step"):
        sizes = [s for _, new in rec.get(phase, []) for s in new]
        out[f"{phase}_bytes"] = sum(sizes)
        out[f"{phase}_blocks"] = sum(round_size(s, alignment) for s in sizes)
    out["saved_bytes"] = sum(b for _, _, b in rec.get("saved", []))
    return out


def _alloc_multiset(events: list) -> Counter:
    return Counter((op, tuple(new)) for op, new in events if new)


def diff_layer(reference: dict[str, Any], simulated: dict[str, Any]) -> list[str]:
    """Human-readable differences between two records of one layer (empty when they agree)."""
    if "error" in reference or "error" in simulated:
        return [f"not recorded: reference {reference.get('error')!r}, simulated {simulated.get('error')!r}"]
    problems = []
    ref_sum, sim_sum = summary(reference), summary(simulated)
    for key in ref_sum:
        if ref_sum[key] != sim_sum[key]:
            problems.append(f"{key}: reference {ref_sum[key]}, simulated {sim_sum[key]}")
    for phase in ("forward", "backward", "step"):
        ref_ops = Counter(op for op, _ in reference.get(phase, []))
        sim_ops = Counter(op for op, _ in simulated.get(phase, []))
        if ref_ops != sim_ops:
            problems.append(
                f"{phase} ops: only in reference {sorted((ref_ops - sim_ops).elements())}, "
                f"only simulated {sorted((sim_ops - ref_ops).elements())}"
            )
        ref, sim = _alloc_multiset(reference.get(phase, [])), _alloc_multiset(simulated.get(phase, []))
        if ref != sim:
            only_ref, only_sim = ref - sim, sim - ref
            problems.append(
                f"{phase} allocations: only in reference {sorted(only_ref.elements())}, "
                f"only simulated {sorted(only_sim.elements())}"
            )
    ref_saved = Counter(json.dumps(s) for s in reference.get("saved", []))
    sim_saved = Counter(json.dumps(s) for s in simulated.get("saved", []))
    if ref_saved != sim_saved:
        problems.append(
            f"saved: only in reference {sorted((ref_saved - sim_saved).elements())}, "
            f"only simulated {sorted((sim_saved - ref_saved).elements())}"
        )
    return problems


def compare(reference: dict[str, Any], names: list[str] | None = None) -> dict[str, list[str] | None]:
    """Run the catalogue on the simulation device and diff it against ``reference``: layer -> differences, or
    None for a layer the reference could not record (its ``error`` says why)."""
    from hyperdryrun.world import default_simulation_device

    device = default_simulation_device()
    names = names or [n for n in reference["layers"] if n in LAYERS]
    unknown = [n for n in names if n not in reference["layers"] or n not in LAYERS]
    if unknown:
        raise ValueError(f"layers not in both the reference and the catalogue: {', '.join(unknown)}")
    simulated = record(device, "engine", names)["layers"]
    return {
        name: None
        if "error" in reference["layers"][name]
        else diff_layer(reference["layers"][name], simulated[name])
        for name in names
    }


def load_reference(path: str) -> dict[str, Any]:
    with open(path) as fh:
        data = json.load(fh)
    if data.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(f"{path}: schema_version={data.get('schema_version')!r}, expected {SCHEMA_VERSION}")
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hyperdryrun.world.audit", description=__doc__.split("\n")[0]
    )
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument(
        "--record", metavar="FILE", help="record the reference on fake 'cuda' (CUDA build of torch)"
    )
    group.add_argument("--compare", metavar="FILE", help="compare the simulation device against a reference")
    parser.add_argument("--layers", nargs="*", help="only these layers")
    args = parser.parse_args(argv)
    if args.record:
        if not torch.backends.cuda.is_built():
            sys.stderr.write(
                "hyperdryrun: error: --record needs a CUDA build of torch (fake 'cuda' tensors)\n"
            )
            return 2
        from hyperdryrun.report.writer import atomic_write

        data = record("cuda", "walk", args.layers)
        atomic_write(Path(args.record), json.dumps(data, indent=1, sort_keys=True) + "\n")
        print(f"recorded {len(data['layers'])} layers to {args.record}")
        return 0
    reference = load_reference(args.compare)
    result = compare(reference, args.layers)
    for name, problems in result.items():
        if problems is None:
            print(f"skip {name}: reference not recorded ({reference['layers'][name]['error']})")
            continue
        print(f"{'DIFF' if problems else 'ok  '} {name}")
        for p in problems:
            print(f"     {p}")
    return 1 if any(result.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = [
    "LAYERS",
    "OpRecorder",
    "compare",
    "diff_layer",
    "record",
    "run_layer",
    "summary",
    "walk_backward",
]
