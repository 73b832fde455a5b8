"""Read memory pictures back: a HyperDryRun JSON report (with its CSV beside it), a memory-block CSV, or through
:mod:`hyperdryrun.ingest` a profiler Chrome trace (``.json`` / ``.json.gz``) or a CUDA snapshot pickle.

Every failure is one :class:`~hyperdryrun.ingest.files.IngestError` whose message is one line naming the file and
what is wrong; loading never writes anything.
"""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hyperdryrun.ingest.chrome import trace_from_chrome
from hyperdryrun.ingest.events import FrameTable
from hyperdryrun.ingest.files import (
    GZIP_MAGIC,
    PICKLE_MAGIC,
    TASKS_PER_ROW,
    IngestError,
    bounded_int,
    gunzip,
    read_bytes,
    read_json,
    read_snapshot,
)
from hyperdryrun.ingest.snapshot import trace_from_snapshot
from hyperdryrun.report.build import block_record
from hyperdryrun.report.schema import CSV_COLUMNS, CSV_FILE_KEY, JSON_KEYS
from hyperdryrun.trace.blocks import PERSISTENT_END, Block, Category, Phase, live_bytes_by_task
from hyperdryrun.trace.step import StepTrace


def _is_report(data: Any) -> bool:
    return isinstance(data, dict) and "schema_version" in data and "status" in data


def _is_chrome(data: Any) -> bool:
    if isinstance(data, dict):
        return isinstance(data.get("traceEvents"), list)
    return isinstance(data, list) and bool(data) and all(isinstance(e, dict) and "ph" in e for e in data[:50])


_NULL = type(None)
# The report fields that readers use (compare, the pictures), with their types: a report whose field has another
# type is refused naming the field. ``?`` marks a key that may be absent; ``{str: spec}`` is a mapping of any keys;
# ``[spec]`` a list. Other keys are not checked.
_BLOCK_FIELDS = {
    "size": int,
    "?id": int,
    "?requested": int,
    "?start": int,
    "?end": (int, _NULL),
    "?category": (str, _NULL),
    "?op": (str, _NULL),
    "?module": (str, _NULL),
    "?phase": (str, _NULL),
    "?stack": [{"file": str, "line": int, "function": str}],
}
_PEAK_FIELDS = {"?peak_bytes": (int, _NULL), "?breakdown_at_peak": {str: int}}
REPORT_FIELDS: dict[str, Any] = {
    "metadata": {
        "?kernel_scratch": (dict, _NULL),
        "?mode": (str, _NULL),
        "?rank": (int, _NULL),
        "?cuda": (dict, _NULL),
    },
    "summary": {
        "peak_bytes": int,
        "?peak_task": int,
        "?peak_phase": (str, _NULL),
        "?peak_op": (str, _NULL),
        "breakdown_at_peak": {str: int},
        "?current_bytes": int,
        "?breakdown_after_step": {str: int},
        "?initial_bytes": (int, _NULL),
        "?capacity_bytes": (int, _NULL),
        "?peak_reserved_bytes": int,
        "?fragmentation_bytes": (int, _NULL),
        "?segments_by_pool": [{"pool": str, "stream": (int, _NULL), "segments": int, "bytes": int}],
    },
    "phases": {str: _PEAK_FIELDS},
    "modules": [{"fqn": str, "?forward_peak_bytes": (int, _NULL), "?backward_peak_bytes": (int, _NULL)}],
    "peak_live_set": {"num_blocks": int, "shown": int, "blocks": [_BLOCK_FIELDS]},
    "limitations": [str],
}
_KIND = {
    int: "an integer",
    str: "a string",
    float: "a number",
    list: "a list",
    dict: "an object",
    _NULL: "null",
}


