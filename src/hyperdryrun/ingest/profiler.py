"""A live ``torch.profiler.profile`` (``profile_memory=True``, ideally ``with_stack=True``) -> allocation events.

Reads torch 2.13's in-process event tree (``prof.profiler.kineto_results.experimental_event_tree()``): every
allocation and free with its allocation id, pointer, size and device, nested under the ops and Python calls that
made it. From the nesting each allocation gets its op, its module (the nearest ``nn.Module`` call; in backward the
module whose forward op has the same autograd sequence number), its phase (optimizer > backward/autograd >
recompute > forward) and its Python frames.

Roles that allocation events cannot show (this storage is a gradient / a parameter) are given by *markers*:
:func:`mark` records a zero-length profiler range named after the storage's pointer and category while the
storage is alive; the live allocation at that pointer takes the category.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from functools import cache, lru_cache
from typing import Any

import torch

from hyperdryrun.ingest.events import AllocEvent, normalize_device
from hyperdryrun.trace.blocks import Category, Phase, stronger
from hyperdryrun.trace.stacks import MAX_FRAMES, Frame, user_frame
from hyperdryrun.trace.tracker import RESIZE_OP

MARK_PREFIX = "hyperdryrun::mark::"
MICRO_BATCH_PREFIX = "hyperdryrun::micro_batch::"
_OPTIMIZER_PREFIXES = ("Optimizer.step#", "Optimizer.zero_grad#")
_OPTIMIZER_STEP = re.compile(r"torch/optim/(optimizer\.py\(\d+\): wrapper|\w+\.py\(\d+\): step)$")
"""A Python frame of an optimizer's step (``with_stack``): torch's ``profile_hook_step`` wrapper, or a torch.optim
``step``. An allocation under one is the optimizer's by the event tree, not only by comparing its time stamp with
the ``Optimizer.step#`` span (the span hangs off a zero-length call in torch 2.13's tree)."""
_ADDRESS = re.compile(r" (of [^>]* )?at 0x[0-9a-fA-F]+")
_NOT_OPS = ("autograd::", "hyperdryrun::", "profiler::", "ProfilerStep")
_AUTOGRAD_PREFIX = "autograd::engine::evaluate_function"
# Ops that only hand out memory: the allocation is named after the op that called them.
_ALLOCATING_OPS = {
    "aten::empty",
    "aten::empty_strided",
    "aten::empty_like",
    "aten::new_empty",
    "aten::new_empty_strided",
    "aten::resize_",
    "aten::zeros",
    "aten::zeros_like",
    "aten::new_zeros",
}


class ProfilerIngestError(ValueError):
    """The profiler object holds nothing this module can read (wrong kind, or memory was not profiled)."""


def mark_micro_batch(index: int) -> None:
    """Tell a running profiler that micro batch ``index`` starts now (its allocations get that number)."""
    with torch.profiler.record_function(f"{MICRO_BATCH_PREFIX}{index}"):
        pass


def mark(tensor: torch.Tensor, category: Category) -> None:
    """Tell a running profiler that ``tensor``'s storage plays ``category`` (no-op when nothing is recorded)."""
    inner = getattr(tensor, "_local_tensor", None)
    st = (inner if inner is not None else tensor).untyped_storage()
    ptr = st.data_ptr()
    if ptr and st.nbytes():
        with torch.profiler.record_function(f"{MARK_PREFIX}{category.value}::{ptr}"):
            pass


@lru_cache(maxsize=4096)
def _absolute(filename: str) -> str:
    """The profiler writes paths relative to the ``sys.path`` entry they were found under; make them absolute."""
    if os.path.isabs(filename) or filename.startswith("<"):
        return filename
    for base in [*sys.path, os.getcwd()]:
        candidate = os.path.join(base or os.getcwd(), filename)
        if os.path.isfile(candidate):
            return os.path.abspath(candidate)
    return filename


def _user_frames(chain: list[Any]) -> tuple[Frame, ...]:
    frames: list[Frame] = []
    for call in chain:
        caller = call.typed[1].caller
        path = _absolute(caller.file_name)
        if user_frame(path):
            frames.append((path, caller.line_number, caller.function_name))
            if len(frames) == MAX_FRAMES:
                break
    return tuple(frames)


