"""The README runs as written: its Python example, every ``hyperdryrun`` command line (parsed, and for the job
commands validated into a config), its YAML examples, and the peak figures it quotes beside a command (each
command run; the big models take about a minute each and are marked ``slow``, which CI runs)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BIG_MODELS = ("llama3-70b", "llama3-405b", "deepseek-v3")
FIGURE = re.compile(r"\brank (\d+): peak (\d+\.\d\d) GiB", re.IGNORECASE)


def code_blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), flags=re.S)


def commands() -> list[tuple[str, list[str], dict[str, str]]]:
    """Every ``hyperdryrun`` command in the README's bash blocks: (the comment lines just above it, its argv, the
    environment variables set before it on the line)."""
    found = []
    for block in code_blocks("bash"):
        comments: list[str] = []
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip()
            if line.startswith("#"):
                comments.append(line)
                continue
            for prefix, command in re.findall(r"((?:\w+=\S+ )*)(?:\S*/)?hyperdryrun (.*?)(?:$|&&)", line):
                env = dict(kv.split("=", 1) for kv in prefix.split())
                found.append((" ".join(comments), shlex.split(command), env))
            comments = []
    return found


def job_file(tmp_path: Path) -> Path:
    """The README's ``job.yaml``, written where a command's ``--config job.yaml`` can read it."""
    (block,) = [b for b in code_blocks("yaml") if "device_memory_gib" in b]
    path = tmp_path / "job.yaml"
    path.write_text(block)
    return path


COMMANDS = commands()


def test_the_readme_has_the_commands_it_documents():
    verbs = [argv[0] for _, argv, _ in COMMANDS]
    assert {"run", "measure", "compare"} <= set(verbs) and len(COMMANDS) >= 15


@pytest.mark.parametrize(("comment", "argv", "env"), COMMANDS, ids=[" ".join(a)[:60] for _, a, _ in COMMANDS])
def test_every_readme_command_parses_and_its_job_validates(comment, argv, env, tmp_path):
    from hyperdryrun.cli import build_parser
    from hyperdryrun.commands.job import job_from_args

    argv = [str(job_file(tmp_path)) if a == "job.yaml" else a for a in argv]
    args = build_parser().parse_args(argv)
    assert args.command == argv[0]
    if args.command in ("run", "measure"):
        cfg = job_from_args(args, env)  # a layout, value or rank identity the README gets wrong fails here
        if "RANK" in env:
            assert (cfg.world.rank, cfg.world.world_size) == (int(env["RANK"]), int(env["WORLD_SIZE"]))


def test_the_readme_job_file_is_a_valid_config():
    import yaml

    from hyperdryrun.config import build_config

    (block,) = code_blocks("yaml")
    cfg = build_config(yaml.safe_load(block))
    assert (cfg.model.name, cfg.model.args().n_layers, cfg.parallel.dp_shard) == ("llama3-8b", 16, 8)
    assert cfg.training.ac == "selective" and cfg.device_memory_gib == 80


def test_the_readme_value_rule_examples_are_valid_and_their_counts_add_up(tmp_path):
    from hyperdryrun.config import build_config, load_yaml
    from hyperdryrun.models.moe import PRESETS

    moe, user = code_blocks("yml")
    path = tmp_path / "moe.yaml"
    path.write_text(moe)
    cfg = build_config(load_yaml(path))
    preset = PRESETS[cfg.model.name]
    (rule,) = cfg.values.rules
    # one count per expert, adding up to the routed rows of one micro batch, none above its tokens
    tokens = cfg.training.micro_batch_size * cfg.training.seq_len
    assert len(rule.counts) == preset.num_experts
    assert sum(rule.counts) == tokens * preset.top_k and max(rule.counts) <= tokens
    assert cfg.parallel.ep == 8 and cfg.world.world_size == 8
    path.write_text(user)
    assert [r.handler for r in build_config(load_yaml(path)).values.rules] == ["branch", "size"]


def test_the_readme_moe_example_runs_with_its_explicit_layer(tmp_path, capsys):
    from hyperdryrun.cli import main

    path = tmp_path / "moe.yaml"
    path.write_text(code_blocks("yml")[0])
    out = tmp_path / "out"
    assert main(["run", "--config", str(path), "--output-dir", str(out), "--quiet", "--no-stacks"]) == 0
    moe = json.loads((out / "rank_0" / "rank_0_memory.json").read_text())["metadata"]["moe"]
    text = json.dumps(moe)
    assert "2048, 2048, 1024, 1024, 512, 512, 512, 512" in text  # layer 0's explicit counts are reported


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


# ---------------------------------------------------------------------------------------------------------
# the figures the README quotes, from a run of the command beside them
# ---------------------------------------------------------------------------------------------------------


def run_peaks(argv: list[str], env: dict[str, str], tmp_path: Path, monkeypatch) -> dict[int, dict]:
    """Run a README command in-process into ``tmp_path``; the summary of every rank it wrote."""
    from hyperdryrun.cli import main

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    out = tmp_path / "out"
    rc = main([*argv, "--output-dir", str(out), "--quiet", "--no-stacks"])
    assert rc in (0, 1)  # 1: the OOM verdict of --device-memory-gib, still a report
    return {
        int(p.parent.name.split("_")[1]): json.loads(p.read_text())["summary"]
        for p in out.glob("rank_*/rank_*_memory.json")
    }


FIGURED = [
    pytest.param(argv, env, figures, marks=[pytest.mark.slow] if any(m in argv for m in BIG_MODELS) else [])
    for comment, argv, env in COMMANDS
    if (figures := {int(r): g for r, g in FIGURE.findall(comment)})
]


def test_the_readme_quotes_figures_for_the_big_models():
    quoted = {a[a.index("--model") + 1] for p in FIGURED for a in [p.values[0]]}
    assert set(BIG_MODELS) <= quoted


@pytest.mark.parametrize(
    ("argv", "env", "figures"), FIGURED, ids=[" ".join(p.values[0])[:70] for p in FIGURED]
)
def test_a_quoted_peak_is_what_the_command_prints(argv, env, figures, tmp_path, monkeypatch):
    summaries = run_peaks(argv, env, tmp_path, monkeypatch)
    assert {r: f"{summaries[r]['peak_bytes'] / 2**30:.2f}" for r in figures} == figures


def test_the_first_command_prints_the_output_the_readme_shows(tmp_path, monkeypatch):
    """The set-up section's Llama 3 8B run (10 to 15 s): its peak, the task and op of it, and what stays."""
    shown = re.search(r"```\n(llama3-8b · rank 0 of 8 .*?)```", README.read_text(), flags=re.S).group(1)
    peak, phase, task, op = re.search(r"peak (\d+\.\d\d) GiB in (\w+) \(task (\d+), (\w+)\)", shown).groups()
    after = re.search(r"after the step: (\d+\.\d\d) GiB", shown).group(1)
    (argv, env) = next(
        (a, e) for _, a, e in COMMANDS if a[:3] == ["run", "--model", "llama3-8b"] and "8192" in a
    )
    s = run_peaks(argv, env, tmp_path, monkeypatch)[0]
    assert f"{s['peak_bytes'] / 2**30:.2f}" == peak and f"{s['current_bytes'] / 2**30:.2f}" == after
    assert (s["peak_phase"], s["peak_task"], s["peak_op"]) == (phase, int(task), op)


