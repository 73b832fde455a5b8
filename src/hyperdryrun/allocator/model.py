"""A model of the pinned torch's CUDA caching allocator (``DeviceCachingAllocator``): segments, blocks, pools.

Each method names the C++ function of c10/cuda/CUDACachingAllocator.cpp it models (see ``hyperdryrun.allocator``
for the commit read). Sizes are bytes; addresses are invented (segments get increasing, never reused virtual
addresses) unless the caller gives the next segment's address (``next_segment_address``, what a replay of a
recorded trace does); free blocks are ordered as ``BlockComparatorSize`` orders them, by (size, address), so ties in
best fit fall to the lower address.

Not modelled: CUDA graph private pools and mempools, IPC, ``mallocWithAddress``, free-memory callbacks, the
cudaMallocAsync backend, and memory the driver or other processes hold (give ``capacity`` net of them).
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from hyperdryrun.allocator.options import K_MIN_LARGE_ALLOC, SIZE_MAX, AllocatorOptions

K_MIN_BLOCK_SIZE = 512
"""kMinBlockSize: every size is rounded up to a multiple of it."""
K_SMALL_SIZE = 1 << 20
"""kSmallSize: requests up to 1 MiB use the small pool."""
K_SMALL_BUFFER = 2 << 20
"""kSmallBuffer: a small-pool segment (and an expandable small-pool page)."""
K_ROUND_LARGE = 2 << 20
"""kRoundLarge: requests of 10 MiB and more get a segment of their size rounded up to 2 MiB."""
DEFAULT_DEVICE_MEMORY = 1 << 40
"""Device memory assumed for an expandable segment's address reservation when no capacity is given."""
ADDRESS_BASE = 0x7F0000000000


def roundup_power2_next_division(size: int, divisions: int) -> int:
    """``roundup_power2_next_division``: ``size`` up to the next of ``divisions`` steps between powers of two."""
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    low = size & ~(step - 1)
    return size if low == size else low + step


