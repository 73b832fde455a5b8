"""Where in the code every block comes from: set-up blocks carry the line that created their parameter or buffer,
backward blocks the forward line whose autograd node made them (tracker: autograd sequence numbers; engine:
creation sites), and the README's first command has a file and line on every row of its CSV."""

from __future__ import annotations

import csv
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from hyperdryrun.config import build_config
from hyperdryrun.recipe import run_job

ROOT = Path(__file__).resolve().parents[2]
LLAMA = ROOT / "src" / "hyperdryrun" / "models" / "llama.py"


def _line_of(text: str) -> int:
    """The 1-based line of llama.py holding ``text`` (exactly one)."""
    lines = [i for i, line in enumerate(LLAMA.read_text().splitlines(), 1) if text in line]
    assert len(lines) == 1, (text, lines)
    return lines[0]


def test_set_up_and_backward_blocks_carry_the_model_lines_they_belong_to():
    small = {"n_layers": 2, "dim": 64, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 96, "vocab_size": 256}
    cfg = {"model": {"name": "llama3-8b", **small}, "training": {"seq_len": 64}, "target_device": "cpu"}
    trace = run_job(build_config({**cfg, "world": {"world_size": 2}, "parallel": {"dp_shard": 2}}), True)
    top = lambda b: trace.stacks.frames(b.stack_id)[0]  # noqa: E731  (innermost frame)
    assert all(trace.stacks.frames(b.stack_id) for b in trace.blocks)
    # the caller (this test) is an outer frame of every stack, never the line a block is attributed to
    assert not any(top(b)[0] == __file__ for b in trace.blocks)
    wqkv = "layers.0.attention.wqkv"
    created = (str(LLAMA), _line_of("attention.wqkv = nn.Linear("))
    setup = [b for b in trace.blocks if b.module == wqkv and str(b.phase) == "initialization"]
    # the sharded weight and its two AdamW states, all made for the parameter that line created
    assert sorted(str(b.category) for b in setup) == ["Optstate", "Optstate", "Parameter"]
    assert {top(b)[:2] for b in setup} == {created}
    # backward: the weight's gradient and the input's gradient, made by the autograd node of the forward matmul
    used = (str(LLAMA), _line_of("qkv = attention.wqkv(x)"))
    backward = [b for b in trace.blocks if b.module == wqkv and str(b.phase) == "backward" and b.op == "mm"]
    assert len(backward) == 2
    assert {top(b)[:2] for b in backward} == {used}
    # every backward block made while w1's backward runs (its gradients, the sum with w3's input gradient)
    # points at the one line of the feed-forward's forward
    w1 = [b for b in trace.blocks if b.module == "layers.1.feed_forward.w1" and str(b.phase) == "backward"]
    assert len(w1) == 3
    assert {top(b)[:2] for b in w1} == {(str(LLAMA), _line_of("return self.w2(F.silu(self.w1(x))"))}


@pytest.mark.slow
def test_every_block_of_the_readme_first_command_has_a_file_and_line(tmp_path):
    readme = (ROOT / "README.md").read_text()
    first = re.search(r"hyperdryrun run (--model [^\n]*)", readme)
    assert first is not None
    argv = shlex.split(first.group(1))
    assert argv[:2] == ["--model", "llama3-8b"]
    # a child process, as the command runs: no test frame above the step to lend a line
    subprocess.run(
        [sys.executable, "-m", "hyperdryrun", "run", *argv, "--output-dir", str(tmp_path), "--quiet"],
        check=True,
        capture_output=True,
    )
    with open(tmp_path / "rank_0" / "rank_0_memory.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    # 713 set-up, 1203 forward, 1392 backward, 227 optimizer blocks
    assert len(rows) == 713 + 1203 + 1392 + 227
    assert all(r["file_name"] and r["line_num"] and r["python_stack"] for r in rows)
    setup = [r for r in rows if r["start_time_stamp"] == "0"]
    assert len(setup) >= 713 and all(r["file_name"] == str(LLAMA) for r in setup[:713])
