"""CSV cell formats, checked on a hand-made trace whose every value is known."""

from __future__ import annotations

import csv
import io

from hyperdryrun.engine import StepTrace
from hyperdryrun.report import blocks_csv
from hyperdryrun.trace.blocks import PERSISTENT_END, Block, Category, Phase
from hyperdryrun.trace.stacks import StackTable


def hand_trace() -> StepTrace:
    stacks = StackTable()
    stacks._frames.append((("/src/model.py", 12, "forward"), ("/src/train.py", 40, "main")))
    stacks._ids[("k",)] = 1
    blocks = [
        Block(
            0,
            2 << 20,
            2 << 20,
            0,
            "initialization",
            Phase.INITIALIZATION,
            "layer",
            0,
            addr=0xF00000000000,
            category=Category.PARAMETER,
            users=[1, 3],
            used_after_alloc=2 << 20,
            peak_after_alloc=2 << 20,
            start_plot=0.5,
        ),
        Block(
            1,
            512,
            100,
            1,
            "mm",
            Phase.FORWARD,
            "layer.fc",
            1,
            addr=0xF00000200000,
            end=3,
            category=Category.ACTIVATION,
            users=[1, 2],
            used_after_alloc=(2 << 20) + 512,
            peak_after_alloc=(2 << 20) + 512,
            start_plot=round(1 + 1 / 3, 12),
            end_plot=round(3 + 1 / 2, 12),
        ),
    ]
    return StepTrace(
        blocks=blocks,
        num_tasks=4,
        task_phase=[Phase.FORWARD] * 4,
        task_op=["a", "mm", "b", "c"],
        peak=(2 << 20) + 512,
        peak_task=1,
        current=2 << 20,
        phase_peak={},
        modules={},
        stacks=stacks,
        initial=2 << 20,
    )


def test_csv_cells_have_the_documented_formats():
    rows = list(csv.DictReader(io.StringIO(blocks_csv(hand_trace()))))
    big, small = rows
    assert big["end_time_stamp"] == str(PERSISTENT_END) == big["end_plot_time_stamp"]
    assert big["is_persistent"] == "True" and big["is_small"] == "False" and big["pool_type"] == "large"
    assert big["user_tasks"] == "{1-3}" and big["last_user_task"] == "3"
    assert big["python_stack"] == "" and big["file_name"] == "" and big["type"] == "Parameter"
    assert big["start_plot_time_stamp"] == "0.500000000000"
    assert (
        small["start_plot_time_stamp"] == "1.333333333333"
        and small["end_plot_time_stamp"] == "3.500000000000"
    )
    assert small["device_addr"] == str(0xF00000200000) and small["stream_id"] == "0"
    assert small["size"] == "512" and small["actual_used_memory"] == str((2 << 20) + 512)
    assert (small["task_name"], small["node_name"], small["graph_name"]) == ("forward", "mm", "layer.fc")
    assert small["producer_task"] == "1" and small["user_tasks"] == "{1-2}"
    assert small["python_stack"] == (
        "File:/src/model.py;Line:12;Function:forward|File:/src/train.py;Line:40;Function:main"
    )
    assert (small["file_name"], small["line_num"]) == ("/src/model.py", "12")
    assert small["is_small"] == "True" and small["is_persistent"] == "False"