def _value_text(value: Any) -> str:
    text = repr(value) if isinstance(value, int | float | str | bool | None) else type(value).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def check_fields(source: str, where: str, value: Any, spec: Any) -> None:
    """Raise a one-line :class:`IngestError` naming the first field of ``value`` that does not fit ``spec`` (see
    :data:`REPORT_FIELDS`)."""
    if isinstance(spec, dict):
        if not isinstance(value, dict):
            raise IngestError(source, f"{where} must be an object (got {_value_text(value)})")
        if list(spec) == [str]:
            for key, item in value.items():
                check_fields(source, f"{where}.{key}", item, spec[str])
            return
        for key, sub in spec.items():
            name = key.lstrip("?")
            if name in value:
                check_fields(source, f"{where}.{name}" if where else name, value[name], sub)
            elif not key.startswith("?"):
                raise IngestError(source, f"{where or 'report'} lacks {name}")
    elif isinstance(spec, list):
        if not isinstance(value, list):
            raise IngestError(source, f"{where} must be a list (got {_value_text(value)})")
        for i, item in enumerate(value):
            check_fields(source, f"{where}[{i}]", item, spec[0])
    else:
        kinds = spec if isinstance(spec, tuple) else (spec,)
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            want = " or ".join(_KIND[k] for k in kinds)
            raise IngestError(source, f"{where} must be {want} (got {_value_text(value)})")


def load_report(path: Path, data: dict[str, Any]) -> dict[str, Any]:
    """A report dict; with its CSV beside it, ``peak_live_set`` holds every block alive at the peak (from the CSV,
    checked against the JSON's peak) so a comparison sees the whole live set, not the first ``live_set_limit``."""
    if data.get("status") == "error":
        err = data.get("error") or {}
        raise IngestError(path, f"an error report (stage {data.get('stage')}: {err.get('message', '?')})")
    missing = [k for k in JSON_KEYS if k not in data]
    if missing:
        raise IngestError(path, f"report lacks {', '.join(missing)}")
    check_fields(str(path), "", data, REPORT_FIELDS)
    summary = data["summary"]
    csv_path = path.with_suffix(".csv")
    if not csv_path.exists():
        return data
    trace = load_csv(csv_path, _own_csv_text(csv_path, data.get(CSV_FILE_KEY)))
    peak_task = summary.get("peak_task", -1)
    at_peak = [b for b in trace.blocks if b.start <= peak_task < b.end] if peak_task >= 0 else []
    total = sum(b.size for b in at_peak)
    if total != summary["peak_bytes"]:
        raise IngestError(
            csv_path,
            f"blocks alive at task {peak_task} sum to {total} B, the report's peak is {summary['peak_bytes']} B",
        )
    ranked = sorted(at_peak, key=lambda b: (-b.size, b.id))
    out = dict(data)
    out["peak_live_set"] = {
        **data["peak_live_set"],
        "num_blocks": len(at_peak),
        "total_bytes": total,
        "shown": len(ranked),
        "rest_bytes": 0,
        "blocks": [block_record(trace, b) for b in ranked],
    }
    return out


def _own_csv_text(csv_path: Path, expected: Any) -> str | None:
    """The CSV's text when the report names its CSV (size and sha256, written with it as a pair) and this is it;
    an error when the file beside the JSON is another one (e.g. a newer CSV beside an older JSON)."""
    if expected is None:  # a report written before the pair carried the CSV's hash
        return None
    import hashlib

    if not isinstance(expected, dict) or not isinstance(expected.get("sha256"), str):
        raise IngestError(
            csv_path.with_suffix(".json"), f"{CSV_FILE_KEY} must name the CSV's bytes and sha256"
        )
    raw = read_bytes(csv_path)
    digest = hashlib.sha256(raw).hexdigest()
    if len(raw) != expected.get("bytes") or digest != expected["sha256"]:
        raise IngestError(
            csv_path,
            f"is not the CSV its report was written with ({len(raw)} B, sha256 {digest[:12]}; the report names "
            f"{expected.get('bytes')} B, sha256 {expected['sha256'][:12]})",
        )
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise IngestError(csv_path, "not UTF-8 text (not a memory-block CSV)") from None