def round_size(size: int, options: AllocatorOptions) -> int:
    """``round_size``: the block size for a request of ``size`` bytes (512 B multiples, or power-of-2 divisions)."""
    if size < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    divisions = options.divisions(size)
    if divisions > 1 and size > K_MIN_BLOCK_SIZE * divisions:
        return roundup_power2_next_division(size, divisions)
    return -(-size // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE


def get_allocation_size(size: int, options: AllocatorOptions) -> int:
    """``get_allocation_size``: the segment cudaMalloc'd for a rounded request that no cached block serves."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return options.large_segment_size
    return -(-size // K_ROUND_LARGE) * K_ROUND_LARGE


@dataclass(frozen=True)
class SegmentBlock:
    """One block of a segment as ``torch.cuda.memory_snapshot()`` lists it."""

    address: int
    size: int
    state: str
    """``allocated``, ``free``, or ``pending`` (freed, waiting for its uses on other streams to complete)."""
    block: int | None
    """Id of the trace block it holds (allocated or pending), else None."""
    requested: int


@dataclass(frozen=True)
class Segment:
    """One cudaMalloc'd segment, or one contiguous mapped range of an expandable segment."""

    address: int
    size: int
    stream: int
    pool: str
    """``small`` (requests up to 1 MiB) or ``large``."""
    expandable: bool
    blocks: tuple[SegmentBlock, ...]

    @property
    def allocated(self) -> int:
        return sum(b.size for b in self.blocks if b.state == "allocated")


class OutOfMemory(Exception):
    """``CUDA out of memory``: no cached block, no new segment under the capacity, even after releasing the cache."""

    def __init__(
        self, block: int, stream: int, requested: int, size: int, alloc_size: int, reserved: int
    ) -> None:
        self.block, self.stream, self.requested, self.size = block, stream, requested, size
        self.alloc_size, self.reserved = alloc_size, reserved
        super().__init__(
            f"block {block}: tried to allocate {alloc_size} bytes for {requested} requested on stream {stream} "
            f"with {reserved} bytes reserved"
        )


class _Seg:
    """A segment: a cudaMalloc, or an ExpandableSegment's address range (mapped in ``page``-sized pieces)."""

    __slots__ = ("address", "size", "stream", "small", "expandable", "page", "counter", "pool")

    def __init__(
        self,
        address: int,
        size: int,
        stream: int,
        small: bool,
        expandable: bool,
        page: int,
        counter: int,
        pool: _Pool,
    ) -> None:
        self.address, self.size, self.stream, self.small = address, size, stream, small
        self.expandable, self.page, self.counter, self.pool = expandable, page, counter, pool


class _Block:
    """``Block``: a piece of a segment, linked to its neighbours in the segment."""

    __slots__ = (
        "address",
        "size",
        "seg",
        "prev",
        "next",
        "allocated",
        "mapped",
        "requested",
        "events",
        "owner",
        "gc_base",
    )

    def __init__(self, address: int, size: int, seg: _Seg, mapped: bool = True) -> None:
        self.address, self.size, self.seg, self.mapped = address, size, seg, mapped
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.allocated = False
        self.requested = 0
        self.events = 0
        """event_count: uses on other streams not yet complete."""
        self.owner: int | None = None
        self.gc_base = 0
        """gc_count_base: the pool's get_free_block count when the block was cached."""

    def splice(self, before: _Block | None, after: _Block | None) -> None:
        if before is not None:
            before.next = self
        self.prev = before
        if after is not None:
            after.prev = self
        self.next = after

    @property
    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None


class _Pool:
    """One stream's part of a ``BlockPool``: free mapped blocks by (size, address) as ``BlockComparatorSize`` orders
    them, unmapped ones by address."""

    __slots__ = ("free", "unmapped")

    def __init__(self) -> None:
        self.free: list[tuple[int, int, _Block]] = []
        self.unmapped: list[tuple[int, _Block]] = []


def _allocatable(b: _Block | None) -> bool:
    return b is not None and not b.allocated and b.events == 0


def _expandable_size(b: _Block) -> int:
    nxt = b.next
    return b.size + (nxt.size if nxt is not None and not nxt.mapped else 0)


class CachingAllocatorModel:
    """``DeviceCachingAllocator`` for one device: ``malloc``/``free`` by block id, reserved and allocated bytes.

    ``capacity``: bytes the allocator can get from the device (cudaMalloc and page mapping fail beyond it);
    None: unlimited. ``per_process_memory_fraction`` < 1 limits reserved bytes to that fraction of it.
    """

    def __init__(self, options: AllocatorOptions | None = None, capacity: int | None = None) -> None:
        self.options = options or AllocatorOptions()
        if capacity is not None and capacity < 0:
            raise ValueError(f"capacity: must be >= 0 (got {capacity})")
        self.capacity = capacity
        fraction = self.options.per_process_memory_fraction
        # setMemoryFraction: a limit only below 1, rounded as std::round.
        self.allowed_maximum = (
            math.floor(fraction * capacity + 0.5) if capacity is not None and fraction < 1.0 else None
        )
        self.reserved = 0
        self.allocated = 0
        self.pending = 0
        self.peak_reserved = 0
        self.peak_allocated = 0
        self.device_allocs = 0
        """num_device_alloc: cudaMalloc calls and page mappings."""
        self.device_frees = 0
        """num_device_free: cudaFree calls and page unmappings."""
        self.alloc_retries = 0
        """num_alloc_retries: allocations retried after releasing every cached block."""
        self._live: dict[int, _Block | None] = {}
        self._events: dict[int, deque[tuple[int, _Block]]] = {}
        self._pools: dict[tuple[int, bool], _Pool] = {}
        self._gc_calls = {True: 0, False: 0}
        self._next_address = ADDRESS_BASE
        self._next_counter = 0
        self._gc_active = self.allowed_maximum is not None and self.options.garbage_collection_threshold > 0.0
        self._plain_rounding = not any(self.options.roundup_power2_divisions)
        self.next_segment_address: int | None = None
        """Address the next new segment gets (then reset to None); None: an invented one above all others."""

    # ----------------------------------------------------------------- public
    def malloc(self, block: int, size: int, stream: int = 0, task: int = 0) -> None:
        """``malloc``: give block ``block`` ``size`` requested bytes on ``stream``; raises ``OutOfMemory``."""
        if block in self._live:
            raise ValueError(f"block {block} is allocated twice")
        if size < 0:
            raise ValueError(f"block {block}: size must be >= 0 (got {size})")
        if self._events:
            self.process_events(task)
        if size == 0:  # NativeCachingAllocator::allocate hands out no memory for 0 bytes
            self._live[block] = None
            return
        opts = self.options
        if self._plain_rounding:
            rounded = max(-(-size // K_MIN_BLOCK_SIZE), 1) * K_MIN_BLOCK_SIZE
        else:
            rounded = round_size(size, opts)
        small = rounded <= K_SMALL_SIZE
        alloc_size = get_allocation_size(rounded, opts)
        found = self._get_free_block(stream, small, rounded)
        if found is None:
            if self._gc_active:
                self._garbage_collect_cached_blocks()
            found = self._alloc_block(stream, small, rounded, alloc_size, retry=False)
            if found is None and self._release_available_cached_blocks(stream, small, rounded):
                found = self._alloc_block(stream, small, rounded, alloc_size, retry=False)
            if found is None:
                self._release_cached_blocks()
                found = self._alloc_block(stream, small, rounded, alloc_size, retry=True)
            if found is None:
                raise OutOfMemory(block, stream, size, rounded, alloc_size, self.reserved)
        self._alloc_found_block(found, rounded, size, self._should_split(found, rounded), block)

    def free(
        self, block: int, use_streams: Iterable[int] = (), uses_done: int | None = None, task: int = 0
    ) -> None:
        """``free``: block ``block`` is freed at ``task``; if it was used on other streams (``recordStream``), it
        returns to its pool once those uses complete, at task ``uses_done`` (default ``task + 1``)."""
        if block not in self._live:
            raise ValueError(f"block {block} is freed but not allocated")
        b = self._live.pop(block)
        if b is None:
            return
        b.allocated = False
        self.allocated -= b.size
        # recordStream ignores uses on the allocation stream.
        streams = set(use_streams) - {b.seg.stream} if use_streams else ()
        if not streams:
            self._free_block(b)
            return
        done = task + 1 if uses_done is None else uses_done
        for s in sorted(streams):  # insert_events: one event per stream
            b.events += 1
            self._events.setdefault(s, deque()).append((done, b))
        self.pending += b.size

    def synchronize(self) -> None:
        """Every use of a freed block on another stream has completed (``torch.cuda.synchronize``, or the step
        boundary of :func:`hyperdryrun.allocator.replay.steady_state_events`): pending blocks return to their pools."""
        self._synchronize_and_free_events()

    def add_segment(
        self,
        address: int,
        size: int,
        stream: int,
        small: bool,
        allocated: Iterable[tuple[int, int, int, int]] = (),
    ) -> None:
        """Seed a cached segment that existed before the events (a warm cache): ``allocated`` holds its allocated
        blocks as (address, size, requested, block id); the gaps between them are free blocks of its pool."""
        end = address + size
        cursor, prev = address, None
        seg = _Seg(address, size, stream, small, False, size, self._next_counter, self._pool(stream, small))
        self._next_counter += 1
        pieces: list[_Block] = []
        for addr, bsize, requested, owner in sorted(allocated):
            if addr < cursor or addr + bsize > end or bsize <= 0:
                raise ValueError(
                    f"block {owner}: [{addr}, {addr + bsize}) is not free inside segment {address}"
                )
            if owner in self._live:
                raise ValueError(f"block {owner} is allocated twice")
            if addr > cursor:
                pieces.append(_Block(cursor, addr - cursor, seg))
            b = _Block(addr, bsize, seg)
            b.allocated, b.requested, b.owner = True, requested, owner
            self._live[owner] = b
            self.allocated += bsize
            pieces.append(b)
            cursor = addr + bsize
        if cursor < end:
            pieces.append(_Block(cursor, end - cursor, seg))
        for b in pieces:
            b.splice(prev, None)
            prev = b
        for b in pieces:
            if not b.allocated:
                self._insert_free(b)
        self.reserved += size
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self._next_address = max(self._next_address, -(-end // K_ROUND_LARGE) * K_ROUND_LARGE)

    def address_of(self, block: int) -> int | None:
        """The address block ``block`` was given (None: not allocated, or zero bytes)."""
        b = self._live.get(block)
        return None if b is None else b.address

    def process_events(self, task: int) -> None:
        """``process_events``: blocks whose uses on other streams have completed by ``task`` return to their pool."""
        for stream in list(self._events):
            queue = self._events[stream]
            while queue and queue[0][0] <= task:
                self._event_done(queue.popleft()[1])
            if not queue:
                del self._events[stream]

    def segments(self) -> list[Segment]:
        """``snapshot``: every segment with its blocks, by address (an expandable one as its mapped ranges)."""
        by_seg: dict[int, tuple[_Seg, list[_Block]]] = {}
        seen: set[int] = set()

        def add(b: _Block) -> None:
            if id(b) not in seen:
                seen.add(id(b))
                by_seg.setdefault(id(b.seg), (b.seg, []))[1].append(b)

        for b in self._live.values():
            if b is not None:
                add(b)
        for queue in self._events.values():
            for _, b in queue:
                add(b)
        for pool in self._pools.values():
            for entry in pool.free:
                add(entry[2])
            for _, b in pool.unmapped:
                add(b)
        out = []
        for seg, blocks in sorted(by_seg.values(), key=lambda sb: sb[0].address):
            blocks.sort(key=lambda b: b.address)
            runs: list[list[_Block]] = [[]]
            for b in blocks:
                if b.mapped:
                    runs[-1].append(b)
                elif runs[-1]:
                    runs.append([])
            for run in runs:
                if run:
                    out.append(self._segment(seg, run))
        return out

    # ----------------------------------------------------------------- pools
    def _pool(self, stream: int, small: bool) -> _Pool:
        pool = self._pools.get((stream, small))
        if pool is None:
            pool = self._pools[(stream, small)] = _Pool()
        return pool

    def _insert_free(self, b: _Block) -> None:
        """``insert_into_blocks``: also stamps the block's age base for garbage collection."""
        seg = b.seg
        b.owner = None
        b.gc_base = self._gc_calls[seg.small]
        insort(seg.pool.free, (b.size, b.address, b))

    def _remove_free(self, b: _Block) -> None:
        free = b.seg.pool.free
        i = bisect_left(free, (b.size, b.address))
        assert free[i][2] is b
        del free[i]

    def _insert_unmapped(self, b: _Block) -> None:
        insort(b.seg.pool.unmapped, (b.address, b))

    def _remove_unmapped(self, b: _Block) -> None:
        unmapped = b.seg.pool.unmapped
        i = bisect_left(unmapped, (b.address,))
        assert unmapped[i][1] is b
        del unmapped[i]

    def _new_segment(self, stream: int, small: bool, size: int, expandable: bool, page: int) -> _Seg:
        pool = self._pool(stream, small)
        address, self.next_segment_address = self.next_segment_address, None
        if address is None:
            address = self._next_address
            self._next_address += -(-size // K_ROUND_LARGE) * K_ROUND_LARGE
        seg = _Seg(address, size, stream, small, expandable, page, self._next_counter, pool)
        self._next_counter += 1
        return seg

    def _grow(self, nbytes: int) -> None:
        self.reserved += nbytes
        self.device_allocs += 1
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def _fits(self, nbytes: int) -> bool:
        return self.capacity is None or self.reserved + nbytes <= self.capacity

    # ----------------------------------------------------------------- malloc path
    def _get_free_block(self, stream: int, small: bool, size: int) -> _Block | None:
        """``get_free_block``: best fit on this stream, by (size, address)."""
        opts = self.options
        if self._gc_active:
            self._gc_calls[small] += 1
        pool = self._pools.get((stream, small))
        if pool is None:
            return None
        free = pool.free
        i = bisect_left(free, (size,))
        if i == len(free):
            return None
        b = free[i][2]
        if b.seg.expandable:  # "best fit" counts the unmapped space a block can grow into
            while i + 1 < len(free) and _expandable_size(free[i + 1][2]) < _expandable_size(free[i][2]):
                i += 1
            b = free[i][2]
        # An oversize block serves no request below max_split_size, and larger ones only within the rounding.
        max_split = opts.max_split_size
        if size < max_split:
            if b.size >= max_split:
                return None
        elif b.size >= size + opts.max_non_split_rounding_size:
            return None
        del free[i]
        return b

    def _should_split(self, b: _Block, size: int) -> bool:
        """``should_split``: small pool and expandable segments keep a remainder of 512 B, large one over 1 MiB."""
        remaining = b.size - size
        if b.seg.small or self.options.expandable_segments:
            return remaining >= K_MIN_BLOCK_SIZE
        return size < self.options.max_split_size and remaining > K_SMALL_SIZE

    def _alloc_found_block(self, b: _Block, size: int, requested: int, split: bool, owner: int) -> None:
        """``alloc_found_block``: the request takes the front of ``b``; a split leaves the rest free after it."""
        if split:
            rest = b
            b = _Block(rest.address, size, rest.seg)
            b.splice(rest.prev, rest)
            rest.address += size
            rest.size -= size
            self._insert_free(rest)
        b.allocated = True
        b.requested = requested
        b.owner = owner
        self._live[owner] = b
        self.allocated += b.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def _alloc_block(
        self, stream: int, small: bool, size: int, alloc_size: int, retry: bool
    ) -> _Block | None:
        """``alloc_block``: a new segment of ``alloc_size`` (cudaMalloc), or pages mapped into an expandable one."""
        if retry:
            self.alloc_retries += 1
        if self.allowed_maximum is not None and self.reserved + alloc_size > self.allowed_maximum:
            return None
        if self.options.expandable_segments:
            return self._try_allocate_expandable_block(stream, small, size)
        if not self._fits(alloc_size):
            return None
        seg = self._new_segment(stream, small, alloc_size, expandable=False, page=alloc_size)
        self._grow(alloc_size)
        return _Block(seg.address, alloc_size, seg)

    def _garbage_collect_cached_blocks(self) -> None:
        """``garbage_collect_cached_blocks``: above the threshold, release unsplit large blocks of above-average age."""
        assert self.allowed_maximum is not None
        threshold = int(self.options.garbage_collection_threshold * self.allowed_maximum)
        if self.reserved <= threshold:
            return
        target = self.reserved - threshold
        calls = self._gc_calls[False]

        def large_blocks() -> list[_Block]:
            return [e[2] for key in sorted(self._pools) if not key[1] for e in self._pools[key].free]

        ages = [calls - b.gc_base for b in large_blocks() if not b.is_split]
        total_age, count = sum(ages), len(ages)
        reclaimed, freed = 0, True
        while reclaimed < target and freed and count > 0:
            age_threshold = total_age / count
            freed = False
            for b in large_blocks():
                age = calls - b.gc_base
                if not b.is_split and not b.seg.expandable and age >= age_threshold:
                    freed = True
                    reclaimed += b.size
                    total_age -= age
                    count -= 1
                    self._release_block(b)

    def _release_available_cached_blocks(self, stream: int, small: bool, size: int) -> bool:
        """``release_available_cached_blocks``: with a max_split_size, cudaFree oversize blocks, largest first,
        until the request's size is freed."""
        max_split = self.options.max_split_size
        if max_split == SIZE_MAX:
            return False
        pool = self._pools.get((stream, small))
        free = pool.free if pool is not None else []
        key = max(size, max_split)
        i = bisect_left(free, (key,))
        if i < len(free) and not free[i][2].seg.expandable:
            self._release_block(free[i][2])
            return True
        if i == 0:
            return False
        j, released = i - 1, 0
        while released < key and free[j][2].size >= max_split:
            cur, first = free[j][2], j == 0
            if not first:
                j -= 1
            if not cur.seg.expandable:
                released += cur.size
                self._release_block(cur)
            if first:
                break
        return released >= key

    def _release_cached_blocks(self) -> None:
        """``release_cached_blocks``: wait for all streams, then cudaFree every unsplit cached block and unmap every
        free page of an expandable segment (``release_blocks``), large pool first."""
        self._synchronize_and_free_events()
        for small in (False, True):
            for key in sorted(k for k in self._pools if k[1] == small):
                to_unmap = []
                for entry in list(self._pools[key].free):
                    b = entry[2]
                    if b.seg.expandable:
                        to_unmap.append(b)
                    elif not b.is_split:
                        self._release_block(b)
                for b in to_unmap:
                    self._unmap_block(b)
                    if not b.mapped and not b.is_split:
                        self._remove_unmapped(b)  # release_expandable_segment

    def _release_block(self, b: _Block) -> None:
        """``release_block``: cudaFree an unsplit cached block's segment."""
        assert not b.seg.expandable and not b.is_split
        self._remove_free(b)
        self.reserved -= b.size
        self.device_frees += 1

    def _synchronize_and_free_events(self) -> None:
        """``synchronize_and_free_events``: every outstanding use completes; its blocks return to their pools."""
        for queue in self._events.values():
            for _, b in queue:
                self._event_done(b)
        self._events.clear()

    def _event_done(self, b: _Block) -> None:
        b.events -= 1
        if b.events == 0:
            self.pending -= b.size
            self._free_block(b)

    # ----------------------------------------------------------------- free path
    def _free_block(self, b: _Block) -> None:
        """``free_block``: merge with free neighbours (``try_merge_blocks``), back into the pool."""
        self._try_merge_blocks(b, b.prev)
        self._try_merge_blocks(b, b.next)
        self._insert_free(b)

    def _try_merge_blocks(self, dst: _Block, src: _Block | None) -> None:
        """``try_merge_blocks``: ``dst`` absorbs ``src`` if it is free, has no pending uses and the same mapping."""
        if src is None or src.allocated or src.events > 0 or src.mapped != dst.mapped:
            return
        if src.mapped:
            self._remove_free(src)
        else:
            self._remove_unmapped(src)
        if dst.prev is src:
            dst.address = src.address
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size

    # ----------------------------------------------------------------- expandable segments
    def _try_allocate_expandable_block(self, stream: int, small: bool, size: int) -> _Block | None:
        """``try_allocate_expandable_block``: map pages at the lowest address with room, growing the segment."""
        c = self._find_expandable_block(stream, small, size)
        if c is None:
            return None
        if not c.mapped and not self._map_block(c, min(c.size, size)):
            return None
        while c.size < size:
            nxt = c.next
            assert nxt is not None and not nxt.mapped
            if not self._map_block(nxt, min(size - c.size, nxt.size)):
                return None
            c = nxt
        self._remove_free(c)
        return c

    def _find_expandable_block(self, stream: int, small: bool, size: int) -> _Block | None:
        """``find_expandable_block``: the lowest free-or-unmapped run of ``size`` bytes in this stream's segments,
        else a new segment reserving address space for 9/8 of the device (one per stream and pool)."""
        pool = self._pool(stream, small)

        def has_room(b: _Block | None) -> bool:
            room = 0
            while room < size and _allocatable(b):
                assert b is not None
                room += b.size
                b = b.next
            return room >= size

        for _, c in pool.unmapped:
            start = c.prev if _allocatable(c.prev) else c
            if has_room(start):
                return start
        page = K_SMALL_BUFFER if small else self.options.large_segment_size
        total = DEFAULT_DEVICE_MEMORY if self.capacity is None else self.capacity
        reserve = -(-(total + total // 8) // page) * page
        if reserve < size:
            return None
        seg = self._new_segment(stream, small, reserve, expandable=True, page=page)
        c = _Block(seg.address, reserve, seg, mapped=False)
        self._insert_unmapped(c)
        return c

    def _map_block(self, b: _Block, size: int) -> bool:
        """``map_block``: map whole pages over the first ``size`` bytes of unmapped ``b`` (``ExpandableSegment::map``)."""
        seg = b.seg
        offset = b.address - seg.address
        mapped = (-(-(offset + size) // seg.page) - offset // seg.page) * seg.page
        if not self._fits(mapped):  # cuMemCreate fails: nothing of this call stays mapped
            return False
        self._remove_unmapped(b)
        b.mapped = True
        if mapped < b.size:
            rest = _Block(b.address + mapped, b.size - mapped, seg, mapped=False)
            rest.splice(b, b.next)
            self._insert_unmapped(rest)
            b.size = mapped
        self._try_merge_blocks(b, b.prev)
        self._try_merge_blocks(b, b.next)
        self._insert_free(b)
        self._grow(mapped)
        return True

    def _unmap_block(self, b: _Block) -> None:
        """``unmap_block``: unmap the whole pages inside free ``b``; partial pages stay mapped as free blocks."""
        seg = b.seg
        offset = b.address - seg.address
        begin, end = -(-offset // seg.page), (offset + b.size) // seg.page
        if begin >= end:
            return
        self._remove_free(b)
        start, length = seg.address + begin * seg.page, (end - begin) * seg.page
        before = start - b.address
        if before > 0:
            head = _Block(b.address, before, seg)
            head.splice(b.prev, b)
            self._insert_free(head)
        after = b.size - before - length
        if after > 0:
            tail = _Block(start + length, after, seg)
            tail.splice(b, b.next)
            self._insert_free(tail)
        b.address, b.size, b.mapped = start, length, False
        self._try_merge_blocks(b, b.prev)
        self._try_merge_blocks(b, b.next)
        self._insert_unmapped(b)
        self.reserved -= length
        self.device_frees += 1

    # ----------------------------------------------------------------- snapshot
    def _segment(self, seg: _Seg, run: list[_Block]) -> Segment:
        blocks = tuple(
            SegmentBlock(
                address=b.address,
                size=b.size,
                state="allocated" if b.allocated else ("pending" if b.events else "free"),
                block=b.owner,
                requested=b.requested if b.owner is not None else 0,
            )
            for b in run
        )
        return Segment(
            address=run[0].address,
            size=sum(b.size for b in run),
            stream=seg.stream,
            pool="small" if seg.small else "large",
            expandable=seg.expandable,
            blocks=blocks,
        )
