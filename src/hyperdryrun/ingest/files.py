"""What every reader of a recorded file shares: the one-line :class:`IngestError`, which recorded frames are user
code, the :data:`LIMITS` on what one input may cost, and reading a file's bytes, (gzipped) JSON and a CUDA snapshot
pickle within those limits and without running foreign code."""

from __future__ import annotations

import io
import json
import os
import pickle
import stat
import sysconfig
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PICKLE_MAGIC = b"\x80"
GZIP_MAGIC = b"\x1f\x8b"
_STDLIB = sysconfig.get_paths()["stdlib"].replace("\\", "/").rstrip("/") + "/"


class IngestError(ValueError):
    """A file that cannot be read as a memory picture: ``<file>: <what is wrong>`` on one line."""

    def __init__(self, source: str | os.PathLike, problem: str) -> None:
        super().__init__(f"{source}: {' '.join(str(problem).split())}")
        self.source, self.problem = str(source), problem


def user_file(filename: str) -> bool:
    """Whether a recorded frame's file is user code (not torch, the interpreter, C++ or hyperdryrun machinery).

    Traces store paths relative to ``sys.path`` entries (``torch/nn/modules/module.py``) or absolute ones.
    """
    f = filename.replace("\\", "/")
    if os.path.isabs(f) and f.startswith(_STDLIB) and "-packages/" not in f:
        return False
    if f and not os.path.isabs(f) and os.path.exists(_STDLIB + f):
        return False  # traces name files relative to their sys.path entry: one found in the stdlib is
    if not f or f.startswith(("<", "??")) or f.endswith((".cpp", ".h", ".cu", ".cc", ".hpp")):
        return False
    if f.startswith("torch/") or "/torch/" in f or "/_pytest/" in f or "/pluggy/" in f:
        return False
    if f.startswith("hyperdryrun/") or "/hyperdryrun/" in f:
        return "hyperdryrun/models/" in f
    return True