@dataclass
class _Context:
    """What the ancestors of an event say about it (built on the way down the tree)."""

    op: str = ""
    op_id: Hashable | None = None
    kernel_end: int | None = None
    in_backward: bool = False
    module: str = ""
    module_in_backward: bool = False
    frames: tuple[Any, ...] = ()
    in_optimizer: bool = False


def events_from_profiler(
    prof: Any,
    *,
    module_names: dict[int, str] | None = None,
    device: str | None = None,
) -> list[AllocEvent]:
    """Allocation events of ``prof`` in time order, keyed by allocation id (else by pointer, see
    :func:`_allocation_keys`).

    ``module_names`` maps ``id(module)`` to its FQN (else modules are named by class). ``device`` keeps one
    device's events (default: all). A free of a storage allocated before profiling started is keyed
    ``("ptr", pointer)``, the key :func:`resident_events` gives storages alive at the start.
    """
    try:
        from torch._C._profiler import _EventType

        roots = prof.profiler.kineto_results.experimental_event_tree()
    except AttributeError as err:
        raise ProfilerIngestError(
            f"not a finished torch.profiler.profile with results ({type(prof).__name__})"
        ) from err
    names = module_names or {}
    flat: list[tuple[Any, _Context]] = []
    seq_module: dict[int, str] = {}
    marks: list[tuple[int, int, Category]] = []
    micro_batches: list[tuple[int, int]] = []
    optimizer_spans: list[tuple[int, int]] = []
    saw_memory = False

    def visit(e: Any, ctx: _Context) -> None:
        nonlocal saw_memory
        kind, extra = e.typed
        if kind == _EventType.Allocation:
            saw_memory = True
            flat.append((e, ctx))
            return
        if kind == _EventType.TorchOp:
            name = e.name
            if name.startswith(MARK_PREFIX):
                cat, _, ptr = name[len(MARK_PREFIX) :].partition("::")
                marks.append((e.start_time_ns, int(ptr), Category(cat)))
                return
            if name.startswith(MICRO_BATCH_PREFIX):
                micro_batches.append((e.start_time_ns, int(name[len(MICRO_BATCH_PREFIX) :])))
                return
            if name.startswith(_OPTIMIZER_PREFIXES):
                # A Python record_function: in torch 2.13's tree it hangs off the zero-length enter call, not
                # around the step, so its time span is what says which events it covers.
                optimizer_spans.append((e.start_time_ns, e.end_time_ns))
                return
            ctx = _Context(**ctx.__dict__)
            if name.startswith(_AUTOGRAD_PREFIX):
                ctx.in_backward = True
                ctx.module, ctx.module_in_backward = seq_module.get(extra.sequence_number, ""), False
            elif "::" in name and not name.startswith(_NOT_OPS):
                # A dispatcher op (aten, c10d, _c10d_functional...): the outermost is the task.
                if ctx.op_id is None:
                    ctx.op_id = ("op", e.start_tid, e.start_time_ns, name)
                if ctx.kernel_end is None:
                    # Named after the kernel a dry run dispatches (addmm for linear, the local op under DTensor);
                    # above it, after the innermost op that is more than an allocation.
                    if not _composite(name) and not _runs_python(e, _EventType):
                        ctx.kernel_end = e.end_time_ns
                        ctx.op = name.split("::", 1)[1]
                    elif name not in _ALLOCATING_OPS or not ctx.op:
                        ctx.op = name.split("::", 1)[1]
                if not ctx.in_backward and extra.sequence_number >= 0 and ctx.module:
                    seq_module.setdefault(extra.sequence_number, ctx.module)
        elif kind in (_EventType.PyCall, _EventType.PyCCall):
            ctx = _Context(**ctx.__dict__)
            ctx.frames = (e, *ctx.frames)
            py_name = _event_name(e)
            if "run_backward" in py_name:
                ctx.in_backward = True
            if _OPTIMIZER_STEP.search(py_name):
                ctx.in_optimizer = True
            module = getattr(extra, "module", None) if kind == _EventType.PyCall else None
            if module is not None:
                ctx.module = names.get(module.self_ptr, module.cls_name)
                ctx.module_in_backward = ctx.in_backward
        for child in e.children:
            visit(child, ctx)

    for root in roots:
        visit(root, _Context())
    if not saw_memory:
        raise ProfilerIngestError("the profile has no memory events: profile with profile_memory=True")
    flat.sort(key=lambda item: item[0].start_time_ns)
    keys = _allocation_keys(flat)
    scratch = _kernel_scratch(flat, keys)
    categories = _categories_from_marks(flat, keys, sorted(marks, key=lambda m: m[0]))

    micro_batches.sort()
    events: list[AllocEvent] = []
    mb_index, micro_batch = 0, 0
    for (e, ctx), key in zip(flat, keys, strict=True):
        while mb_index < len(micro_batches) and micro_batches[mb_index][0] <= e.start_time_ns:
            micro_batch = micro_batches[mb_index][1]
            mb_index += 1
        f = e.typed[1]
        dev = normalize_device(str(f.device))
        if device is not None and not dev.startswith(normalize_device(device)):
            continue
        size = int(f.alloc_size)
        if ctx.in_optimizer or _inside(optimizer_spans, e.start_time_ns):
            phase = Phase.OPTIMIZER
        elif ctx.in_backward:
            phase = Phase.RECOMPUTE if ctx.module_in_backward else Phase.BACKWARD
        else:
            phase = Phase.FORWARD
        events.append(
            AllocEvent(
                time_ns=int(e.start_time_ns),
                key=key,
                nbytes=size,
                op=ctx.op or _call_name(e.parent),
                op_id=ctx.op_id,
                phase=phase,
                module=ctx.module,
                frames=_user_frames(list(ctx.frames)) if size > 0 else (),
                category=categories.get(key),
                device=dev,
                micro_batch=micro_batch,
                scratch=key in scratch,
            )
        )
    return events


