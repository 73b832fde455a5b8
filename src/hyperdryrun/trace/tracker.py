"""The memory tracker: the only code that sees the dispatcher.

It observes every op that reaches the fake tensor mode (so DTensor's local ops and collectives are seen, not only
the DTensor-level op), opens a block for every new storage, closes it when the storage dies (a weakref callback) or
is resized, and keeps the running live bytes and peak. Per-op work is O(tensors of the op): module-local peaks are
kept on a stack and folded into the parent when a module ends, so cost does not grow with model depth.

Timeline rule (what makes the blocks reconstruct the peak exactly): every op that allocates or uses tracked storage
is a task ``t``. Its allocations start at ``t``; a storage freed while task ``t`` runs ends at ``t + 1`` (it was live
during the task); a storage freed between tasks ends at the next task index.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils.weak import WeakIdKeyDictionary

from hyperdryrun.compat import torch_storage
from hyperdryrun.compat.torch_dispatch_mode import fake_tensor_dispatch
from hyperdryrun.compat.torch_fake_tensor import cache_key_flattener
from hyperdryrun.patches import Patch, PatchSet
from hyperdryrun.trace.blocks import (
    ADDRESS_BASE,
    ALIGNMENT,
    COMPUTE_STREAM,
    Block,
    Category,
    Phase,
    finalize_blocks,
    round_size,
    stronger,
)
from hyperdryrun.trace.modules import ModuleHooks
from hyperdryrun.trace.roles import RoleMarker
from hyperdryrun.trace.stacks import StackTable
from hyperdryrun.trace.step import ModuleStats
from hyperdryrun.trace.tensors import clean_fqn, iter_tensors, local_tensor, unique_storage_bytes

_aten = torch.ops.aten
METADATA_OPS = {
    torch.ops.prim.device.default,
    _aten.sym_size.default,
    _aten.sym_size.int,
    _aten.sym_stride.default,
    _aten.sym_stride.int,
    _aten.sym_numel.default,
    _aten.sym_storage_offset.default,
    _aten.is_contiguous.default,
    _aten.is_same_size.default,
    _aten._has_compatible_shallow_copy_type.default,
}
"""Ops that only read a tensor's metadata: never an allocation or a use of its memory, so never a task."""
_DEVICE_OP_ID = id(torch.ops.prim.device.default)
"""``id()`` of ``prim.device`` (kept alive in ``METADATA_OPS``), about 60 % of the ops that reach the fake mode:
the dispatch path hands it straight to the fake mode, which answers it from its own table without dispatching
anything (torch 2.11-2.14 ``_DISPATCH_META_HANDLERS``), so no op runs inside it and the tracker, which skips
metadata ops, has nothing to see. ``id(func) ==`` is one C-level compare where a dict or set lookup calls
``OpOverload.__hash__`` in Python."""
RESIZE_OP = "storage.resize_"
_WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor.default
MATMUL_OPS = frozenset(
    {
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "addbmm",
        "addmv",
        "mv",
        "dot",
        "vdot",
        "_addmm_activation",
        "_scaled_mm",
    }
)
"""Ops whose CUDA kernels run cuBLAS/cuBLASLt through ``getCurrentCUDABlasHandle`` (torch 2.13 aten/src/ATen/cuda/
CUDABlas.cpp), which gives the calling thread's handle a workspace on the current stream the first time."""
MAIN_THREAD = "main"
AUTOGRAD_THREAD = "autograd"
"""Threads that run a step's kernels on CUDA: the Python thread, and the autograd engine's device thread, which runs
every backward (and recompute) kernel (torch 2.13 ``Engine::start_device_threads``); each has its own cuBLAS handle."""
_GROUP_ARGS = ("group_name", "process_group")


_active: MemoryTracker | None = None
_sequence_nr = torch._C._autograd._get_sequence_nr
"""The calling thread's next autograd node sequence number (torch 2.13 ``at::sequence_number::peek``): a node
made by an op's autograd kernel takes it just before the op is dispatched to the fake mode."""


def active_tracker() -> MemoryTracker | None:
    """The tracker recording the step being traced now (between its ``start()`` and ``stop()``), else None."""
    return _active


