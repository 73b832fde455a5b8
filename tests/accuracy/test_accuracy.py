"""The accuracy suite: every row of the matrix dry-run and measured for real on the CPU; the step peak and every
phase's peak (forward, backward, recompute, optimizer) equal within 1%.

Both sides use CPU allocator semantics (exact bytes). The measured figure compared is the peak without kernel
scratch (blocks a kernel allocates and frees before returning), which a dry run does not model; the full measured
peak is printed beside it. Run with ``-s`` to see the figures.
"""

from __future__ import annotations

import pytest

from hyperdryrun.measure.accuracy import BASE, MATRIX, compare_job, merge

TOLERANCE = 0.01


@pytest.mark.parametrize(("name", "over"), MATRIX, ids=[name for name, _ in MATRIX])
def test_dry_run_peak_matches_the_measured_peak(name, over):
    row = compare_job(name, merge(BASE, over))
    print(
        f"\n{name}: dry {row.dry_peak:,} B, measured {row.measured_peak_without_scratch:,} B without kernel scratch "
        f"({row.measured_peak:,} B with), diff {row.diff:+,} B ({row.rel:+.4%})"
    )
    print("  per phase (dry, measured):", row.phase_peaks)
    assert row.measured_peak >= row.measured_peak_without_scratch
    assert abs(row.rel) <= TOLERANCE, row
    assert row.worst_phase_rel <= TOLERANCE, row.phase_peaks