def test_the_first_command_s_allocated_at_lines_are_the_lines_that_make_those_blocks():
    """The README's table of the largest blocks names llama.py lines: each must still be the line of that block's
    code (the loss's cross entropy, the module's forward or its constructor), or the README is stale."""
    shown = re.search(r"```\n(llama3-8b · rank 0 of 8 .*?)```", README.read_text(), flags=re.S).group(1)
    source = (README.parent / "src" / "hyperdryrun" / "models" / "llama.py").read_text().splitlines()
    rows = [
        [cell.strip() for cell in line.split("│")]
        for line in shown.splitlines()
        if re.search(r"│ llama\.py:\d+\s*$", line)
    ]
    assert len(rows) == 8, rows
    for _, _, op, module, phase, at in rows:
        code = source[int(at.split(":")[1]) - 1]
        if not module:  # the loss, outside modules
            assert "F.cross_entropy(" in code, (op, at, code)
        elif phase == "init":  # the line that created the parameter
            assert f"self.{module} = nn." in code, (module, at, code)
        else:  # the forward line that ran the module
            assert f"self.{module}(" in code, (module, at, code)


def test_the_readme_states_every_limit_with_its_default():
    from hyperdryrun.commands.job import WORLD_SIZE
    from hyperdryrun.ingest.files import LIMITS

    rows = {
        line.split("|")[1].strip(" `"): line
        for line in README.read_text().splitlines()
        if "HYPERDRYRUN_MAX_" in line and line.startswith("|")
    }
    for limit in (*LIMITS, WORLD_SIZE):
        d = limit.default
        if limit.env.endswith("_BYTES"):
            shown = f"{d >> 30} GiB" if d >= 1 << 30 else f"{d >> 20} MiB"
        else:
            shown = f"{d:,}"
        assert f"({shown})" in rows[limit.env], (limit.env, shown)
