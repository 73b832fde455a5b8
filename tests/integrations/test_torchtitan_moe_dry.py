"""torchtitan's MoE families in a dry run without a measured step: the router's gate as a GPU runs it, and a
family whose package is not installed refused in one line (qwen3_5 and kimi_k2_7: test_torchtitan_families.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "torchtitan", reason="torchtitan is not installed (pip install 'hyperdryrun[torchtitan]')"
)

from hyperdryrun.integrations.torchtitan import load_config, simulate_torchtitan  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
BATCH, SEQ = 2, 64
TOKENS = BATCH * SEQ
JOB = [
    *("--module", "deepseek_v3", "--config", "deepseek_v3_debugmodel"),
    *("--training.seq_len", str(SEQ), "--training.local_batch_size", str(BATCH)),
]


def test_the_router_gate_runs_in_fp32_on_a_cuda_target_and_in_bf16_on_the_cpu():
    """torchtitan's TokenChoiceTopKRouter computes the gate under torch.autocast(x.device.type,
    dtype=torch.float32): on a GPU an fp32 copy of the bf16 activations (tokens x dim) and fp32 scores (tokens x
    experts); CPU autocast refuses fp32, so a CPU step runs the gate in bf16 on the activations as they are."""
    model = load_config(JOB).model_spec.model
    dim, experts = model.dim, model.layers[1].moe.num_experts
    gate = "layers.1.moe.router.gate"
    made = {}
    for target in ("cuda", "cpu"):
        trace = simulate_torchtitan(JOB, world_size=1, n_layers=2, attention="sdpa", target_device=target)
        made[target] = sorted(
            (b.op, b.size) for b in trace.blocks if b.module == gate and str(b.phase) == "forward"
        )
    assert ("_to_copy", TOKENS * dim * 4) in made["cuda"]  # the activations' fp32 copy
    assert ("mm", TOKENS * experts * 4) in made["cuda"]  # fp32 scores
    assert ("mm", TOKENS * experts * 2) in made["cpu"] and not any(op == "_to_copy" for op, _ in made["cpu"])


def test_a_family_whose_models_need_a_missing_package_is_refused_in_one_line_naming_it(tmp_path):
    """qwen3_5's model imports fla (flash-linear-attention); torchvision, which its config registry's data loader
    imports, is stood in for (compat/torchtitan_families.py). CI installs fla, so the test makes it absent for the
    command and its child processes: a sitecustomize on PYTHONPATH whose import finder answers as Python does for
    a package that is not installed."""
    module, config, package = "qwen3_5", "qwen35_debugmodel_moe", "fla"
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\n"
        "class Absent:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.split('.')[0] == {package!r}:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Absent())\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "hyperdryrun.cli", "torchtitan", "--module", module, "--config", config],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO / "src")])},
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr
    assert f"import {package!r}, which is not installed" in lines[0] and module in lines[0]


@pytest.mark.parametrize("content", ["not json", '{"metadata": {"mode": "dry-run", "torchtitan": {}}}'])
def test_routing_from_a_file_that_is_no_measured_moe_report_is_a_one_line_error(tmp_path, content):
    bad = tmp_path / "report.json"
    bad.write_text(content)
    done = subprocess.run(
        [sys.executable, "-m", "hyperdryrun.cli", "torchtitan", *JOB, "--world-size=1", "--in-process"]
        + [f"--routing-from={bad}", "--output-dir", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO / "src")},
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert (
        len(lines) == 1
        and lines[0].startswith("hyperdryrun: error: values.routing_from (--routing-from): ")
        and str(bad) in lines[0]
    )


def test_gpt_oss_runs_its_varlen_attention_on_a_cuda_target_with_one_document_per_row():
    """torchtitan's VarlenAttention builds its metadata with nonzero(positions[b] == 0) per row; the synthetic
    batches hold one document per row. varlen_attn's outputs: bf16 (tokens, heads, head_dim) and fp32 LSE
    (heads, tokens)."""
    argv = [
        *("--module", "gpt_oss", "--config", "gpt_oss_debugmodel"),
        *("--training.seq_len", str(SEQ), "--training.local_batch_size", str(BATCH)),
    ]
    attention = load_config(argv).model_spec.model.layers[0].attention
    assert type(attention.inner_attention).__qualname__ == "VarlenAttention.Config"
    trace = simulate_torchtitan(argv, world_size=1, n_layers=1, capture_stacks=False)
    made = {b.size for b in trace.blocks if b.op == "_varlen_attn" and str(b.phase) == "forward"}
    heads, head_dim = attention.n_heads, attention.head_dim
    assert {TOKENS * heads * head_dim * 2, heads * TOKENS * 4} <= made
