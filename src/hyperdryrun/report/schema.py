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

SEGMENT_CSV_COLUMNS = (
    "segment_address",
    "segment_size",
    "stream_id",
    "stream_name",
    "pool_type",
    "is_expandable",
    "block_address",
    "block_size",
    "block_state",
    "block_id",
    "requested_size",
    "type",
    "node_name",
)
"""Segment CSV columns (``rank_<r>_segments.csv``, CUDA targets): one row per block of every segment the caching
allocator holds at its reserved peak, as ``torch.cuda.memory_snapshot()`` lists them. ``block_state``:
``allocated``, ``free`` (cached) or ``pending`` (freed, waiting for uses on other streams); ``block_id``: the row of
the memory-block CSV (its block id), empty for a free block or a runtime allocation; ``type``: the block's category,
or the runtime allocation it is (``cuBLAS workspace``); ``node_name``: the op that allocated it."""

SUMMARY_DEVICE_KEYS = (
    "peak_allocated_bytes",
    "peak_reserved_bytes",
    "peak_device_bytes",
    "peak_reserved_task",
    "peak_reserved_phase",
    "allocated_at_reserved_peak_bytes",
    "fragmentation_bytes",
    "reserved_breakdown",
    "segments_by_pool",
    "device_lines",
    "allocator",
)
"""Keys ``summary`` gains for a CUDA target: ``peak_allocated_bytes`` (compare with torch.cuda.max_memory_allocated:
tensors as the allocator sizes them and cuBLAS workspaces), ``peak_reserved_bytes`` (max_memory_reserved),
``peak_device_bytes`` (nvidia-smi: reserved, NCCL buffers, CUDA context), where the reserved peak is and what is
allocated there, ``fragmentation_bytes`` (reserved minus allocated at the reserved peak), ``reserved_breakdown``
(the reserved peak by cause, stream and pool, adding up to it), ``segments_by_pool`` (segments per stream and pool
at the reserved peak), ``device_lines`` (the device peak as lines adding up to it; the verdict accumulates them in
this order) and ``allocator`` (settings, their source, cudaMalloc calls, cache releases)."""

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


NOT_MODELLED_CUDA = (
    "cuDNN, flash-attention and other kernel workspaces are not counted; cuBLAS workspaces are (device_lines)",
    "NCCL buffers are an estimate (metadata.cuda.nccl: its formula and settings) and the CUDA context a configured "
    "figure (metadata.cuda.cuda_context)",
    "the caching allocator replays this one step from an empty cache after the tensors that live before it: the "
    "segments an earlier step leaves cached, CUDA graphs and private memory pools are not replayed",
    "host-side tensors that a real job keeps on the CPU (scalars, the data loader's pinned batches) are counted "
    "as device memory only when the step creates them on the device",
    "NCCL runs collectives on its internal stream and (TORCH_NCCL_AVOID_RECORD_STREAMS, torch 2.13's default) "
    "keeps their tensors until the work is waited on; on the fake process group work completes at once, so such "
    "a tensor is freed when the program drops it",
)
"""What a CUDA target's report does not model, beside the allocator model and runtime costs it does."""

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
