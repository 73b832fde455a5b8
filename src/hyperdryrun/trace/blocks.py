"""Memory blocks: the one data structure every report, comparison and later stage reads."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

PERSISTENT_END = 2**63 - 1
"""``end`` of a block still alive after the step."""
ADDRESS_BASE = 0xF00000000000
ALIGNMENT = 512
SMALL_BLOCK = 1 << 20
COMPUTE_STREAM = 0
"""Stream id of the compute stream (CUDA's default stream); side streams get 1, 2, ... as the world names them."""


class Category(StrEnum):
    """What a block holds. Order is the precedence when several roles are observed for one storage."""

    PARAMETER = "Parameter"
    BUFFER = "Buffer"
    GRADIENT = "Gradient"
    OPTSTATE = "Optstate"
    ACTIVATION = "Activation"
    TEMP = "Temp"
    OTHER = "Other"

    def __str__(self) -> str:
        return self.value


CATEGORY_ORDER = list(Category)
_RANK = {c: i for i, c in enumerate(CATEGORY_ORDER)}


def stronger(a: Category | None, b: Category) -> Category:
    """The category that wins when one storage is seen in two roles (e.g. a parameter also read as input)."""
    return b if a is None or _RANK[b] < _RANK[a] else a


class Phase(StrEnum):
    INITIALIZATION = "initialization"
    FORWARD = "forward"
    BACKWARD = "backward"
    RECOMPUTE = "recompute"
    OPTIMIZER = "optimizer"

    def __str__(self) -> str:
        return self.value


STEP_PHASES = [Phase.FORWARD, Phase.BACKWARD, Phase.RECOMPUTE, Phase.OPTIMIZER]


@dataclass(slots=True)
class Block:
    """One allocation: a storage's bytes over the task interval ``[start, end)``."""

    id: int
    size: int
    """Bytes as the target device's allocator hands them out (512-rounded on CUDA)."""
    requested: int
    """Bytes the storage asked for."""
    start: int
    op: str
    phase: Phase
    module: str
    stack_id: int
    addr: int = 0
    end: int = PERSISTENT_END
    category: Category | None = None
    users: list[int] = field(default_factory=list)
    used_after_alloc: int = 0
    """Live bytes right after this block was allocated."""
    peak_after_alloc: int = 0
    """Running peak right after this block was allocated."""
    micro_batch: int = 0
    start_plot: float = 0.0
    end_plot: float = float(PERSISTENT_END)
    stream: int = COMPUTE_STREAM
    """Stream the allocation is made on (the current stream when the storage was created): the caching allocator
    keeps a pool per stream, so a block freed on one stream serves only later allocations on that stream."""
    use_streams: frozenset[int] = frozenset()
    """Other streams the caching allocator is told the block is used on (``Tensor.record_stream``): its memory
    returns to the pool only once those uses complete. Cross-stream uses ordered by events instead (FSDP2, NCCL's
    stashed tensors) are not listed: the allocator never learns of them."""
    scratch: bool = False
    """A measured kernel's workspace: allocated and freed inside the kernel that made it (oneDNN's bf16 GEMM
    scratchpad, a CPU mm's contiguous operand copy). Real, but not an op's output, so a dry run has no such block;
    its size depends on the CPU (an AMX core's bf16 GEMM packs its operands into megabytes of scratch)."""

    @property
    def persistent(self) -> bool:
        return self.end == PERSISTENT_END

    @property
    def small(self) -> bool:
        return self.size < SMALL_BLOCK

    def alive_at(self, task: int) -> bool:
        return self.start <= task < self.end


def round_size(nbytes: int, alignment: int) -> int:
    """Round ``nbytes`` up to ``alignment``; zero stays zero (the CUDA allocator hands out nothing)."""
    if alignment <= 1:
        return nbytes
    return (nbytes + alignment - 1) // alignment * alignment


def live_bytes_by_task(blocks: list[Block], num_tasks: int) -> list[int]:
    """Live bytes at each task reconstructed from block lifetimes alone (a sweep, independent of the tracker)."""
    delta = [0] * (num_tasks + 1)
    for b in blocks:
        if b.start > num_tasks:
            continue
        delta[b.start] += b.size
        if b.end <= num_tasks:
            delta[b.end] -= b.size
    live, cur = [], 0
    for t in range(num_tasks):
        cur += delta[t]
        live.append(cur)
    return live


DEFAULT_CATEGORY = {
    Phase.INITIALIZATION: Category.OTHER,
    Phase.FORWARD: Category.ACTIVATION,
    Phase.RECOMPUTE: Category.ACTIVATION,
    Phase.BACKWARD: Category.TEMP,
    Phase.OPTIMIZER: Category.TEMP,
}
"""Category of a block no role was observed for, by the phase that allocated it."""


def finalize_blocks(blocks: list[Block]) -> list[Block]:
    """Fill in, in place, the category of blocks without one (:data:`DEFAULT_CATEGORY`) and every block's plot
    coordinates; returns ``blocks``. The dry run and every ingested source finish their blocks with this one rule.

    Plot coordinates spread the events of one task over ``(task, task + 1)``: the frees recorded at a task first
    (they happened before its allocations), then its allocations, each group in block order.
    """
    events: dict[int, list[tuple[Block, bool]]] = {}
    for blk in blocks:
        if blk.category is None:
            blk.category = DEFAULT_CATEGORY[blk.phase]
        events.setdefault(blk.start, []).append((blk, True))
    for blk in sorted((b for b in blocks if not b.persistent), key=lambda b: (b.end, b.id)):
        events.setdefault(blk.end, []).append((blk, False))
    for task, evs in events.items():
        evs.sort(key=lambda e: (e[1], e[0].id))
        n = len(evs)
        for k, (blk, is_alloc) in enumerate(evs, start=1):
            coord = round(task + k / (n + 1), 12)
            if is_alloc:
                blk.start_plot = coord
            else:
                blk.end_plot = coord
    return blocks
