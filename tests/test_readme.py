"""The README's Python example runs as written, and its figures follow from the model's shapes."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def code_blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), flags=re.S)


def test_the_bring_your_own_model_example_runs_and_shards_parameters_8_ways(tmp_path, monkeypatch, capsys):
    from hyperdryrun.trace.blocks import Category

    (example,) = [b for b in code_blocks("python") if "hyperdryrun.simulate(" in b]
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "readme_example"}
    exec(compile(example, str(README), "exec"), namespace)
    trace = namespace["trace"]
    assert "rank 3 peak:" in capsys.readouterr().out
    # 4 blocks of LayerNorm(1024) + Linear(1024, 4096) + Linear(4096, 1024): every dim 0 divides by 8, so each
    # rank stores exactly 1/8 of the fp32 parameters, and each shard is a multiple of 512 bytes.
    dim = 1024
    per_block = 2 * dim + (dim * 4 * dim + 4 * dim) + (4 * dim * dim + dim)
    params = 4 * per_block
    held = sum(b.size for b in trace.blocks if b.category is Category.PARAMETER and b.persistent)
    assert held == params * 4 // 8
    optstate = sum(b.size for b in trace.blocks if b.category is Category.OPTSTATE and b.persistent)
    assert optstate == 2 * params * 4 // 8
    assert trace.metadata["rank"] == 3 and trace.metadata["world_size"] == 8
    assert sorted(p.name for p in (tmp_path / "my_run" / "rank_3").iterdir()) == [
        "rank_3_memory.csv",
        "rank_3_memory.json",
        "rank_3_segments.csv",  # a CUDA target (the default): the caching allocator's segments
    ]


@pytest.mark.parametrize(
    "line", [ln for b in code_blocks("bash") for ln in b.replace("\\\n", " ").splitlines()]
)
def test_every_readme_command_line_parses(line):
    from hyperdryrun.cli import build_parser

    line = line.strip()
    for command in re.findall(r"hyperdryrun (.*?)(?:$|&&)", line):
        argv = shlex.split(command)
        if "--config" in argv:  # the file is an example
            continue
        args = build_parser().parse_args(argv)
        assert args.command == argv[0]


def test_the_readme_job_file_is_a_valid_config():
    import yaml

    from hyperdryrun.config import build_config

    (block,) = code_blocks("yaml")
    cfg = build_config(yaml.safe_load(block))
    assert (cfg.model.name, cfg.model.args().n_layers, cfg.parallel.dp_shard) == ("llama3-8b", 16, 8)
    assert cfg.training.ac == "selective" and cfg.device_memory_gib == 80
