"""Row h1 of the GPU record: a Hugging Face Llama (Llama-3.1-8B shape cut to 4 layers) trained with its own loss,
``model(input_ids=ids, labels=ids).loss.backward()``, FSDP2 per decoder layer and root, AdamW foreach, rank 0 of 8
at sequence 4096, measured on an H200 (torch 2.11.0+cu130, transformers 5.17.0; ``docs/gpu/h1_hf_measured.json``,
three steps with the peak counters reset before each). ``docs/gpu/h1_hf_job.py`` is the whole job, a copy of the
record's: its ``dry`` runs the same code through ``hyperdryrun.simulate`` for an H200. Held to the GPU bar of the
other H200 rows (allocated 1%, reserved 3%)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "docs" / "gpu" / "h1_hf_job.py"
MEASURED = ROOT / "docs" / "gpu" / "h1_hf_measured.json"


@pytest.fixture(scope="module")
def h1(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("h1_hf_job", JOB)
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    out = tmp_path_factory.mktemp("h1") / "dry.json"
    job.dry(str(out))
    return json.loads(MEASURED.read_text()), json.loads(out.read_text())


def test_the_record_is_three_h200_steps_whose_steady_state_is_steps_2_and_3(h1):
    gpu, _ = h1
    assert gpu["torch"].startswith("2.11.0") and gpu["transformers"] == "5.17.0"
    steps = {s["step"]: (s["max_allocated"], s["max_reserved"]) for s in gpu["steps"]}
    # step 1 has no AdamW states yet (made in its optimizer step): its allocated peak is lower; 2 and 3 are equal
    assert steps[2] == steps[3] == (16_271_020_032, 22_355_640_320)
    assert steps[1][0] < steps[2][0]


def test_h1_dry_run_is_within_the_gpu_bar(h1):
    gpu, dry = h1
    allocated, reserved = gpu["steps"][1]["max_allocated"], gpu["steps"][1]["max_reserved"]
    assert abs(dry["dry_allocated"] - allocated) <= 0.01 * allocated, (dry["dry_allocated"], allocated)
    assert abs(dry["dry_reserved"] - reserved) <= 0.03 * reserved, (dry["dry_reserved"], reserved)
    assert dry["dry_reserved"] >= dry["dry_allocated"] >= dry["dry_peak"] > 0
