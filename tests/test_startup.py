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
