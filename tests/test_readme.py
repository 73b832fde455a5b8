"""The README and the reference pages in docs/ run as written: the Python example, every ``hyperdryrun`` command line
(parsed, and for the job commands validated into a config), the YAML examples, the peak figures quoted beside a
command (each command run; the big models take about a minute each and are marked ``slow``, which CI runs), the
README's first command's output (line numbers of the model's source aside: those are checked against the report), the
limits table, and every link between the pages. Examples are found on whichever page holds them
(``tests/doc_pages.py``)."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
from pathlib import Path

import pytest

from tests.doc_pages import PAGES, README, ROOT, code_blocks, the_block

BIG_MODELS = ("llama3-70b", "llama3-405b", "deepseek-v3")
FIGURE = re.compile(r"\brank (\d+): peak (\d+\.\d\d) GiB", re.IGNORECASE)
README_MAX_LINES = 300
"""A newcomer's five minutes (issue 28): the rest lives in docs/."""


def commands() -> list[tuple[str, str, list[str], dict[str, str]]]:
    """Every ``hyperdryrun`` command in the bash blocks of the README and docs/: (the page, the comment lines just
    above it, its argv, the environment variables set before it on the line)."""
    found = []
    for page, block in code_blocks("bash"):
        comments: list[str] = []
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip()
            if line.startswith("#"):
                comments.append(line)
                continue
            for prefix, command in re.findall(r"((?:\w+=\S+ )*)(?:\S*/)?hyperdryrun (.*?)(?:$|&&)", line):
                env = dict(kv.split("=", 1) for kv in prefix.split())
                found.append((page.name, " ".join(comments), shlex.split(command), env))
            comments = []
    return found


def job_file(tmp_path: Path) -> Path:
    """The documented ``job.yaml``, written where a command's ``--config job.yaml`` can read it."""
    _, block = the_block("yaml", "device_memory_gib")
    path = tmp_path / "job.yaml"
    path.write_text(block)
    return path


COMMANDS = commands()


def test_the_docs_have_the_commands_they_document():
    verbs = {argv[0] for _, _, argv, _ in COMMANDS}
    assert {"run", "measure", "compare", "fit", "script", "torchtitan", "report", "snapshot"} <= verbs
    assert len(COMMANDS) >= 30
    # the README's recipes show every front door of its table: run (a preset and hf:), script, torchtitan
    readme = [argv for page, _, argv, _ in COMMANDS if page == README.name]
    assert {"run", "fit", "script", "torchtitan", "report", "compare"} <= {argv[0] for argv in readme}
    assert any(
        a[0] == "run" and a[a.index("--model") + 1].startswith("hf:") for a in readme if "--model" in a
    )


@pytest.mark.parametrize(
    ("page", "comment", "argv", "env"), COMMANDS, ids=[f"{p}:{' '.join(a)[:60]}" for p, _, a, _ in COMMANDS]
)
def test_every_documented_command_parses_and_its_job_validates(page, comment, argv, env, tmp_path):
    from hyperdryrun.cli import build_parser
    from hyperdryrun.commands.job import job_from_args

    argv = [str(job_file(tmp_path)) if a == "job.yaml" else a for a in argv]
    args = build_parser().parse_args(argv)
    assert args.command == argv[0]
    if args.command in ("run", "measure"):
        cfg = job_from_args(args, env)  # a layout, value or rank identity the docs get wrong fails here
        if "RANK" in env:
            assert (cfg.world.rank, cfg.world.world_size) == (int(env["RANK"]), int(env["WORLD_SIZE"]))


def test_the_documented_job_file_is_a_valid_config():
    import yaml

    from hyperdryrun.config import build_config

    _, block = the_block("yaml", "device_memory_gib")
    cfg = build_config(yaml.safe_load(block))
    assert (cfg.model.name, cfg.model.args().n_layers, cfg.parallel.dp_shard) == ("llama3-8b", 16, 8)
    assert cfg.training.ac == "selective" and cfg.device_memory_gib == 80


def moe_job() -> str:
    return the_block("yml", "routing: hotspot")[1]


def test_the_value_rule_examples_are_valid_and_their_counts_add_up(tmp_path):
    from hyperdryrun.config import build_config, load_yaml
    from hyperdryrun.models.moe import PRESETS

    path = tmp_path / "moe.yaml"
    path.write_text(moe_job())
    cfg = build_config(load_yaml(path))
    preset = PRESETS[cfg.model.name]
    (rule,) = cfg.values.rules
    # one count per expert, adding up to the routed rows of one micro batch, none above its tokens
    tokens = cfg.training.micro_batch_size * cfg.training.seq_len
    assert len(rule.counts) == preset.num_experts
    assert sum(rule.counts) == tokens * preset.top_k and max(rule.counts) <= tokens
    assert cfg.parallel.ep == 8 and cfg.world.world_size == 8
    path.write_text(the_block("yml", "handler: branch")[1])
    assert [r.handler for r in build_config(load_yaml(path)).values.rules] == ["branch", "size"]


