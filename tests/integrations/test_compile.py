"""torch.compile in a simulated world: Inductor regions are compiled by torch (dynamo, AOTAutograd, Inductor's
partitioner) and their graphs executed on the fake tensors, so what they save for backward is what a real compiled
run saves; regions with another backend run eagerly and are named; no compiled kernel runs on fake data; every
global this touches is restored (also after an exception)."""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch
import torch._dynamo.eval_frame as eval_frame
import torch._dynamo.pgo as pgo
import torch._functorch.config as functorch_config
import torch._inductor.compile_fx as compile_fx_module
import torch._inductor.config as inductor_config
import torch._inductor.lowering as inductor_lowering
import torch.nn.attention.flex_attention as flex_module
from torch import nn
from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._ops import _higher_order_ops
from torch._subclasses.fake_tensor import FakeTensorMode

import hyperdryrun
from hyperdryrun.world import SimulatedWorld

DIM = 64
BACKEND_CALLS: list[str] = []


def recording_backend(gm, example_inputs):
    """A compiler backend that would run the graph: in a dry run it must never be reached."""
    BACKEND_CALLS.append(str(gm))
    return gm.forward


def mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ w1) @ w2


compiled_mlp = torch.compile(mlp, backend=recording_backend)


def chain(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ w1).sin().cos() @ w2


inductor_chain = torch.compile(chain)


class Model(nn.Module):
    def __init__(self, compiled: bool, fn=None) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(DIM, 4 * DIM))
        self.w2 = nn.Parameter(torch.empty(4 * DIM, DIM))
        self.fn = fn if fn is not None else compiled_mlp if compiled else mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x, self.w1, self.w2)


def simulate(model_fn, loss_fn=lambda model, x: model(x).sum(), **kwargs):
    return hyperdryrun.simulate(
        model_fn,
        lambda i, device: torch.randn(8, DIM, device=device),
        loss_fn=loss_fn,
        capture_stacks=False,
        **kwargs,
    )


def real_saved_bytes(fn) -> int:
    """Bytes of the distinct storages a real CPU step of ``fn`` saves for backward (its inputs left out), seen by
    autograd's pack hook: eager autograd's saved tensors, or a compiled region's (AOTAutograd saves the
    partitioner's forward outputs with ``ctx.save_for_backward``)."""
    torch.manual_seed(0)
    x, w1, w2 = torch.randn(8, DIM), torch.randn(DIM, 4 * DIM, requires_grad=True), torch.randn(4 * DIM, DIM)
    w2.requires_grad_(True)
    inputs = {t.untyped_storage().data_ptr() for t in (x, w1, w2)}
    saved: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in inputs:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x, w1, w2).sum().backward()
    return sum(saved.values())


def test_inductor_region_saves_for_backward_what_a_real_compiled_step_saves():
    """relu(x @ w1).sin().cos() @ w2 on 8 x 256 fp32 intermediates (8,192 B each): eager autograd saves relu's,
    sin's and cos's outputs (3 x 8,192 B); Inductor's min-cut partitioner saves the matmul's output and cos's and
    recomputes relu and sin in the backward (2 x 8,192 B). The dry run's line carries both, and a real CPU
    Inductor step (gcc) saves exactly the compiled figure."""
    trace = simulate(lambda: Model(False, inductor_chain), target_device="cpu")
    (line,) = [x for x in trace.limitations if x.startswith(f"torch.compile region {__name__}.chain")]
    assert "1 training graph(s)" in line
    assert "(16384 B; 24576 B with no recomputation)" in line
    assert "recomputed in backward: aten.relu x1, aten.sin x1" in line
    assert not any("ran eagerly" in x for x in trace.limitations)
    assert real_saved_bytes(chain) == 3 * 8 * 4 * DIM * 4
    # Inductor's C++ loader sets _TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR in the environment: put back
    with mock.patch.dict(os.environ):
        torch._dynamo.reset()
        try:
            assert real_saved_bytes(torch.compile(chain)) == 2 * 8 * 4 * DIM * 4
        finally:
            torch._dynamo.reset()
    # the eager model's dry run holds relu, sin and cos to the backward; the compiled one mm and cos
    eager = simulate(lambda: Model(False), target_device="cpu")
    assert trace.peak <= eager.peak