class MemoryTracker:
    """Records blocks for everything allocated on the fake device while ``active``."""

    def __init__(self, alignment: int = ALIGNMENT, capture_stacks: bool = True) -> None:
        self.alignment = alignment
        self.capture_stacks = capture_stacks
        self.stacks = StackTable()
        self.blocks: list[Block] = []
        self.task_phase: list[Phase] = []
        self.task_op: list[str] = []
        self.current = 0
        self.peak = 0
        self.peak_task = -1
        self.phase_peak: dict[Phase, int] = {}
        self.micro_batch = 0
        self.active = False
        self._paused = 0
        self._live: dict[int, Block] = {}
        self._refs: dict[int, weakref.ref] = {}
        self._holders: dict[int, int] = {}
        """Block id -> how many storages hold its memory, for blocks that more than one fake storage stands for
        (see :meth:`_alias`); a block is freed when the last of them dies."""
        self._roles: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._next_addr = ADDRESS_BASE
        self._depth = 0
        self._pending: list[Block] = []
        self._view_or_meta: dict[int, tuple[Any, bool]] = {}
        self._optimizer_depth = 0
        self._recompute_depth = 0
        self._default_category: Category | None = None
        self._mod_stack: list[list] = []  # [stats, is_bw, running_max]
        self.modules: dict[str, ModuleStats] = {}
        self._fqn: dict[int, str] = {}
        self.roles = RoleMarker(self.mark)
        self._handles: list[Any] = []
        self._modtracker: ModuleHooks | None = None
        self._patches: PatchSet | None = None
        self._outer: MemoryTracker | None = None
        self.stream_of: Callable[[], int] | None = None
        """The stream id of the current stream (set by the world for a CUDA target); None: every block is on the
        compute stream."""
        self.first_matmuls: dict[tuple[str, int], int] = {}
        """(thread, stream) -> the first task that ran a cuBLAS matmul there."""
        self.process_groups: dict[str, None] = {}
        """Names of the process groups the step's collectives and point-to-point ops ran on, in first-use order."""
        self._group_arg: dict[int, tuple[Any, int]] = {}
        self._node_stack: dict[int, int] = {}
        """Sequence number of an autograd node made in forward -> the stack of the forward op it belongs to: the
        first op dispatched after the node was made (the op whose autograd kernel made it; for a node made without
        an op of its own, a view or a hook's ``autograd.Function``, the op that follows it)."""
        self._seq_seen = 0
        """The main thread's next autograd sequence number when the last forward op was dispatched."""

    # ----------------------------------------------------------------- lifecycle
    def start(self, root: torch.nn.Module | None = None) -> None:
        """Begin recording; ``root`` names modules by FQN and gets per-module statistics."""
        if root is not None:
            for name, mod in root.named_modules():
                self._fqn[id(mod)] = clean_fqn(name)
                stats = self.modules.setdefault(self._fqn[id(mod)], ModuleStats(self._fqn[id(mod)]))
                stats.param_bytes = unique_storage_bytes(list(mod.parameters()), self.alignment)
                stats.buffer_bytes = unique_storage_bytes(list(mod.buffers()), self.alignment)
        self._modtracker = ModuleHooks(self._pre_fw, self._post_fw, self._pre_bw, self._post_bw)
        self._modtracker.__enter__()
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self._handles.append(register_optimizer_step_pre_hook(self._pre_opt))
        self._handles.append(register_optimizer_step_post_hook(self._post_opt))
        self._patches = PatchSet([self._resize_patch()])
        self._patches.__enter__()
        self._seq_seen = _sequence_nr()
        global _active
        self._outer, _active = _active, self
        self.active = True

    def stop(self) -> None:
        """Stop recording and remove every hook and patch (idempotent, safe after an exception)."""
        global _active
        self.active = False
        if _active is self:
            _active, self._outer = self._outer, None
        if self._patches is not None:
            self._patches.__exit__()
            self._patches = None
        if self._modtracker is not None:
            self._modtracker.__exit__(None, None, None)
            self._modtracker = None
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.roles.remove()

    def _resize_patch(self) -> Patch:
        """``UntypedStorage.resize_`` seen while tracking (:func:`hyperdryrun.compat.torch_storage.resize_patch`)."""
        tracker = self

        def resize_(orig: Any, st: torch.UntypedStorage, size: int) -> Any:
            if not tracker.active:
                return orig(st, size)
            old = st.nbytes()
            tracker._depth += 1
            try:
                out = orig(st, size)
                tracker._on_resize(st, old, st.nbytes())
            finally:
                tracker._depth -= 1
                if tracker._depth == 0:
                    tracker._flush()
            return out

        return torch_storage.resize_patch(resize_)

    # ----------------------------------------------------------------- phases and roles
    def phase(self) -> Phase:
        if self._optimizer_depth:
            return Phase.OPTIMIZER
        if torch._C._current_graph_task_id() != -1:
            return Phase.RECOMPUTE if self._recompute_depth else Phase.BACKWARD
        return Phase.FORWARD

    def module(self) -> str:
        return self._mod_stack[-1][0].fqn if self._mod_stack else ""

    def mark(self, tensor: torch.Tensor, category: Category) -> None:
        """Record that ``tensor``'s storage plays ``category`` (applies to its live block and later reopenings)."""
        st = local_tensor(tensor).untyped_storage()
        self._roles[st] = stronger(self._roles.get(st), category)
        blk = self._live.get(id(st))
        if blk is not None:
            blk.category = stronger(blk.category, category)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Ops run inside are not device work (e.g. DTensor's shape inference on global shapes): not recorded."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def labelled(self, category: Category) -> _Label:
        """Context in which new blocks default to ``category`` (e.g. the batch's input tensors)."""
        return _Label(self, category)

    def seed(self, tensor: torch.Tensor, category: Category, module: str = "", frames: tuple = ()) -> None:
        """A storage that exists before the step: a block from the start, phase ``initialization``, owned by
        ``module`` (the FQN of the module whose parameter, buffer or optimizer state it is), with the stack
        ``frames`` (the line that created that parameter or buffer)."""
        st = local_tensor(tensor).untyped_storage()
        key = id(st)
        if key not in self._refs and st.nbytes() > 0:
            sid = self.stacks.intern(frames) if self.capture_stacks else 0
            self._open(st, key, 0, "initialization", Phase.INITIALIZATION, stack_id=sid, module=module)
        self.mark(tensor, category)

    # ----------------------------------------------------------------- dispatch
    def begin_op(self) -> None:
        self._depth += 1

    def end_op(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        try:
            if self.active and not self._paused:
                self._on_op(func, args, kwargs, out)
        finally:
            self._depth -= 1
            if self._depth == 0 and self._pending:
                self._flush()

    def _skip(self, func: Any) -> bool:
        # keyed by id(func): OpOverload.__hash__ is Python code; the value keeps func alive, so its id stays its own
        found = self._view_or_meta.get(id(func))
        if found is not None:
            return found[1]
        # A view op never allocates, so it is skipped; but a composite op whose schema *may* alias (``to``,
        # ``contiguous``, ``reshape``) reaches the mode undecomposed below autograd (e.g. torch 2.13's context
        # parallel ring) and then copies: it is tracked, and the input-storage check keeps its aliasing
        # outputs from counting.
        skip = func in METADATA_OPS or (
            bool(getattr(func, "is_view", False))
            and not torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd")
        )
        self._view_or_meta[id(func)] = (func, skip)
        return skip

    def _on_op(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        # Nested ops are FakeTensorMode running a decomposition of one kernel: their intermediates are not the
        # target kernel's allocations (e.g. the embedding_dense_backward decomposition upcasts and expands
        # indices, which CUDA's kernel does not), so only the outermost op's outputs count.
        if self._depth > 1 or self._skip(func):
            return
        if func is _WAIT_TENSOR and self._alias(args[0], out):
            return
        found = self._group_arg.get(id(func))
        if found is None:
            found = self._group_arg[id(func)] = (func, _group_arg_index(func))
        group_arg = found[1]
        if group_arg >= 0 and group_arg < len(args):
            self._note_group(args[group_arg])
        live = self._live
        used = []
        inputs = set()  # an output on an input's storage (in-place, out=) is no allocation, tracked or not
        for t in iter_tensors(args):
            key = id(t.untyped_storage())
            inputs.add(key)
            blk = live.get(key)
            if blk is not None:
                used.append(blk)
        if kwargs:
            for t in iter_tensors(kwargs):
                key = id(t.untyped_storage())
                inputs.add(key)
                blk = live.get(key)
                if blk is not None:
                    used.append(blk)
        new = []
        for t in iter_tensors(out):
            if not isinstance(t, FakeTensor):
                continue
            st = t.untyped_storage()
            key = id(st)
            if key in self._refs:
                blk = live.get(key)
                if blk is not None:
                    used.append(blk)
            elif key not in inputs and st.nbytes() > 0 and all(s is not st for s in new):
                # a fake tensor on "meta" (an example shape made inside the step, e.g. a pipeline stage's
                # input_args, which torch 2.11's PipelineStage keeps as inputs_meta) holds no memory anywhere
                if t.device.type != "meta":
                    new.append(st)
        sid = -1
        if self.capture_stacks:
            seq = _sequence_nr()
            if seq != self._seq_seen:  # autograd nodes were made since the last op: in forward, this op's
                if torch._C._current_graph_task_id() == -1 and not self._optimizer_depth:
                    sid = self.stacks.capture(sys._getframe(1))
                    node_stack = self._node_stack
                    for n in range(self._seq_seen, seq):
                        node_stack[n] = sid
                self._seq_seen = seq
        if not used and not new:
            return
        task = len(self.task_op)
        phase = self.phase()
        name = str(func.overloadpacket.__name__) if hasattr(func, "overloadpacket") else str(func)
        self.task_op.append(name)
        self.task_phase.append(phase)
        if name in MATMUL_OPS:
            thread = MAIN_THREAD if torch._C._current_graph_task_id() == -1 else AUTOGRAD_THREAD
            self.first_matmuls.setdefault((thread, self._stream()), task)
        for blk in used:
            users = blk.users
            if not users or users[-1] != task:
                users.append(task)
        if new:
            if not self.capture_stacks:
                sid = 0
            elif phase is Phase.BACKWARD:
                sid = self._backward_stack(sys._getframe(1))
            elif sid < 0:
                sid = self.stacks.capture(sys._getframe(1))
            for st in new:
                self._open(st, id(st), task, name, phase, sid)
            self._end_task(phase)

    def _backward_stack(self, frame: Any) -> int:
        """The stack of a backward allocation: the forward op whose autograd node is running (the engine's
        current node); a node made outside the traced forward (AccumulateGrad of a leaf, a node of the set-up) has
        none, and then the stack where backward runs (the line that called ``backward()``)."""
        node = torch._C._current_autograd_node()
        if node is not None:
            sid = self._node_stack.get(node._sequence_nr())
            if sid is not None:
                return sid
        return self.stacks.capture(frame)

    def _alias(self, inp: Any, out: Any) -> bool:
        """``out`` is ``inp``'s memory: torch 2.13's real ``_c10d_functional.wait_tensor`` returns its input, while
        its Meta kernel (used under fake mode) returns ``empty_like(input)``. Both fake storages now stand for the
        block, which ends when the last of them dies: in real execution whoever still holds the input (e.g.
        selective AC saving a collective's output, torchtitan's policy saves reduce-scatters) keeps the memory
        that the waited tensor's users see."""
        if not isinstance(inp, torch.Tensor) or not isinstance(out, torch.Tensor):
            return False
        src, dst = inp.untyped_storage(), out.untyped_storage()
        blk = self._live.get(id(src))
        if blk is None:
            return False
        key = id(dst)
        if self._live.get(key) is not blk:
            self._live[key] = blk
            self._holders[blk.id] = self._holders.get(blk.id, 1) + 1
        if key not in self._refs:
            self._refs[key] = weakref.ref(dst, self._storage_died(key))
        return True

    def _release(self, key: int) -> Block | None:
        """Forget storage ``key``; its block if no other storage holds that memory (then it is freed)."""
        blk = self._live.pop(key, None)
        if blk is None:
            return None
        held = self._holders.get(blk.id)
        if held is None:
            return blk
        if held > 2:
            self._holders[blk.id] = held - 1
        else:
            del self._holders[blk.id]
        return None

    def _note_group(self, group: Any) -> None:
        if not isinstance(group, str):
            try:
                group = torch.distributed.ProcessGroup.unbox(group).group_name
            except Exception:  # not a boxed ProcessGroup: nothing to record
                return
        self.process_groups.setdefault(group, None)

    def _stream(self) -> int:
        return self.stream_of() if self.stream_of is not None else COMPUTE_STREAM

    def record_stream(self, tensor: torch.Tensor, stream: int) -> None:
        """``tensor.record_stream(s)``: the caching allocator holds its block until the uses on ``stream`` finish."""
        blk = self._live.get(id(local_tensor(tensor).untyped_storage()))
        if blk is not None and stream != blk.stream:
            blk.use_streams = blk.use_streams | {stream}

    def _end_task(self, phase: Phase) -> None:
        """Phase peaks are taken at allocating tasks: live bytes only grow there, and a task that merely uses memory
        (e.g. a pipeline schedule's recv between two backward chunks, outside autograd, so labelled forward) would
        otherwise lend its phase the bytes another phase left behind."""
        cur = self.current
        if cur > self.phase_peak.get(phase, -1):
            self.phase_peak[phase] = cur

    def _on_resize(self, st: torch.UntypedStorage, old: int, new: int) -> None:
        key = id(st)
        blk = self._live.get(key)
        if old == new and (blk is not None or new == 0):
            return
        task = len(self.task_op)
        phase = self.phase()
        self.task_op.append(RESIZE_OP)
        self.task_phase.append(phase)
        if blk is not None:
            # The old bytes are freed during this task (a reallocation copies before it frees): end at task + 1.
            blk.users.append(task)
            self._live.pop(key)
            if self._holders.pop(blk.id, None) is not None:
                # The one memory is resized: no other storage holds the old bytes any more.
                for other in [k for k, b in self._live.items() if b is blk]:
                    del self._live[other]
            self._pending.append(blk)
        if new > 0:
            if not self.capture_stacks:
                sid = 0
            elif phase is Phase.BACKWARD:
                sid = self._backward_stack(sys._getframe(2))
            else:
                sid = self.stacks.capture(sys._getframe(2))
            self._open(st, key, task, RESIZE_OP, phase, sid)
            self._end_task(phase)

    # ----------------------------------------------------------------- block bookkeeping
    def _open(
        self,
        st: torch.UntypedStorage,
        key: int,
        task: int,
        op: str,
        phase: Phase,
        stack_id: int,
        module: str | None = None,
    ) -> None:
        nbytes = st.nbytes()
        size = round_size(nbytes, self.alignment)
        blk = Block(
            id=len(self.blocks),
            size=size,
            requested=nbytes,
            start=task,
            op=op,
            phase=phase,
            module=self.module() if module is None else module,
            stack_id=stack_id,
            addr=self._next_addr,
            category=self._roles.get(st, self._default_category),
            micro_batch=self.micro_batch,
            stream=COMPUTE_STREAM if phase is Phase.INITIALIZATION else self._stream(),
        )
        self._next_addr += round_size(max(size, 1), ALIGNMENT)
        self.blocks.append(blk)
        self._live[key] = blk
        if key not in self._refs:
            self._refs[key] = weakref.ref(st, self._storage_died(key))
        self.current += size
        if self.current > self.peak:
            self.peak = self.current
            self.peak_task = task
        if self._mod_stack:
            top = self._mod_stack[-1]
            if self.current > top[2]:
                top[2] = self.current
        blk.used_after_alloc = self.current
        blk.peak_after_alloc = self.peak

    def _storage_died(self, key: int):
        def callback(_ref: weakref.ref) -> None:
            self._refs.pop(key, None)
            if not self.active:
                return  # after the step: what is still open stays persistent
            blk = self._release(key)
            if blk is None:
                return
            if self._depth:
                self._pending.append(blk)
            else:
                blk.end = len(self.task_op)
                self.current -= blk.size

        return callback

    def _flush(self) -> None:
        end = len(self.task_op)
        pending, self._pending = self._pending, []
        for blk in pending:
            blk.end = end
            self.current -= blk.size

    # ----------------------------------------------------------------- module / optimizer hooks
    def _stats(self, mod: torch.nn.Module) -> ModuleStats:
        fqn = self._fqn.get(id(mod)) or type(mod).__name__
        stats = self.modules.get(fqn)
        if stats is None:
            stats = self.modules[fqn] = ModuleStats(fqn)
        return stats

    def _push(self, mod: torch.nn.Module | None, is_bw: bool) -> None:
        stats = self._stats(mod) if mod is not None else ModuleStats("<unknown>")
        self._mod_stack.append([stats, is_bw, self.current])

    def _pop(self, mod: torch.nn.Module | None, is_bw: bool) -> None:
        stack = self._mod_stack
        for i in range(len(stack) - 1, -1, -1):
            entry = stack[i]
            if entry[1] == is_bw and (mod is None or entry[0] is self._stats(mod)):
                del stack[i]
                stats, _, peak = entry
                if is_bw:
                    stats.bw_peak = max(stats.bw_peak, peak)
                else:
                    stats.fw_peak = max(stats.fw_peak, peak)
                if stack and stack[-1][2] < peak:
                    stack[-1][2] = peak
                return

    def _pre_fw(self, mod: torch.nn.Module, inputs: Any) -> None:
        if not self.active:
            return
        self.roles.module_runs(mod)
        in_bw = torch._C._current_graph_task_id() != -1
        if in_bw:
            self._recompute_depth += 1
        else:
            stats = self._stats(mod)
            stats.calls += 1
            stats.input_bytes = max(stats.input_bytes, unique_storage_bytes(inputs, self.alignment))
        self._push(mod, in_bw)

    def _post_fw(self, mod: torch.nn.Module, inputs: Any, outputs: Any) -> None:
        if not self.active:
            return
        self.roles.module_runs(mod)
        in_bw = torch._C._current_graph_task_id() != -1
        if in_bw:
            self._recompute_depth = max(0, self._recompute_depth - 1)
        else:
            stats = self._stats(mod)
            stats.output_bytes = max(stats.output_bytes, unique_storage_bytes(outputs, self.alignment))
        self._pop(mod, in_bw)

    def _pre_bw(self, mod: torch.nn.Module | None, grads: Any) -> None:
        if self.active:
            self._push(mod, True)

    def _post_bw(self, mod: torch.nn.Module | None, grads: Any) -> None:
        if self.active:
            self._pop(mod, True)

    def _pre_opt(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self.active:
            return
        self._optimizer_depth += 1
        self.roles.optimizer_starts(opt)

    def _post_opt(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self.active:
            return
        self.roles.optimizer_done(opt)
        self._optimizer_depth = max(0, self._optimizer_depth - 1)

    # ----------------------------------------------------------------- results
    @property
    def num_tasks(self) -> int:
        return len(self.task_op)

    def live_blocks(self) -> list[Block]:
        return list({blk.id: blk for blk in self._live.values()}.values())

    def finalize(self) -> list[Block]:
        """Fill in default categories and plot coordinates (:func:`~hyperdryrun.trace.blocks.finalize_blocks`);
        returns the blocks in allocation order."""
        return finalize_blocks(self.blocks)


def _group_arg_index(func: Any) -> int:
    """Index of the process-group argument of a c10d or functional-collective op (-1: none)."""
    if getattr(func, "namespace", None) not in ("c10d", "_c10d_functional"):
        return -1
    for i, arg in enumerate(func._schema.arguments):
        if arg.name in _GROUP_ARGS:
            return i
    return -1


class _Label:
    def __init__(self, tracker: MemoryTracker, category: Category) -> None:
        self.tracker, self.category = tracker, category

    def __enter__(self) -> None:
        self._prev = self.tracker._default_category
        self.tracker._default_category = self.category

    def __exit__(self, *exc: Any) -> None:
        self.tracker._default_category = self._prev


_FAKE_DISPATCH = fake_tensor_dispatch()


class TrackingFakeTensorMode(FakeTensorMode):
    """FakeTensorMode that reports every op it executes to a tracker.

    Tracking here, at the bottom of the mode stack, sees the rank-local ops that DTensor and FSDP issue (including
    the redistribution collectives inside a DTensor op), which a TorchDispatchMode above DTensor would not.
    """

    tracker: MemoryTracker | None = None

    # the fake-tensor cache's key, the same list built without torch's per-field Python walk
    # (compat/torch_fake_tensor.py)
    _prep_args_for_hash = cache_key_flattener()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # FakeTensorMode's dispatch without its own Dynamo wrapper: this method's wrapper already holds Dynamo's
        # frame callback off below it (compat/torch_dispatch_mode.py)
        tracker = self.tracker
        if tracker is None or not tracker.active or id(func) == _DEVICE_OP_ID:
            return _FAKE_DISPATCH(self, func, types, args, kwargs)
        tracker.begin_op()
        out = None
        try:
            out = _FAKE_DISPATCH(self, func, types, args, kwargs)
        finally:
            tracker.end_op(func, args, kwargs or {}, out)
        return out
