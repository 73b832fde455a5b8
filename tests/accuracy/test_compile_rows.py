"""docs/gpu/compile_rows.json: the compiled rows prepared for the first GPU session (issue 27 point 5) are jobs the
configuration accepts, each compiled, and hold no measurement yet (nothing there may be read as ground truth)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_prepared_compiled_rows_are_valid_compiled_jobs_with_no_measurement():
    spec = importlib.util.spec_from_file_location("gpu_calibrate_rows", ROOT / "scripts" / "gpu_calibrate.py")
    cal = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cal)
    record = cal.load_record(ROOT / "docs" / "gpu" / "compile_rows.json")
    rows = cal.record_rows(record)
    assert [name for name, _ in rows] == [
        "c1_8b_fsdp8_compile",
        "c2_8b_fsdp8_compile_op_sac",
        "c3_8b8l_fsdp4_tp2_compile",
    ]
    for name, over in rows:
        cfg = cal.gpu_config(over, "h200")
        assert cfg.training.compile and cfg.target_device == "cuda", name
        assert not {"max_allocated", "max_reserved", "smi_used"} & set(record["rows"][name]), name
    # the command in ACCURACY.md names the option the script has
    parser_text = (ROOT / "scripts" / "gpu_calibrate.py").read_text()
    assert '"--rows-from"' in parser_text
    assert "--rows-from docs/gpu/compile_rows.json" in " ".join(
        (ROOT / "docs" / "ACCURACY.md").read_text().split()
    )


def test_accuracy_md_gives_each_prepared_rows_dry_run_as_it_is_today():
    import re

    spec = importlib.util.spec_from_file_location(
        "gpu_calibrate_rows2", ROOT / "scripts" / "gpu_calibrate.py"
    )
    cal = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cal)
    text = " ".join((ROOT / "docs" / "ACCURACY.md").read_text().split())
    for name, over in cal.record_rows(cal.load_record(ROOT / "docs" / "gpu" / "compile_rows.json")):
        allocated, reserved = re.search(rf"{name[:2]} \([^)]*\) ([\d,]+) / ([\d,]+) B", text).groups()
        dry = cal.dry_figures(cal.gpu_config(over, "h200"))
        assert (dry["dry_allocated"], dry["dry_reserved"]) == (
            int(allocated.replace(",", "")),
            int(reserved.replace(",", "")),
        ), name