def test_region_with_another_backend_runs_eagerly_with_the_eager_bytes_and_a_limitation():
    BACKEND_CALLS.clear()
    eager, compiled = simulate(lambda: Model(False)), simulate(lambda: Model(True))
    assert BACKEND_CALLS == []  # the backend (Inductor's place) never saw the fake tensors
    assert [(b.op, b.size, b.start, b.end) for b in compiled.blocks] == [
        (b.op, b.size, b.start, b.end) for b in eager.blocks
    ]
    assert compiled.peak == eager.peak
    (line,) = [x for x in compiled.limitations if x.startswith("torch.compile regions with a backend other")]
    assert f"{__name__}.mlp" in line
    assert not any(x.startswith("torch.compile regions") for x in eager.limitations)
    compiled_mlp(torch.randn(2, DIM), torch.randn(DIM, 4 * DIM), torch.randn(4 * DIM, DIM))
    assert BACKEND_CALLS  # control: outside a dry run the same call reaches the backend


def test_compiled_module_is_named_by_its_class():
    def model_fn():
        model = Model(False)
        model.compile(backend=recording_backend, fullgraph=True)
        return model

    BACKEND_CALLS.clear()
    trace = simulate(model_fn)
    assert BACKEND_CALLS == []
    assert any("Model module" in x for x in trace.limitations)


def test_cuda_graphs_are_refused_in_one_line_for_a_cuda_target():
    with pytest.raises(hyperdryrun.SimulationError, match="asks for CUDA graphs") as err:
        simulate(lambda: Model(False, torch.compile(chain, mode="reduce-overhead")), target_device="cuda")
    assert "\n" not in str(err.value)


def _globals() -> dict:
    return {
        "stance": eval_frame._stance,
        "callback_from_stance": eval_frame._callback_from_stance,
        "compile_fx": (compile_fx_module.compile_fx, compile_fx_module.min_cut_rematerialization_partition),
        "configs": (functorch_config.save_config(), inductor_config.save_config()),
        "cache_entries": len(_debug_get_cache_entry_list(chain.__code__)),
        "code_state": (pgo._CODE_STATE, pgo._INIT_CODE_STATE),
        "flex": {
            name: getattr(flex_module, name)
            for name in (
                "flex_attention_hop",
                "create_mask",
                "_convert_mask_to_block_mask",
                "_create_sparse_block_from_block_mask",
                "_validate_device",
                "_warn_once",
            )
        },
        "hop_rules": {name: dict(hop.python_key_table) for name, hop in _higher_order_ops.items()},
        "flex_lowerings": [
            inductor_lowering.lowerings.get(hop)
            for hop in (torch.ops.higher_order.flex_attention, torch.ops.higher_order.flex_attention_backward)
        ],
        "flex_library": torch._C._dispatch_has_kernel("hyperdryrun_flex::flex_attention"),
    }


def test_world_gives_hops_the_fake_mode_rule_and_takes_it_back():
    from torch._higher_order_ops.flex_attention import flex_attention

    before = _globals()
    with SimulatedWorld(world_size=2, rank=1) as world:
        mode_class = type(world.fake_mode)
        assert mode_class is not FakeTensorMode
        assert flex_attention.python_key_table[mode_class] is flex_attention.python_key_table[FakeTensorMode]
        assert eval_frame._stance.stance == "force_eager"
    assert _globals() == before