def load_csv(path: Path, text: str | None = None) -> StepTrace:
    """A memory-block CSV alone -> StepTrace (see :func:`trace_from_csv`)."""
    if text is None:
        raw = read_bytes(path)
        try:
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError:
            raise IngestError(path, "not UTF-8 text (not a memory-block CSV)") from None
    return trace_from_csv(csv.reader(io.StringIO(text)), str(path))


def _stack(text: str) -> tuple[tuple[str, int, str], ...]:
    frames = []
    for part in text.split("|") if text else ():
        fields = dict(kv.split(":", 1) for kv in part.split(";", 2))
        frames.append((fields["File"], bounded_int(fields["Line"]), fields["Function"]))
    return tuple(frames)


def _int(row: list[str], column: int) -> int:
    """An integer cell, with the column named when it is not one."""
    try:
        return bounded_int(row[column])
    except ValueError as err:
        raise ValueError(f"{CSV_COLUMNS[column]}: {err}") from None


def _count(row: list[str], column: int) -> int:
    """A non-negative integer cell (a task index or a size), with the column named when it is not."""
    value = _int(row, column)
    if value < 0:
        raise ValueError(f"{CSV_COLUMNS[column]} must be >= 0 (got {value})")
    return value


def _block_of_row(row: list[str], block_id: int, stacks: FrameTable) -> Block:
    """One CSV row as a Block; ValueError naming the cell when the row cannot be a block."""
    if len(row) != len(CSV_COLUMNS):
        raise ValueError(f"{len(row)} fields, expected {len(CSV_COLUMNS)}")
    users = row[17].strip("{}")
    start, end, size = _count(row, 0), _count(row, 1), _count(row, 7)
    if end < start:
        raise ValueError(f"the block ends at task {end} (end_time_stamp), before it starts at task {start}")
    tasks = [bounded_int(u) for u in users.split("-")] if users else []
    if any(t < 0 for t in tasks):
        raise ValueError(f"user_tasks must be task indices >= 0 (got {row[17]!r})")
    return Block(
        id=block_id,
        size=size,
        requested=size,
        start=start,
        op=row[15],
        phase=Phase(row[14]),
        module=row[16],
        stack_id=stacks.intern(_stack(row[19])),
        addr=_int(row, 4),
        end=end,
        category=Category(row[12]),
        users=tasks,
        used_after_alloc=_int(row, 8),
        peak_after_alloc=_int(row, 9),
        start_plot=float(row[2]),
        end_plot=float(row[3]),
        stream=_int(row, 5),
    )


