"""The kernel audit's entry points: the shipped reference, reading a reference, and the audit staying out of the
runtime."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hyperdryrun import audit

REFERENCE = Path(__file__).parent / "fixtures" / "cuda_kernels.json"


def test_the_shipped_reference_loads_and_is_described_in_words():
    reference = audit.load_reference(str(REFERENCE))
    assert set(reference["layers"]) == set(audit.LAYERS)
    assert audit.describe_reference(reference) == "torch 2.13.0+cu130, sm90, cuDNN 9.20"


def test_a_reference_without_target_fields_is_described_by_what_it_has():
    assert audit.describe_reference({"torch_version": "2.13.0+cu128"}) == "torch 2.13.0+cu128"
    assert (
        audit.describe_reference({"cuda_target": {"sm": [8, 0], "cudnn": 91002}})
        == "torch ?, sm80, cuDNN 9.10.2"
    )


@pytest.mark.parametrize(
    "content,message",
    [
        ([], "not a kernel-audit reference: the file holds a JSON list"),
        (3, "the file holds a JSON number"),
        (None, "the file holds a JSON null"),
        ({"layers": {}}, "schema_version=None, expected 1"),
        ({"schema_version": 1}, "layers: expected an object"),
        ({"schema_version": 1, "layers": {"silu_bf16": "x"}}, "layers: expected an object"),
    ],
)
def test_load_reference_refuses_what_is_not_a_reference(tmp_path, content, message):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ValueError, match=message):
        audit.load_reference(str(path))


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
