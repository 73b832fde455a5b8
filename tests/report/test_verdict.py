"""The capacity verdict knows the model's error: "fits" with margin, "at risk" within it, "OOM" over the capacity.

The job judged here is the hand-made trace of ``test_device_memory`` (a 4 MiB parameter and a 2 MiB activation on one
stream): the caching allocator puts both in one 20 MiB segment (a 1-10 MiB request takes a large segment of
20 MiB, torch 2.13 ``get_allocation_size``), and the device adds the CUDA context, 840 MiB by default (the H200
measurement: nvidia-smi minus max_memory_reserved after a training step, 880,803,840 B in each of six jobs). So its device
peak is 20 + 840 = 860 MiB, worked out by hand; the capacities below are chosen around it.
"""

from __future__ import annotations

import math

import pytest

from hyperdryrun.allocator.verdict import DEVICE_ERROR_FRACTION, Margin, verdict_word
from hyperdryrun.report import build_report
from hyperdryrun.report.console import headline
from hyperdryrun.world.target import DeviceTarget
from tests.report.test_device_memory import hand_trace

MiB, GiB = 2**20, 2**30
DEVICE_PEAK = (20 + 840) * MiB


def test_the_default_margin_is_one_percent_of_the_capacity():
    # docs/ACCURACY.md's GPU table: the largest device difference is 0.15%; the default margin is 1% (see
    # hyperdryrun.allocator.verdict.DEVICE_ERROR_FRACTION for why it is rounded up that far)
    assert DEVICE_ERROR_FRACTION == 0.01
    assert Margin().bytes_for(100 * GiB) == 1 * GiB
    assert Margin(pct=1.5).bytes_for(100 * GiB) == round(1.5 * GiB)
    assert Margin(gib=2).bytes_for(100 * GiB) == 2 * GiB
    assert Margin(gib=0).bytes_for(100 * GiB) == 0


@pytest.mark.parametrize(
    ("peak", "word"),
    [(101, "OOM"), (100, "at risk"), (91, "at risk"), (90, "fits"), (0, "fits")],
)
def test_the_verdict_word_at_the_boundaries(peak, word):
    # capacity 100, margin 10: over 100 is OOM, (90, 100] at risk, 90 and under fits
    assert verdict_word(peak, 100, 10) == word


def test_a_job_inside_the_margin_is_at_risk():
    capacity = 865 * MiB  # 860 MiB is 5 MiB under it; 1% of 865 MiB is 8.65 MiB
    s = build_report(hand_trace(), DeviceTarget(device_memory_gib=capacity / GiB))["summary"]
    assert s["peak_device_bytes"] == DEVICE_PEAK
    assert s["fit"] == "at risk" and s["at_risk"] is True and s["oom"] is False
    assert s["margin_bytes"] == round(0.01 * 865 * MiB) == 9_070_182
    assert s["headroom_bytes"] == 5 * MiB
    assert "DEVICE_ERROR_FRACTION" in s["margin_source"]
    assert s["verdict"].startswith(
        "at risk: device peak 0.84 GiB of 0.844727 GiB, 5.00 MiB headroom, margin 8.65 MiB"
    )
    assert "the real step may not fit" in s["verdict"]
    assert any(line.startswith("[bold yellow]at risk[/] in 0.84 GiB on the device: 5.00 MiB headroom")
               for line in headline(build_report(hand_trace(), DeviceTarget(device_memory_gib=capacity / GiB))))  # fmt: skip


def test_a_zero_margin_judges_the_figure_as_it_is():
    s = build_report(hand_trace(), DeviceTarget(device_memory_gib=865 * MiB / GiB, margin=Margin(gib=0)))[
        "summary"
    ]
    assert (s["fit"], s["margin_bytes"], s["margin_source"]) == ("fits", 0, "--margin-gib 0")


def test_a_capacity_with_room_beyond_the_margin_fits():
    capacity = 900 * MiB  # margin 9 MiB: fits up to 891 MiB
    s = build_report(hand_trace(), DeviceTarget(device_memory_gib=capacity / GiB))["summary"]
    assert (s["fit"], s["oom"], s["at_risk"]) == ("fits", False, False)
    # 2% (18 MiB) fits; 40 MiB puts the line at 860 MiB, the peak itself, which still fits; 41 MiB is at risk
    for margin, word in (
        (Margin(pct=2), "fits"),
        (Margin(gib=40 / 1024), "fits"),
        (Margin(gib=41 / 1024), "at risk"),
    ):
        assert (
            build_report(hand_trace(), DeviceTarget(device_memory_gib=capacity / GiB, margin=margin))[
                "summary"
            ]["fit"]
            == word
        )


def test_under_the_device_peak_is_oom_and_says_when_it_is_within_the_error():
    s = build_report(hand_trace(), DeviceTarget(device_memory_gib=852 * MiB / GiB))[
        "summary"
    ]  # 8 MiB short; margin 8.52 MiB
    assert (s["fit"], s["oom"], s["at_risk"]) == ("OOM", True, False)
    assert s["headroom_bytes"] == -8 * MiB
    assert "within the model's error" in s["verdict"]
    far = build_report(hand_trace(), DeviceTarget(device_memory_gib=100 * MiB / GiB))["summary"]
    assert far["fit"] == "OOM" and "within the model's error" not in far["verdict"]


def test_a_cpu_target_judges_allocated_bytes_with_the_same_margin():
    trace = hand_trace()
    trace.metadata = {}  # no CUDA target: allocated bytes only (peak 6 MiB)
    s = build_report(trace, DeviceTarget(device_memory_gib=6.05 / 1024))[
        "summary"
    ]  # 6.05 MiB capacity, margin 0.0605 MiB: 6 MiB is within it
    assert (s["fit"], s["peak_bytes"]) == ("at risk", 6 * MiB)
    assert build_report(trace, DeviceTarget(device_memory_gib=7 / 1024))["summary"]["fit"] == "fits"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"gib": -1}, "--margin-gib: must be a number from 0 to 1,048,576 (got -1)"),
        ({"gib": math.nan}, "--margin-gib: must be a number from 0 to 1,048,576 (got nan)"),
        ({"pct": math.inf}, "--margin-pct: must be a number from 0 to 100 (got inf)"),
        ({"pct": 150}, "--margin-pct: must be a number from 0 to 100 (got 150)"),
        ({"gib": 1, "pct": 2}, "margin: give --margin-gib (1) or --margin-pct (2), not both"),
    ],
)
def test_bad_margins_are_one_line_errors(kwargs, message):
    with pytest.raises(ValueError) as info:
        Margin(**kwargs)
    assert str(info.value) == message