def trace_from_csv(rows: Iterable[list[str]], source: str) -> StepTrace:
    """Blocks from a memory-block CSV, and the tasks, peak and phase peaks rebuilt from their lifetimes.

    Exact: blocks, live bytes per task, the peak and the live set at any task. Approximate: the CSV names the op
    and phase of allocating tasks only, so a task that allocates nothing takes those of the latest task before it
    (a phase peak at such a task may land in the phase before); per-module statistics and micro batches are not in
    the CSV and stay empty / 0.
    """
    it = iter(rows)
    try:
        header = next(it, None)
    except csv.Error as err:
        raise IngestError(source, f"line 1: {err}") from None
    if header is None:
        raise IngestError(source, "empty file")
    if tuple(header) != CSV_COLUMNS:
        raise IngestError(source, f"not a memory-block CSV (header starts {','.join(header[:3])!r})")
    stacks = FrameTable()
    blocks: list[Block] = []
    n = 1
    try:
        for n, row in enumerate(it, start=2):
            if not row:
                continue
            try:
                blocks.append(_block_of_row(row, len(blocks), stacks))
            except (ValueError, KeyError, IndexError) as err:
                raise IngestError(source, f"line {n}: {err}") from None
    except csv.Error as err:
        raise IngestError(source, f"line {n + 1}: {err}") from None
    if not blocks:
        raise IngestError(source, "no blocks (header only)")
    last = 0
    for b in blocks:
        last = max(last, b.start, *(b.users or [0]), b.end - 1 if b.end != PERSISTENT_END else 0)
    num_tasks = last + 1
    per_row = TASKS_PER_ROW.of(source)
    if num_tasks > per_row * len(blocks):
        raise IngestError(
            source,
            f"spans {num_tasks} tasks with {len(blocks)} rows, more than the limit of {per_row} per row "
            f"({TASKS_PER_ROW.hint})",
        )
    task_op: list[str | None] = [None] * num_tasks
    task_phase: list[Phase | None] = [None] * num_tasks
    for b in blocks:
        if b.phase is not Phase.INITIALIZATION and task_op[b.start] is None:
            task_op[b.start], task_phase[b.start] = b.op, b.phase
    op, phase = "initialization", Phase.INITIALIZATION
    for t in range(num_tasks):
        if task_op[t] is None:
            task_op[t], task_phase[t] = op, phase
        op, phase = task_op[t], task_phase[t]
    live = live_bytes_by_task(blocks, num_tasks)
    peak = max(live)
    phase_peak: dict[Phase, int] = {}
    for ph, nbytes in zip(task_phase, live, strict=True):
        phase_peak[ph] = max(phase_peak.get(ph, 0), nbytes)
    return StepTrace(
        blocks=blocks,
        num_tasks=num_tasks,
        task_phase=task_phase,  # type: ignore[arg-type]
        task_op=task_op,  # type: ignore[arg-type]
        peak=peak,
        peak_task=live.index(peak),
        current=sum(b.size for b in blocks if b.persistent),
        phase_peak=phase_peak,
        modules={},
        stacks=stacks,
        initial=sum(b.size for b in blocks if b.phase is Phase.INITIALIZATION),
        metadata={"mode": "ingested", "source_kind": "block_csv", "source": source},
        limitations=[
            "from a memory-block CSV alone: no per-module statistics; phases of tasks that allocate "
            "nothing are inferred"
        ],
    )


def load_any(path: str | os.PathLike, device: str | None = None) -> StepTrace | dict[str, Any]:
    """The memory picture in ``path``: a report dict for a HyperDryRun JSON report, a StepTrace otherwise.

    The kind comes from the content (pickle or gzip magic, JSON shape, CSV header), not the file name.
    ``device`` picks one device of a multi-device trace or snapshot (default: the accelerator with most events).
    """
    p = Path(path)
    raw = read_bytes(p)
    if not raw:
        raise IngestError(p, "empty file")
    if raw[:2] == GZIP_MAGIC:
        raw = gunzip(p, raw)  # a gzipped snapshot (``snapshot.pickle.gz``) as well as a ``.json.gz`` trace
    if raw[:1] == PICKLE_MAGIC:
        return trace_from_snapshot(read_snapshot(p, raw), str(p), device)
    # JSON may follow a UTF-8 byte-order mark (json.loads reads it)
    head = raw.removeprefix(b"\xef\xbb\xbf").lstrip()[:1]
    if head in (b"{", b"["):
        data = read_json(p, raw)
        if _is_report(data):
            return load_report(p, data)
        if _is_chrome(data):
            return trace_from_chrome(data, str(p), device)
        raise IngestError(p, "JSON that is neither a HyperDryRun report nor a Chrome trace")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise IngestError(p, "unrecognised file (not JSON, CSV or a snapshot pickle)") from None
    if not text.strip():
        raise IngestError(p, "empty file")
    if "," not in text.lstrip().partition("\n")[0]:
        # no comma in its first line: not a CSV at all (a damaged snapshot, say), so not the CSV reader's complaint
        first = text.lstrip()[:24]
        raise IngestError(p, f"unrecognised file (not JSON, CSV or a snapshot pickle): starts {first!r}")
    return load_csv(p, text)