@pytest.mark.parametrize("fails", [False, True])
def test_simulation_restores_the_compiler_and_flex_globals(fails):
    before = _globals()

    def loss_fn(model, x):
        if fails:
            raise RuntimeError("boom")
        return model(x).sum()

    def model_fn():
        return Model(False, inductor_chain)

    if fails:
        with pytest.raises(hyperdryrun.SimulationError, match="boom"):
            simulate(model_fn, loss_fn)
    else:
        trace = simulate(model_fn, loss_fn)
        assert any(x.startswith(f"torch.compile region {__name__}.chain") for x in trace.limitations)
    assert _globals() == before
    assert before["cache_entries"] == 0  # dynamo's cache of the compiled code is as before the dry run


def test_a_second_simulation_compiles_its_own_shapes_not_symbolic_ones():
    """dynamo recompiles a frame seen with other sizes with those sizes symbolic (automatic dynamic shapes); a
    dry run at batch 16 after one at batch 8 traces the graph a fresh process would: static shapes, saving the
    matmul's output and cos's, 2 x 16 x 256 fp32 (see the test above for the partition)."""
    graphs: list[torch.fx.GraphModule] = []
    original = compile_fx_module.compile_fx

    def compile_fx(gm, example_inputs, *args, **kwargs):
        graphs.append(gm)
        return original(gm, example_inputs, *args, **kwargs)

    def run(batch):
        return hyperdryrun.simulate(
            lambda: Model(False, inductor_chain),
            lambda i, device: torch.randn(batch, DIM, device=device),
            loss_fn=lambda model, x: model(x).sum(),
            capture_stacks=False,
            target_device="cpu",
        )

    with mock.patch.object(compile_fx_module, "compile_fx", compile_fx):
        run(8)
        trace = run(16)
    symbolic = [
        n for gm in graphs for n in gm.graph.nodes if isinstance(n.meta.get("example_value"), torch.SymInt)
    ]
    assert len(graphs) == 2 and not symbolic
    (line,) = [x for x in trace.limitations if x.startswith(f"torch.compile region {__name__}.chain")]
    assert f"({2 * 16 * 4 * DIM * 4} B; {3 * 16 * 4 * DIM * 4} B with no recomputation)" in line


