"""What a dry run imports (torch's distributed stack, not tools it never uses), and the collector while a process
of ours imports it (hyperdryrun.startup)."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_clearing_dtensor_caches_imports_no_debug_tools():
    # torch.distributed.tensor.debug imports CommDebugMode, hence torch.distributed._tools and its runtime
    # estimator (torch._inductor.utils); the world clears DTensor's caches without it.
    code = (
        "import sys\n"
        "from hyperdryrun.compat import torch_dtensor\n"
        "torch_dtensor.clear_caches()\n"
        "print(sorted(m for m in sys.modules if m.startswith(('torch.distributed._tools', "
        "'torch.distributed.tensor.debug'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_step_with_no_compiled_region_imports_no_inductor():
    # The world enters the dry run's Inductor (torch._inductor.compile_fx, its lowerings, jinja2's templates: about
    # 0.8 s CPU) only when an Inductor region is about to compile; a plain eager step never pays for it.
    code = (
        "import sys\n"
        "from hyperdryrun.config import build_config\n"
        "from hyperdryrun.recipe import run_job\n"
        "cfg = build_config({'model': {'name': 'llama-tiny'}, 'training': {'seq_len': 32},\n"
        "                    'world': {'world_size': 2}, 'parallel': {'dp_shard': 2}})\n"
        "run_job(cfg, capture_stacks=False)\n"
        "print(sorted(m for m in sys.modules if m in ('torch._inductor.compile_fx', 'torch._inductor.lowering', "
        "'jinja2')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


# The collector while a process of ours imports the torch stack (hyperdryrun.startup).

_COUNT_COLLECTIONS = (
    "import gc, sys\n"
    "runs = []\n"
    "gc.callbacks.append(lambda phase, info: phase == 'stop' and runs.append(info['generation']))\n"
)


def _python(code: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split()


def test_an_owned_process_imports_torch_with_no_collection_then_freezes_and_unfreezes_on_exit():
    out = _python(
        _COUNT_COLLECTIONS + "from hyperdryrun.startup import import_torch_stack, owned_process\n"
        "runs.clear()\n"
        "with owned_process():\n"
        "    import_torch_stack()\n"
        "    print(len(runs), gc.isenabled(), gc.get_freeze_count(), 'torch' in sys.modules)\n"
        "print(gc.isenabled(), gc.get_freeze_count())\n"
    )
    collections, enabled, frozen, has_torch, enabled_after, frozen_after = out
    assert (collections, enabled, has_torch) == ("0", "True", "True")
    assert int(frozen) > 100_000  # torch's modules, functions, classes: what later full collections now skip
    assert (enabled_after, frozen_after) == ("True", "0")


def test_outside_an_owned_process_the_import_leaves_the_collector_alone():
    # The Python API in a user's process: the same import, the collector running as it always does.
    out = _python(
        _COUNT_COLLECTIONS + "from hyperdryrun.startup import import_torch_stack\n"
        "runs.clear()\n"
        "import_torch_stack()\n"
        "print(len(runs), gc.isenabled(), gc.get_freeze_count())\n"
    )
    collections, enabled, frozen = out
    assert int(collections) > 100 and (enabled, frozen) == ("True", "0")


def test_an_owned_process_respects_a_collector_someone_else_froze_or_turned_off():
    out = _python(
        "import gc\n"
        "from hyperdryrun.startup import import_torch_stack, owned_process\n"
        "gc.freeze(); theirs = gc.get_freeze_count()\n"
        "with owned_process():\n"
        "    import_torch_stack()\n"
        "    print(0 < gc.get_freeze_count() <= theirs)\n"  # nothing of torch's frozen (some of theirs may die)
        "print(0 < gc.get_freeze_count() <= theirs)\n"  # nor unfrozen: what they froze stays frozen
    )
    assert out == ["True", "True"]
    out = _python(
        "import gc\n"
        "from hyperdryrun.startup import import_torch_stack, owned_process\n"
        "gc.disable()\n"
        "with owned_process():\n"
        "    import_torch_stack()\n"
        "print(gc.isenabled(), gc.get_freeze_count())\n"
    )
    assert out == ["False", "0"]


def test_a_failed_import_leaves_the_collector_on_and_nothing_frozen(monkeypatch):
    import gc
    import importlib.abc

    from hyperdryrun import startup

    class Broken(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "hyperdryrun.recipe":
                raise ImportError("hyperdryrun.recipe: broken for this test")
            return None

    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    monkeypatch.delitem(sys.modules, "hyperdryrun.recipe")  # put back as it was after the test
    monkeypatch.setattr(sys, "meta_path", [Broken(), *sys.meta_path])
    with pytest.raises(ImportError, match="broken for this test"), startup.owned_process():
        startup.import_torch_stack()
    assert gc.isenabled() and gc.get_freeze_count() == frozen and not startup._owner


def test_the_command_writes_the_same_reports_whether_torch_was_imported_with_the_collector_on_or_paused(
    tmp_path,
):
    # Pre-importing the stack with the collector on makes the command's import_torch_stack a plain import: the
    # command's reports then come from the collector's old behaviour; both processes run the same line of code.
    outputs = []
    for name, pre in (("paused", ""), ("collector-on", "import hyperdryrun.engine, hyperdryrun.recipe")):
        out = tmp_path / name
        argv = ["run", "--model", "llama-tiny", "--seq-len", "64", "--world-size", "4", "--tp", "2",
                "--ac", "selective", "--num-micro-batches", "2", "--quiet", "--output-dir", str(out)]  # fmt: skip
        code = f"import sys\n{pre}\nfrom hyperdryrun.cli import main; sys.exit(main({argv!r}))\n"
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        outputs.append({p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()})
    assert len(outputs[0]) == 3 and outputs[0] == outputs[1]


@pytest.mark.parametrize(
    "argv",
    [
        ["--world-size", "4", "--tp", "2", "--ac", "selective", "--num-micro-batches", "2"],
        [
            "--world-size",
            "4",
            "--pp",
            "2",
            "--pp-schedule",
            "1F1B",
            "--num-micro-batches",
            "4",
            "--ac",
            "full",
        ],
        ["--world-size", "2", "--cp", "2", "--seq-len", "64"],
        ["--model", "moe-tiny", "--world-size", "4", "--dp-shard", "4", "--ep", "2"],
    ],
    ids=["fsdp-tp-sac", "pp-1f1b-full-ac", "cp", "moe-ep"],
)
def test_no_tracked_storage_dies_inside_a_collection(argv, tmp_path, monkeypatch, capsys):
    # A block ends when its storage dies; were one kept alive by a reference cycle, it would end inside a
    # collection, at a time the collector's counts decide, which pausing or freezing the collector could move.
    # With the collector made to run every 50 new objects, none does: every storage dies of its reference count.
    import gc

    from hyperdryrun.cli import main
    from hyperdryrun.trace import tracker

    collecting = [False]
    deaths = {"all": 0, "in a collection": 0}

    def watch(phase, info):
        collecting[0] = phase == "start"

    died = tracker.MemoryTracker._storage_died

    def counted(self, key):
        callback = died(self, key)

        def on_death(ref):
            if self.active:
                deaths["all"] += 1
                deaths["in a collection"] += collecting[0]
            return callback(ref)

        return on_death

    monkeypatch.setattr(tracker.MemoryTracker, "_storage_died", counted)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    model = [] if "--model" in argv else ["--model", "llama-tiny"]
    seq = [] if "--seq-len" in argv else ["--seq-len", "32"]
    thresholds = gc.get_threshold()
    gc.callbacks.append(watch)
    gc.set_threshold(50, 2, 2)
    try:
        code = main(["run", *model, *seq, *argv, "--quiet", "--no-stacks", "--output-dir", str(tmp_path)])
    finally:
        gc.set_threshold(*thresholds)
        gc.callbacks.remove(watch)
    capsys.readouterr()
    assert code == 0
    assert deaths["all"] > 100 and deaths["in a collection"] == 0, deaths