def test_the_moe_example_runs_with_its_explicit_layer(tmp_path, capsys):
    from hyperdryrun.cli import main

    path = tmp_path / "moe.yaml"
    path.write_text(moe_job())
    out = tmp_path / "out"
    assert main(["run", "--config", str(path), "--output-dir", str(out), "--quiet", "--no-stacks"]) == 0
    moe = json.loads((out / "rank_0" / "rank_0_memory.json").read_text())["metadata"]["moe"]
    text = json.dumps(moe)
    assert "2048, 2048, 1024, 1024, 512, 512, 512, 512" in text  # layer 0's explicit counts are reported


def test_the_bring_your_own_model_example_runs_and_shards_parameters_8_ways(tmp_path, monkeypatch, capsys):
    from hyperdryrun.trace.blocks import Category

    page, example = the_block("python", "hyperdryrun.simulate(")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "readme_example"}
    exec(compile(example, str(page), "exec"), namespace)
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
# the figures the docs quote, from a run of the command beside them
# ---------------------------------------------------------------------------------------------------------


def run_peaks(argv: list[str], env: dict[str, str], tmp_path: Path, monkeypatch) -> dict[int, dict]:
    """Run a documented command in-process into ``tmp_path``; the summary of every rank it wrote."""
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
    for _, comment, argv, env in COMMANDS
    if (figures := {int(r): g for r, g in FIGURE.findall(comment)})
]


def test_the_docs_quote_figures_for_the_big_models():
    quoted = {a[a.index("--model") + 1] for p in FIGURED for a in [p.values[0]]}
    assert set(BIG_MODELS) <= quoted


@pytest.mark.parametrize(
    ("argv", "env", "figures"), FIGURED, ids=[" ".join(p.values[0])[:70] for p in FIGURED]
)
def test_a_quoted_peak_is_what_the_command_prints(argv, env, figures, tmp_path, monkeypatch):
    summaries = run_peaks(argv, env, tmp_path, monkeypatch)
    assert {r: f"{summaries[r]['peak_bytes'] / 2**30:.2f}" for r in figures} == figures


# ---------------------------------------------------------------------------------------------------------
# the README's first command: its output as shown, and the source lines its largest blocks name
# ---------------------------------------------------------------------------------------------------------

SOURCE_LINE = re.compile(r"(\w+\.py):(\d+)")


def shown_output() -> str:
    """The output block of the set-up section's first command."""
    return re.search(r"```\n(llama3-8b · rank 0 of 8 .*?)```", README.read_text(), flags=re.S).group(1)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """The README's first command as a user types it (in a fresh directory, so its default output directory), with
    stacks, its console output captured: (what it printed, its rank 0 report). One run for the tests below (10 to
    15 s)."""
    from hyperdryrun.cli import main

    (argv, env) = next(
        (a, e) for p, _, a, e in COMMANDS if p == README.name and a[:3] == ["run", "--model", "llama3-8b"]
    )
    assert "8192" in argv and not env
    cwd = tmp_path_factory.mktemp("first")
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "PYTORCH_CUDA_ALLOC_CONF"):
            mp.delenv(var, raising=False)
        mp.chdir(cwd)
        with contextlib.redirect_stdout(printed):
            assert main(argv) == 0
    report = json.loads((cwd / "hyperdryrun_out" / "rank_0" / "rank_0_memory.json").read_text())
    return printed.getvalue(), report


def test_the_first_command_prints_the_output_the_readme_shows(first_run):
    """The set-up section's Llama 3 8B run: its peak, the task and op of it, and what stays (every supported torch
    gives these: .ci/torch-releases runs this test on each)."""
    shown = shown_output()
    peak, phase, task, op = re.search(r"peak (\d+\.\d\d) GiB in (\w+) \(task (\d+), (\w+)\)", shown).groups()
    after = re.search(r"after the step: (\d+\.\d\d) GiB", shown).group(1)
    s = first_run[1]["summary"]
    assert f"{s['peak_bytes'] / 2**30:.2f}" == peak and f"{s['current_bytes'] / 2**30:.2f}" == after
    assert (s["peak_phase"], s["peak_task"], s["peak_op"]) == (phase, int(task), op)


def test_the_first_command_prints_every_line_the_readme_shows_but_source_line_numbers(first_run):
    """Line for line what the README shows: the headline, the allocator's lines, the tables, the files written. The
    model's source line numbers are left out of the comparison (moving code in models/llama.py must not make the
    README wrong); the test below checks where those lines point."""

    def lines(text: str) -> list[str]:
        text = re.sub(r"\x1b\[[0-9;]*m", "", text)  # a terminal's colours, should FORCE_COLOR be set
        return [SOURCE_LINE.sub(r"\1:N", line.rstrip()) for line in text.strip("\n").splitlines()]

    shown, printed = lines(shown_output()), lines(first_run[0])
    assert printed == shown
    assert sum("llama.py:N" in line for line in shown) == 8  # the largest blocks each name their line