def _call_name(parent: Any) -> str:
    """Name of a non-aten allocation site (a Python call), stable across runs (no object addresses) and, for
    HyperDryRun's own code, across edits of it (``hyperdryrun.engine:step``, no line number)."""
    if parent is None:
        return "<unknown>"
    name = _event_name(parent)
    if "method resize_ of torch.storage.UntypedStorage" in name:
        return RESIZE_OP
    return _own_call_name(_ADDRESS.sub("", name))


_PY_CALL = re.compile(r"(?P<file>.+)\((?P<line>\d+)\): (?P<function>.+)")
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))


@lru_cache(maxsize=4096)
def _own_call_name(name: str) -> str:
    """A profiler Python-call name (``file(line): function``) as ``module:function`` when the file is part of this
    package, so a report's op names do not change with the line numbers of its code; other names unchanged."""
    call = _PY_CALL.fullmatch(name)
    if call is None:
        return name
    path = os.path.realpath(_absolute(call["file"]))
    if not path.startswith(_PACKAGE_DIR + os.sep) or not path.endswith(".py"):
        return name
    parts = os.path.relpath(path[: -len(".py")], os.path.dirname(_PACKAGE_DIR)).split(os.sep)
    if parts[-1] == "__init__":
        parts.pop()
    return f"{'.'.join(parts)}:{call['function']}"


def _event_name(e: Any) -> str:
    """A profiler event's name; ``"<undecodable>"`` for a Python call whose name torch cannot decode (torch 2.13's
    profiler reads some Python calls' names inside Inductor-compiled DTensor code as invalid UTF-8 and raises
    UnicodeDecodeError on ``.name``)."""
    try:
        return e.name
    except UnicodeDecodeError:
        return "<undecodable>"


def _runs_python(e: Any, kinds: Any) -> bool:
    """Whether an op dispatched to Python (a tensor subclass such as DTensor, or a dispatch mode): then it is not
    one kernel, and the ops its Python code issues are what a dry run sees. Other Python inside an op (a garbage
    collection running weakref callbacks during a slow kernel) does not count."""
    return any(
        _event_name(c) == "PythonSubclass"
        or (c.typed[0] == kinds.PyCall and _event_name(c).endswith("__torch_dispatch__"))
        for c in e.children
    )


