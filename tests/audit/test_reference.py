"""The kernel audit's entry points: the shipped reference, reading a reference, and the audit staying out of the
runtime."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hyperdryrun import audit


def test_comparing_layers_the_reference_lacks_is_an_error_naming_them():
    reference = {"schema_version": 1, "layers": {"silu_bf16": {}}}
    with pytest.raises(ValueError, match="layers not in both the reference and the catalogue: gelu_bf16"):
        audit.compare(reference, ["silu_bf16", "gelu_bf16"])


def test_the_runtime_does_not_import_the_audit_package():
    code = (
        "import sys, hyperdryrun, hyperdryrun.cli, hyperdryrun.engine, hyperdryrun.recipe, hyperdryrun.world;"
        "from hyperdryrun.world import SimulatedWorld;"
        "w = SimulatedWorld(world_size=1, target_device='cuda', simulation_device='cpu');"
        "w.__enter__(); w.__exit__(None, None, None);"
        "print(sorted(m for m in sys.modules if m.startswith('hyperdryrun.audit')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