class _NoObjects(pickle.Unpickler):
    """A snapshot is dicts, lists, strings and numbers: refuse any class, so a foreign pickle runs no code."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"it references {module}.{name}")


def shown(value: str, most: int = 40) -> str:
    """``repr(value)``, cut to about ``most`` characters with the length said: a hostile value stays a short line."""
    text = repr(value)
    return text if len(text) <= most else f"{text[: most - 10]}...' ({len(value):,} characters)"


@dataclass(frozen=True)
class Limit:
    """A bound on what one input may cost (its size, nesting, entries), raised by its environment variable."""

    env: str
    default: int
    meaning: str

    def value(self, environ: Mapping[str, str] | None = None) -> int:
        """The limit in force: ``$<env>`` when set (a positive integer), else the default."""
        raw = (os.environ if environ is None else environ).get(self.env, "").strip()
        if not raw:
            return self.default
        try:
            value = int(raw)
        except ValueError:
            value = 0
        if value < 1:
            raise ValueError(
                f"{self.env}={shown(raw)} must be a positive integer (the limit on {self.meaning})"
            )
        return value

    def of(self, source: str | os.PathLike) -> int:
        """:meth:`value`, a malformed variable being an :class:`IngestError` of ``source``."""
        try:
            return self.value()
        except ValueError as err:
            raise IngestError(source, str(err)) from None

    @property
    def hint(self) -> str:
        return f"{self.env} raises it"


INPUT_BYTES = Limit("HYPERDRYRUN_MAX_INPUT_BYTES", 1 << 30, "the size of a file read")
CONFIG_BYTES = Limit("HYPERDRYRUN_MAX_CONFIG_BYTES", 1 << 20, "the size of a --config job file")
DECOMPRESSED_BYTES = Limit(
    "HYPERDRYRUN_MAX_DECOMPRESSED_BYTES", 1 << 30, "the size of a .gz file decompressed"
)
NESTING = Limit("HYPERDRYRUN_MAX_NESTING", 64, "the nesting depth of JSON and YAML")
YAML_NODES = Limit("HYPERDRYRUN_MAX_YAML_NODES", 100_000, "the nodes of a YAML file, its aliases expanded")
SNAPSHOT_ENTRIES = Limit(
    "HYPERDRYRUN_MAX_SNAPSHOT_ENTRIES", 5_000_000, "the trace entries, segments and blocks of a CUDA snapshot"
)
FRAME_REFERENCES = Limit(
    "HYPERDRYRUN_MAX_FRAME_REFERENCES", 20_000_000, "the stack frames of a CUDA snapshot's entries, added up"
)
TASKS_PER_ROW = Limit("HYPERDRYRUN_MAX_TASKS_PER_ROW", 1024, "the tasks a memory-block CSV spans per row")
SPAN_DEPTH = Limit("HYPERDRYRUN_MAX_SPAN_DEPTH", 4096, "the nesting of a Chrome trace's spans on one thread")
LIMITS = (
    INPUT_BYTES,
    CONFIG_BYTES,
    DECOMPRESSED_BYTES,
    NESTING,
    YAML_NODES,
    SNAPSHOT_ENTRIES,
    FRAME_REFERENCES,
    TASKS_PER_ROW,
    SPAN_DEPTH,
)
"""Every limit on hostile or runaway input: what reading one file may cost before it is refused on one line."""


INT_LIMIT = 1 << 64
"""No byte count, address, task index or timestamp of a real step reaches 2**64 (torch counts in int64/uint64): a
larger integer in an input is refused where it is read, before arithmetic on it could overflow a float."""
_INT_DIGITS = len(str(INT_LIMIT))


def bounded_int(text: str) -> int:
    """``int(text)`` for an integer of an input file: a ValueError (naming it shortly) when it is not one, or when
    its magnitude is 2**64 or more, checked on its length first (Python refuses to convert beyond 4,300 digits, and
    converting a long one is quadratic)."""
    body = text.strip()
    body = body[1:] if body[:1] in "+-" else body
    if not (
        body.isascii() and body.isdigit()
    ):  # Python's int() also takes '1_000' and '١' (Arabic-Indic one)
        raise ValueError(f"{shown(text)} is not an integer (ASCII digits 0-9)")
    digits = body.lstrip("0")
    if len(digits) > _INT_DIGITS or abs(value := int(text)) >= INT_LIMIT:
        cut = text if len(text) <= 30 else f"{text[:20]}... ({len(text):,} characters)"
        raise ValueError(f"integer {cut} is out of range (magnitude 2**64 or more)")
    return value


def check_int_range(value: int, where: str) -> None:
    """A ValueError naming ``where`` when the integer ``value`` of an input is out of :data:`INT_LIMIT`."""
    if not -INT_LIMIT < value < INT_LIMIT:
        raise ValueError(f"{where}: integer of {len(str(abs(value)))} digits is out of range (2**64 or more)")


def read_bytes(path: Path, limit: Limit = INPUT_BYTES) -> bytes:
    """The bytes of ``path``, at most ``limit`` of them; a missing, directory, unreadable or too large path is an
    :class:`IngestError` naming it (a device such as /dev/zero is read only up to the limit)."""
    cap = limit.of(path)
    try:
        st = path.stat()
    except FileNotFoundError:
        raise IngestError(path, "no such file") from None
    except OSError as err:
        raise IngestError(path, f"cannot read: {err.strerror or err}") from None
    if stat.S_ISDIR(st.st_mode):
        raise IngestError(path, "is a directory, not a file")
    too_large = f"is larger than the limit of {cap} B ({limit.hint})"
    if stat.S_ISREG(st.st_mode) and st.st_size > cap:
        raise IngestError(path, too_large)
    try:
        with open(path, "rb") as f:
            raw = f.read(cap + 1)
    except OSError as err:
        raise IngestError(path, f"cannot read: {err.strerror or err}") from None
    if len(raw) > cap:
        raise IngestError(path, too_large)
    return raw


def gunzip(path: Path, raw: bytes) -> bytes:
    """The decompressed bytes of the gzip data ``raw`` (every member), refused past :data:`DECOMPRESSED_BYTES`."""
    cap = DECOMPRESSED_BYTES.of(path)
    out = bytearray()
    rest = raw
    while rest:
        if rest[:2] != GZIP_MAGIC:
            if out and not rest.strip(b"\0"):
                break  # zero padding after the last member, as gzip writes on some tapes and as gzip(1) accepts
            raise IngestError(path, "corrupt gzip data (trailing bytes after the compressed data)")
        d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        try:
            out += d.decompress(rest, cap + 1 - len(out))
        except zlib.error as err:
            raise IngestError(path, f"corrupt gzip data ({err})") from None
        if len(out) > cap:
            raise IngestError(path, f"decompresses to more than {cap} B ({DECOMPRESSED_BYTES.hint})")
        if not d.eof:
            raise IngestError(path, "corrupt gzip data (truncated)")
        rest = d.unused_data
    return bytes(out)


def nested_deeper_than(data: Any, depth: int) -> bool:
    """Whether lists/dicts in ``data`` nest more than ``depth`` levels (iterative: no recursion to overflow)."""
    stack = [(data, 1)]
    while stack:
        node, level = stack.pop()
        children = node.values() if isinstance(node, dict) else node
        if level > depth:
            return True
        stack.extend((c, level + 1) for c in children if isinstance(c, dict | list))
    return False


def read_json(path: Path, raw: bytes) -> Any:
    """The JSON document in ``raw`` (the bytes of ``path``, gzipped or not); unparsable, or nested deeper than
    :data:`NESTING`, is an :class:`IngestError`."""
    if raw[:2] == GZIP_MAGIC:
        raw = gunzip(path, raw)
    if not raw.strip():
        raise IngestError(path, "empty file")
    depth = NESTING.of(path)
    too_deep = f"nested deeper than {depth} levels ({NESTING.hint})"
    try:
        data = json.loads(raw, parse_int=bounded_int)
    except UnicodeDecodeError:
        raise IngestError(path, "not UTF-8 text (neither JSON nor CSV)") from None
    except RecursionError:
        raise IngestError(path, too_deep) from None
    except json.JSONDecodeError as err:
        raise IngestError(
            path, f"invalid or truncated JSON at line {err.lineno} column {err.colno}"
        ) from None
    except ValueError as err:  # bounded_int: a number no step has
        raise IngestError(path, str(err)) from None
    if isinstance(data, dict | list) and nested_deeper_than(data, depth):
        raise IngestError(path, too_deep)
    return data


def read_snapshot(path: Path, raw: bytes) -> Any:
    """The CUDA snapshot pickle in ``raw`` (the bytes of ``path``), unpickled with every class refused, its fields
    checked against the documented types and its size against :data:`SNAPSHOT_ENTRIES` and
    :data:`FRAME_REFERENCES`."""
    try:
        data = _NoObjects(io.BytesIO(raw)).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError) as err:
        raise IngestError(path, f"not a CUDA memory snapshot pickle ({err})") from None
    except (RecursionError, MemoryError) as err:
        raise IngestError(path, f"not a CUDA memory snapshot pickle ({type(err).__name__})") from None
    check_snapshot_fields(data, str(path))
    return data


# The fields of torch.cuda.memory._snapshot() (torch 2.13 torch/cuda/memory.py, the _snapshot docstring) that
# readers use, with their documented types; each may be absent unless listed as required.
_SEGMENT_INTS = (
    "device",
    "address",
    "total_size",
    "allocated_size",
    "active_size",
    "requested_size",
    "stream",
)
_BLOCK_INTS = ("address", "size", "requested_size")
_ENTRY_INTS = ("addr", "size", "stream", "device_free", "time_us")
_SIZES = frozenset({"total_size", "allocated_size", "active_size", "requested_size", "size"})
_ENTRY_ADDRESSED = frozenset({"alloc", "free_requested", "free_completed"})


def _typed(value: Any, want: type) -> bool:
    return isinstance(value, want) and not (want is int and isinstance(value, bool))


_TYPE_NAME = {int: "an integer", str: "a string", list: "a list", dict: "an object"}


def _need(source: str, where: str, value: Any, want: type) -> None:
    if not _typed(value, want):
        raise IngestError(source, f"{where} must be {_TYPE_NAME[want]} (got {_short(value)})")


def _short(value: Any) -> str:
    text = repr(value) if isinstance(value, int | float | str | bool | None) else type(value).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def _fields(
    source: str, where: str, record: dict[str, Any], ints: tuple[str, ...], strs: tuple[str, ...]
) -> None:
    for key in ints:
        if key in record:
            _need(source, f"{where}.{key}", record[key], int)
            if not -INT_LIMIT < record[key] < INT_LIMIT:
                raise IngestError(source, f"{where}.{key} is out of range (2**64 or more)")
            if key in _SIZES and record[key] < 0:
                raise IngestError(source, f"{where}.{key} must be >= 0 (got {record[key]})")
    for key in strs:
        if key in record:
            _need(source, f"{where}.{key}", record[key], str)


def check_snapshot_fields(data: Any, source: str) -> None:
    """Raise a one-line :class:`IngestError` unless ``data`` is a snapshot whose segments, blocks, trace entries
    and frames have the documented types and whose size is within the limits. Frame lists shared by many entries
    (a pickle stores a shared object once) are checked once but counted at every use."""
    if not isinstance(data, dict) or not isinstance(data.get("segments"), list):
        raise IngestError(source, "not a CUDA memory snapshot (no 'segments' list)")
    segments, traces = data["segments"], data.get("device_traces")
    if not isinstance(traces, list):
        raise IngestError(source, "not a CUDA memory snapshot (no 'device_traces' list of lists)")
    # Count first, from the lists' lengths (every use of a list the pickle shares counts: readers walk each use),
    # so that a small pickle of shared references is refused before anything is walked.
    entry_limit = SNAPSHOT_ENTRIES.of(source)
    entries = len(segments) + len(traces)
    if entries > entry_limit:
        raise IngestError(
            source, f"has {entries} entries, more than the limit of {entry_limit} ({SNAPSHOT_ENTRIES.hint})"
        )
    for i, seg in enumerate(segments):
        _need(source, f"segments[{i}]", seg, dict)
        blocks = seg.get("blocks", [])
        _need(source, f"segments[{i}].blocks", blocks, list)
        entries += len(blocks)
    for d, trace in enumerate(traces):
        _need(source, f"device_traces[{d}]", trace, list)
        entries += len(trace)
    if entries > entry_limit:
        raise IngestError(
            source, f"has {entries} entries, more than the limit of {entry_limit} ({SNAPSHOT_ENTRIES.hint})"
        )
    records: list[tuple[str, Any]] = []  # (where, frames) of every block and entry
    walked: set[int] = set()  # a shared segment, block list or trace is checked once
    for i, seg in enumerate(segments):
        where = f"segments[{i}]"
        if id(seg) in walked:
            continue
        walked.add(id(seg))
        for key in ("address", "total_size"):  # torch writes both; the replay and the peak key on them
            if key not in seg:
                raise IngestError(source, f"{where} lacks {key}")
        _fields(source, where, seg, _SEGMENT_INTS, ("segment_type",))
        blocks = seg.get("blocks", [])
        if id(blocks) in walked:
            continue
        walked.add(id(blocks))
        for j, blk in enumerate(blocks):
            bw = f"{where}.blocks[{j}]"
            _need(source, bw, blk, dict)
            if "size" not in blk or "address" not in blk:
                raise IngestError(source, f"{bw} lacks {'size' if 'size' not in blk else 'address'}")
            _fields(source, bw, blk, _BLOCK_INTS, ("state",))
            records.append((bw, blk.get("frames")))
    for d, trace in enumerate(traces):
        if id(trace) in walked:
            continue
        walked.add(id(trace))
        for i, e in enumerate(trace):
            where = f"device_traces[{d}][{i}]"
            _need(source, where, e, dict)
            if "action" not in e:
                raise IngestError(source, f"{where} lacks action")
            _fields(source, where, e, _ENTRY_INTS, ("action",))
            if e["action"] in _ENTRY_ADDRESSED and not ("addr" in e and "size" in e):
                raise IngestError(source, f"{where} ({e['action']}) lacks integer addr/size")
            records.append((where, e.get("frames")))
    references = 0
    for where, frames in records:
        if frames is not None:
            _need(source, f"{where}.frames", frames, list)
            references += len(frames)
    ref_limit = FRAME_REFERENCES.of(source)
    if references > ref_limit:
        raise IngestError(
            source,
            f"has {references} frame references, more than the limit of {ref_limit} ({FRAME_REFERENCES.hint})",
        )
    seen: set[int] = set()
    for where, frames in records:
        if frames is None or id(frames) in seen:
            continue
        seen.add(id(frames))
        for k, f in enumerate(frames):
            fw = f"{where}.frames[{k}]"
            _need(source, fw, f, dict)
            _fields(source, fw, f, ("line",), ("filename", "name"))
