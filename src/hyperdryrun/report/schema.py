"""The report schema, in one place: CSV columns, JSON keys and their version."""

from __future__ import annotations

SCHEMA_VERSION = "1.0"

CSV_COLUMNS = (
    "start_time_stamp",
    "end_time_stamp",
    "start_plot_time_stamp",
    "end_plot_time_stamp",
    "device_addr",
    "stream_id",
    "pool_type",
    "size",
    "actual_used_memory",
    "actual_peak_memory",
    "file_name",
    "line_num",
    "type",
    "producer_task",
    "task_name",
    "node_name",
    "graph_name",
    "user_tasks",
    "last_user_task",
    "python_stack",
    "is_persistent",
    "is_small",
)
"""Memory-block CSV columns, in the order and spelling that existing memory-block viewers read."""

JSON_KEYS = (
    "schema_version",
    "status",
    "metadata",
    "summary",
    "phases",
    "modules",
    "peak_live_set",
    "limitations",
)
ERROR_KEYS = ("schema_version", "status", "stage", "error", "metadata")

CSV_FILE_KEY = "csv_file"
"""The last key of an ok report written with its CSV: ``{"name": "rank_<r>_memory.csv", "bytes": <size>, "sha256":
<hex digest>}`` of the CSV's bytes on disk. A reader that opens the CSV beside a JSON checks both: a mismatch means
that CSV is not this report's (copied in, or left by another write). Absent from error reports, from reports not
written to disk and from reports written before it existed (not in :data:`JSON_KEYS`, which a reader requires)."""

GIB = 1 << 30
MIB = 1 << 20


def human_bytes(nbytes: int) -> str:
    """GiB with two decimals, or MiB below 0.1 GiB (a small model should not read 0.00 GiB everywhere)."""
    if abs(nbytes) >= GIB // 10:
        return f"{nbytes / GIB:,.2f} GiB"
    return f"{nbytes / MIB:,.2f} MiB"


NOT_MODELLED = (
    "caching-allocator reserve and fragmentation are not modelled: figures are allocated bytes (compare with "
    "torch.cuda.max_memory_allocated), not reserved bytes (max_memory_reserved / nvidia-smi)",
    "NCCL communicator buffers and its internal workspaces are not counted",
    "the CUDA context (several hundred MiB per process) is not counted",
    "kernel workspaces (cuBLAS/cuBLASLt, cuDNN, flash-attention split-KV scratch) are not counted",
    "host-side tensors that a real job keeps on the CPU (scalars, the data loader's pinned batches) are counted "
    "as device memory only when the step creates them on the device",
    "collective outputs are allocated as on the target; communication overlap across CUDA streams is "
    "serialised into one stream (stream_id 0)",
)
"""What the dry run does not model; every report states it."""
