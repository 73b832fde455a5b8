"""What a dry run imports: the command pays for torch's distributed stack, not for tools it never uses."""

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