def test_the_first_command_s_largest_blocks_are_allocated_at_the_lines_of_their_code(first_run):
    """Each of the largest blocks live at the peak names the line of its block's code: the loss's cross entropy,
    the line that created the parameter, or the forward line that ran the module. The line is the report's (its
    innermost frame), read from the source file it names, so the check holds wherever the code moves."""
    printed = first_run[0]
    rows = [line for line in printed.splitlines() if SOURCE_LINE.search(line) and "│" in line]
    blocks = first_run[1]["peak_live_set"]["blocks"][: len(rows)]
    assert len(rows) == 8 and len(blocks) == 8
    for row, block in zip(rows, blocks, strict=True):
        frame = block["stack"][0]
        path = Path(frame["file"])
        assert path == ROOT / "src" / "hyperdryrun" / "models" / "llama.py", frame
        # the console shows that line
        assert SOURCE_LINE.search(row).groups() == (path.name, str(frame["line"]))
        code = path.read_text().splitlines()[frame["line"] - 1]
        module, phase = block["module"], block["phase"]
        if not module:  # the loss, outside modules
            assert "F.cross_entropy(" in code, (block["op"], frame, code)
        elif phase == "initialization":  # the line that created the parameter
            assert f"self.{module} = nn." in code, (module, frame, code)
        else:  # the forward line that ran the module
            assert f"self.{module}(" in code, (module, frame, code)


def test_the_figures_table_row_of_the_first_command_is_its_report(first_run):
    """docs/OUTPUTS.md's table of figures: its first command's row (peak, allocated, reserved, device)."""
    (row,) = [
        line
        for page in PAGES
        for line in page.read_text().splitlines()
        if line.startswith("| 8B FSDP 8, seq 8192 (the first command)")
    ]
    quoted = re.findall(r"(\d+\.\d\d) GiB", row)[:4]
    s = first_run[1]["summary"]
    keys = ("peak_bytes", "peak_allocated_bytes", "peak_reserved_bytes", "peak_device_bytes")
    assert [f"{s[k] / 2**30:.2f}" for k in keys] == quoted


def test_the_readme_s_headroom_on_each_card_is_its_capacity_less_the_device_peak(first_run):
    """ "With --gpu h100-80gb (79.11 GiB ...) it fits with 3.49 GiB to spare, more than the verdict's 1% margin; with
    --gpu h200 (139.80 GiB) 64.18 GiB": each card's capacity (world/gpus.py) less the first command's device peak.
    The job reserves the same under those capacities as without one (it fits: no cache release), and its kernels
    are the same sm90 choices (no preset: an H100's), so the run without --gpu gives the device peak."""
    from hyperdryrun.allocator.verdict import DEVICE_ERROR_FRACTION
    from hyperdryrun.world.gpus import gpu_preset

    device = first_run[1]["summary"]["peak_device_bytes"]
    text = " ".join(README.read_text().split())
    for gpu in ("h100-80gb", "h200"):
        capacity = gpu_preset(gpu).capacity_bytes
        quoted = re.search(rf"`--gpu {gpu}` \((\d+\.\d\d) GiB.*? (\d+\.\d\d) GiB", text)
        assert quoted is not None, gpu
        assert (f"{capacity / 2**30:.2f}", f"{(capacity - device) / 2**30:.2f}") == quoted.groups()
        assert capacity - device > DEVICE_ERROR_FRACTION * capacity  # more than the margin: it fits


# ---------------------------------------------------------------------------------------------------------
# the pages themselves
# ---------------------------------------------------------------------------------------------------------


def test_the_readme_is_a_five_minute_read():
    assert len(README.read_text().splitlines()) <= README_MAX_LINES


def anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation other than ``-`` and ``_`` dropped, spaces to
    hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_between_the_pages_reaches_a_file_and_heading():
    links = 0
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, fragment = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            assert dest.exists(), (page.name, target)
            if fragment:
                headings = re.findall(r"^#+ (.+)$", dest.read_text(), flags=re.M)
                assert fragment in {anchor(h) for h in headings}, (page.name, target)
            links += 1
    assert links >= 30


def test_the_docs_state_every_limit_with_its_default():
    from hyperdryrun.commands.job import WORLD_SIZE
    from hyperdryrun.ingest.files import LIMITS

    rows = {
        line.split("|")[1].strip(" `"): line
        for page in PAGES
        for line in page.read_text().splitlines()
        if "HYPERDRYRUN_MAX_" in line and line.startswith("|")
    }
    for limit in (*LIMITS, WORLD_SIZE):
        d = limit.default
        if limit.env.endswith("_BYTES"):
            shown = f"{d >> 30} GiB" if d >= 1 << 30 else f"{d >> 20} MiB"
        else:
            shown = f"{d:,}"
        assert f"({shown})" in rows[limit.env], (limit.env, shown)