@cache
def _composite(name: str) -> bool:
    """Whether an aten op decomposes above the dispatcher's backends (CompositeImplicitAutograd): a dry run sees
    the ops it decomposes into, not the op itself. Overloads are not in the profile; any composite one counts."""
    if not name.startswith("aten::"):
        return False
    packet = getattr(torch.ops.aten, name.removeprefix("aten::"), None)
    if packet is None:
        return False
    base = name if name.startswith("aten::") else f"aten::{name}"
    for ov in packet.overloads():
        qualified = base if ov == "default" else f"{base}.{ov}"
        try:
            if torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CompositeImplicitAutograd"):
                return True
        except RuntimeError:  # an overload registered only for some backends (e.g. a TorchScript-only one)
            continue
    return False


def _allocation_keys(flat: list[tuple[Any, _Context]]) -> list[Hashable]:
    """One key per event, shared by an allocation and its free: the profiler's allocation id where it assigned
    one (torch 2.13 does with ``record_shapes=True``), else the pointer, paired in time order (a pointer is not
    handed out again before it is freed). A free of memory allocated before profiling began is ``("ptr", p)``."""
    keys: list[Hashable] = []
    allocated: set[Hashable] = set()
    live: dict[tuple[str, int], Hashable] = {}
    for i, (e, _) in enumerate(flat):
        f = e.typed[1]
        where = (str(f.device), int(f.ptr))
        aid = f.allocation_id
        if f.alloc_size > 0:
            key: Hashable = aid if aid is not None else ("alloc", i)
            allocated.add(key)
            live[where] = key
        else:
            if aid is not None:
                key = aid if aid in allocated else ("ptr", int(f.ptr))
            else:
                key = live.get(where, ("ptr", int(f.ptr)))
            if live.get(where) == key:
                del live[where]
        keys.append(key)
    return keys


def _kernel_scratch(flat: list[tuple[Any, _Context]], keys: list[Hashable]) -> set[Hashable]:
    """Keys of allocations freed before the kernel that allocated them returned (workspace, not an output)."""
    inside: dict[Hashable, int] = {}
    out: set[Hashable] = set()
    for (e, ctx), key in zip(flat, keys, strict=True):
        if e.typed[1].alloc_size > 0:
            if ctx.kernel_end is not None:
                inside[key] = ctx.kernel_end
        else:
            end = inside.pop(key, None)
            if end is not None and e.start_time_ns <= end:
                out.add(key)
    return out


def _inside(spans: list[tuple[int, int]], t: int) -> bool:
    return any(a <= t <= b for a, b in spans)


def _categories_from_marks(
    flat: list[tuple[Any, _Context]], keys: list[Hashable], marks: list[tuple[int, int, Category]]
) -> dict[Hashable, Category]:
    """Allocation key -> category: each marker names the allocation live at its pointer at its time."""
    out: dict[Hashable, Category] = {}
    live: dict[int, Hashable] = {}  # ptr -> key
    i = 0
    for t, ptr, cat in marks:
        while i < len(flat) and flat[i][0].start_time_ns <= t:
            f = flat[i][0].typed[1]
            if f.alloc_size > 0:
                live[int(f.ptr)] = keys[i]
            elif live.get(int(f.ptr)) == keys[i]:
                del live[int(f.ptr)]
            i += 1
        key = live.get(ptr)
        if key is not None:
            out[key] = stronger(out.get(key), cat)
    return out


def resident_events(
    tensors: Iterable[tuple[torch.Tensor, Category, str]], *, device: str = "cpu"
) -> list[AllocEvent]:
    """Storages alive when profiling starts (parameters, buffers, optimizer states), one event per storage.

    Each item is ``(tensor, category, owning module FQN)``; DTensors count by their local shard, and a storage
    named twice keeps its strongest category.
    """
    by_ptr: dict[int, AllocEvent] = {}
    for tensor, category, module in tensors:
        inner = getattr(tensor, "_local_tensor", None)
        st = (inner if inner is not None else tensor).untyped_storage()
        ptr, nbytes = st.data_ptr(), st.nbytes()
        if not ptr or not nbytes:
            continue
        prev = by_ptr.get(ptr)
        if prev is not None:
            category = stronger(prev.category, category)
            module = prev.module
        by_ptr[ptr] = AllocEvent(0, ("ptr", ptr), nbytes, category=category, module=module, device=device)
    return list(by_ptr.values())