def broken_chain(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    torch._dynamo.graph_break()  # fullgraph=True: dynamo refuses the region
    return chain(x, w1, w2)


def test_a_region_dynamo_cannot_compile_runs_eagerly_and_is_named():
    fn = torch.compile(broken_chain, fullgraph=True)
    eager = simulate(lambda: Model(False, chain), target_device="cpu")
    trace = simulate(lambda: Model(False, fn), target_device="cpu")
    (line,) = [x for x in trace.limitations if "could not be compiled on the fake tensors" in x]
    assert f"{__name__}.broken_chain" in line and "broken_chain (Unsupported" in line
    assert trace.peak == eager.peak  # the eager bytes: nothing of it was compiled


def test_the_console_summary_shows_each_compiled_regions_line():
    from rich.console import Console

    from hyperdryrun.report.console import print_summary

    report = hyperdryrun.build_report(simulate(lambda: Model(False, inductor_chain), target_device="cpu"))
    console = Console(record=True, width=100)
    print_summary(report, [], console=console)
    text = " ".join(console.export_text().split())
    assert f"torch.compile region {__name__}.chain: compiled by torch" in text
    assert (
        "(16384 B; 24576 B with no recomputation); recomputed in backward: aten.relu x1, aten.sin x1" in text
    )


B, H, S, HD = 2, 4, 128, 16  # bf16 causal attention, head_dim 16: cuDNN's on the default sm90 target


def attention(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    q, k, v = (x @ w).view(B, S, 3, H, HD).permute(2, 0, 3, 1, 4).unbind(0)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


class AttentionBlock(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(H * HD, 3 * H * HD, dtype=torch.bfloat16))
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x, self.w)


def test_compiled_attention_on_a_cuda_target_compiles_whole_with_the_cuda_backend():
    """The dry run's CUDA SDPA choice inside a compiled region: dynamo cannot trace the choice (a builtin it skips),
    so every compiled attention block ran eagerly on a CUDA target; the choice is now a constant of the graph and
    the graph calls the fused op CUDA's composite would (cuDNN first on sm90 for bf16, as eagerly)."""

    def run(fn):
        return hyperdryrun.simulate(
            lambda: AttentionBlock(fn),
            lambda i, device: torch.randn(B, S, H * HD, device=device, dtype=torch.bfloat16),
            loss_fn=lambda model, x: model(x).float().sum(),
            capture_stacks=False,
        )

    eager, compiled = run(attention), run(torch.compile(attention))
    text = "\n".join(compiled.limitations)
    assert "compiled by torch" in text and "ran eagerly" not in text
    forward = []
    for trace in (eager, compiled):
        ops = {b.op for b in trace.blocks}
        assert (
            "_scaled_dot_product_cudnn_attention" in ops
            and "_scaled_dot_product_cudnn_attention_backward" in ops
        )
        forward.append(sorted(b.size for b in trace.blocks if b.op == "_scaled_dot_product_cudnn_attention"))
    # cuDNN's forward, as the eager kernel model (audited against torch's CUDA build) has it: the output (B, H, S,
    # HD) bf16, one fp32 logsumexp per row (B, H, S, 1) and the philox seed and offset (one 512 B block each)
    assert forward[0] == forward[1] == sorted([B * H * S * HD * 2, B * H * S * 4, 512, 512])


@pytest.mark.parametrize("model", ["llama-tiny", "hf:qwen2.5-7b"])
def test_run_compile_compiles_every_decoder_block_of_the_preset_or_hf_model(model, tmp_path, capsys):
    """``run --compile``: each decoder block compiled as torchtitan's apply_compile does, for the built-in preset
    (``model.layers``) and an HF model (``model.model.layers``, which raised AttributeError before), none eager."""
    from hyperdryrun.cli import main

    argv = [
        "run",
        "--model",
        model,
        "--n-layers",
        "2",
        "--seq-len",
        "128",
        "--world-size",
        "2",
        "--dp-shard",
        "2",
    ]
    assert main([*argv, "--compile", "--no-stacks", "--output-dir", str(tmp_path)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    block = "DecoderLayer" if model.startswith("hf:") else "TransformerBlock"
    assert out.count("torch.compile region") == 1 and f"{block} module: compiled by torch" in out
    assert "ran eagerly" not in out


def test_accuracy_md_s_compiled_against_eager_figures_are_what_run_prints(tmp_path):
    """docs/ACCURACY.md's llama3-8b FSDP 8 figures: the eager and the --compile peak, the partitioner's saved bytes."""
    import re
    import shlex
    from pathlib import Path

    from hyperdryrun.cli import build_parser
    from hyperdryrun.commands.job import job_from_args
    from hyperdryrun.recipe import run_job

    text = " ".join((Path(__file__).parents[2] / "docs" / "ACCURACY.md").read_text().split())
    found = re.search(
        r"Compiled against eager\*\* \(`(run [^`]+)`, no activation checkpointing\): peak ([\d.]+) GiB eager, "
        r"([\d.]+) GiB with `--compile` \(the partitioner saves ([\d,]+) B per block for backward where no "
        r"recomputation would save ([\d,]+) B\)",
        text,
    )
    assert found, "the figure's sentence moved"
    command, eager_gib, compiled_gib, saved, unrecomputed = found.groups()
    peaks, lines = [], []
    for extra in ([], ["--compile"]):
        args = build_parser().parse_args([*shlex.split(command), *extra, "--output-dir", str(tmp_path)])
        trace = run_job(job_from_args(args, {}), capture_stacks=False)
        peaks.append(f"{trace.peak / 2**30:.2f}")
        lines += [line for line in trace.limitations if "torch.compile region" in line]
    assert peaks == [eager_gib, compiled_gib]
    assert (
        f"({saved.replace(',', '')} B; {unrecomputed.replace(',', '')} B with no recomputation)" in lines[0]
    )
