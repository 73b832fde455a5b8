"""PYTORCH_CUDA_ALLOC_CONF for the allocator model: the keys, syntax, defaults and checks of the pinned torch.

Modelled on ``AcceleratorAllocatorConfig::parseArgs`` (c10/core/AllocatorConfig.cpp) and
``CUDAAllocatorConfig::parseArgs`` (c10/cuda/CUDAAllocatorConfig.cpp); see ``hyperdryrun.allocator`` for the
commits read. The key set of the generic parser was checked against the pinned torch 2.13.0 (git cf30153): its
``libc10.so`` names exactly the nine keys of ``ACCELERATOR_KEYS`` and its parser
(``torch._C._accelerator_setAllocatorSettings``) accepts and rejects the same values as this one, except that
this one also rejects numbers torch half-reads (``20.5`` read as 20, ``-5`` wrapped to the largest size).

Usage::

    options = AllocatorOptions.parse("expandable_segments:True,roundup_power2_divisions:[256:1,512:2,>:8]")
    options = AllocatorOptions.from_env()  # PYTORCH_CUDA_ALLOC_CONF, as torch reads it
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

MiB = 1 << 20
SIZE_MAX = (1 << 64) - 1
"""``std::numeric_limits<size_t>::max()``: ``max_split_size`` when it is not set (no block is oversize)."""
K_MIN_LARGE_ALLOC = 10 * MiB
"""kMinLargeAlloc: requests below it (and above 1 MiB) get a ``large_segment_size`` segment."""
DEFAULT_LARGE_SEGMENT_SIZE = 20 * MiB
"""kLargeBuffer: the default ``large_segment_size_mb``."""
ROUNDUP_INTERVALS = 16
"""kRoundUpPowerOfTwoIntervals: one division count per power of two from 1 MiB (index 0) to 32 GiB (index 15)."""
PINNED_MAX_REGISTER_THREADS = 128
ENV_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
"""The variables torch reads, in its order; the first one set wins (``AcceleratorAllocatorConfig::instance``)."""

ACCELERATOR_KEYS = (
    "large_segment_size_mb",
    "max_split_size_mb",
    "max_non_split_rounding_mb",
    "garbage_collection_threshold",
    "roundup_power2_divisions",
    "expandable_segments",
    "pinned_use_background_threads",
    "pinned_max_round_threshold_mb",
    "pinned_max_cached_size_mb",
)
CUDA_KEYS = (
    "backend",
    "release_lock_on_cudamalloc",
    "release_lock_on_hipmalloc",
    "pinned_use_cuda_host_register",
    "pinned_use_hip_host_register",
    "pinned_num_register_threads",
    "pinned_reserve_segment_size_mb",
    "graph_capture_record_stream_reuse",
    "per_process_memory_fraction",
    "pinned_free_catch_all",
    "throw_on_cudamalloc_oom",
    "expandable_segments_reserve",
    "expandable_segments_reserve_by_class",
)
"""Keys of ``CUDAAllocatorConfig::parseArgs`` in the copy read (a 2.15 pre-release; the last two may be newer
than 2.13, whose CUDA library the CPU wheel does not ship)."""
NO_EFFECT_KEYS = frozenset(ACCELERATOR_KEYS + CUDA_KEYS) - {
    "large_segment_size_mb",
    "max_split_size_mb",
    "max_non_split_rounding_mb",
    "garbage_collection_threshold",
    "roundup_power2_divisions",
    "expandable_segments",
    "per_process_memory_fraction",
    "backend",
}
"""Keys accepted and checked but with no effect on device memory: pinned host memory, locking, IPC, graphs.
``throw_on_cudamalloc_oom`` rejects what the memory fraction's limit (or, at 1, the device) already rejects, give
or take the byte its truncation differs by from ``setMemoryFraction``'s rounding."""


class AllocatorConfigError(ValueError):
    """A PYTORCH_CUDA_ALLOC_CONF string torch would reject: one line naming the key and the bad value."""


@dataclass(frozen=True)
class AllocatorOptions:
    """The caching allocator's settings, in bytes, with torch's defaults (an empty PYTORCH_CUDA_ALLOC_CONF)."""

    max_split_size: int = SIZE_MAX
    """Blocks at least this large are oversize: never split, reused only within ``max_non_split_rounding_size``."""
    max_non_split_rounding_size: int = DEFAULT_LARGE_SEGMENT_SIZE
    """How much larger than the request an oversize cached block may be and still serve it."""
    large_segment_size: int = DEFAULT_LARGE_SEGMENT_SIZE
    """Segment for a 1-10 MiB request; page size of the large pool's expandable segments."""
    garbage_collection_threshold: float = 0.0
    """Fraction of the allowed memory above which cached blocks are freed oldest first (needs a memory fraction)."""
    roundup_power2_divisions: tuple[int, ...] = (0,) * ROUNDUP_INTERVALS
    """Divisions per power-of-two interval (index 0: sizes below 2 MiB, 15: from 32 GiB); 0 or 1: no roundup."""
    expandable_segments: bool = False
    per_process_memory_fraction: float = 1.0
    """Below 1: the allocator may reserve at most this fraction of the device (``setMemoryFraction``)."""
    settings: str = ""
    """The string these options were parsed from."""
    no_effect: tuple[str, ...] = field(default=())
    """Keys given that were checked but change nothing this model reports."""

    @classmethod
    def parse(cls, settings: str, source: str = ENV_VARS[0]) -> AllocatorOptions:
        """Options from a PYTORCH_CUDA_ALLOC_CONF string (``key:value,key:[a:b,>:c]``), checked as torch checks it."""
        return _Parser(settings, source).parse()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> AllocatorOptions:
        """Options from the environment as torch reads them: the first of ``ENV_VARS`` that is set."""
        env = os.environ if environ is None else environ
        for var in ENV_VARS:
            if var in env:
                return cls.parse(env[var], source=var)
        return cls()

    def divisions(self, size: int) -> int:
        """``roundup_power2_divisions(size)``: the division count for ``size``'s power-of-two interval."""
        index = max(size.bit_length() - 1 - 20, 0)
        return self.roundup_power2_divisions[min(index, ROUNDUP_INTERVALS - 1)]


_TOKEN = re.compile(r"[,:\[\]]|[^,:\[\]]+")
_UINT = re.compile(r"[0-9]+")


class _Parser:
    """A ``ConfigTokenizer`` walk: tokens split at ``, : [ ]``, spaces dropped."""

    def __init__(self, settings: str, source: str) -> None:
        self.settings = settings
        self.source = source
        self.tokens = _TOKEN.findall(settings.replace(" ", ""))
        self.values: dict[str, object] = {}

    def error(self, key: str, message: str, value: object) -> AllocatorConfigError:
        shown = repr(value)
        if len(shown) > 80:  # a hostile value stays one readable line
            shown = f"{shown[:60]}... ({len(str(value)):,} characters)"
        return AllocatorConfigError(f"{self.source}: {key}: {message} (got {shown})")

    def token(self, i: int, key: str) -> str:
        if i >= len(self.tokens):
            raise self.error(key, "missing value", self.settings)
        return self.tokens[i]

    def expect(self, i: int, char: str, key: str) -> None:
        got = self.token(i, key)
        if got != char:
            raise self.error(key, f"expected {char!r}", got)

    def uint(self, i: int, key: str) -> int:
        text = self.token(i, key)
        if not _UINT.fullmatch(text):
            raise self.error(key, "expected a non-negative integer", text)
        if len(text.lstrip("0")) > len(str(SIZE_MAX)) or int(text) > SIZE_MAX:
            # torch reads it with std::stoull, which throws out_of_range beyond 2**64 - 1
            raise self.error(key, f"out of range (more than {SIZE_MAX})", text)
        return int(text)

    def real(self, i: int, key: str) -> float:
        text = self.token(i, key)
        try:
            value = float(text)
        except ValueError:
            raise self.error(key, "expected a number", text) from None
        if not math.isfinite(value):
            raise self.error(key, "expected a finite number", text)
        return value

    def boolean(self, i: int, key: str) -> bool:
        text = self.token(i, key)
        if text not in ("True", "False"):
            raise self.error(key, "expected True or False", text)
        return text == "True"

    def parse(self) -> AllocatorOptions:
        # large_segment_size_mb is read first wherever it stands: the bounds of the other sizes depend on it.
        large = DEFAULT_LARGE_SEGMENT_SIZE
        entries = list(self.entries())
        for key, i in entries:
            if key == "large_segment_size_mb":
                mb = self.uint(i + 2, key)
                if mb <= K_MIN_LARGE_ALLOC // MiB:
                    raise self.error(key, f"must be > {K_MIN_LARGE_ALLOC // MiB}", mb)
                large = min(mb, SIZE_MAX // MiB) * MiB
        out: dict[str, object] = {"large_segment_size": large, "max_non_split_rounding_size": large}
        no_effect: list[str] = []
        for key, i in entries:
            v = i + 2
            if key in ("max_split_size_mb", "max_non_split_rounding_mb"):
                mb = self.uint(v, key)
                if mb < large // MiB:
                    raise self.error(key, f"must be >= large_segment_size_mb ({large // MiB})", mb)
                name = "max_split_size" if key == "max_split_size_mb" else "max_non_split_rounding_size"
                out[name] = min(mb, SIZE_MAX // MiB) * MiB
            elif key == "garbage_collection_threshold":
                value = self.real(v, key)
                if not 0.0 < value < 1.0:
                    raise self.error(key, "must be in (0.0, 1.0)", value)
                out["garbage_collection_threshold"] = value
            elif key == "roundup_power2_divisions":
                out["roundup_power2_divisions"] = self.divisions(v, key)
            elif key == "expandable_segments":
                out["expandable_segments"] = self.boolean(v, key)
            elif key == "per_process_memory_fraction":
                value = self.real(v, key)
                if not 0.0 <= value <= 1.0:
                    raise self.error(key, "must be in [0.0, 1.0]", value)
                out["per_process_memory_fraction"] = value
            elif key == "backend":
                backend = self.token(v, key)
                if backend == "cudaMallocAsync":
                    raise self.error(key, "cudaMallocAsync is not the caching allocator this models", backend)
                if backend != "native":
                    raise self.error(key, "expected native or cudaMallocAsync", backend)
            elif key in NO_EFFECT_KEYS:
                self.check_no_effect(v, key)
                no_effect.append(key)
        return AllocatorOptions(**out, settings=self.settings, no_effect=tuple(no_effect))  # type: ignore[arg-type]

    def entries(self) -> list[tuple[str, int]]:
        """(key, index of the key) for each ``key:value`` entry; a trailing comma is allowed, as in torch."""
        out, i, n = [], 0, len(self.tokens)
        while i < n:
            key = self.tokens[i]
            if key not in ACCELERATOR_KEYS and key not in CUDA_KEYS:
                raise AllocatorConfigError(f"{self.source}: unrecognized key {key!r} (in {self.settings!r})")
            self.expect(i + 1, ":", key)
            end = self.value_end(i + 2, key)
            out.append((key, i))
            i = end + 1
            if i < n:
                if self.tokens[i] != ",":
                    raise self.error(key, "expected ',' after the value", "".join(self.tokens[i - 1 : i + 2]))
                i += 1
        return out

    def value_end(self, i: int, key: str) -> int:
        """Index of the value's last token: a single token, or a bracketed list up to its ``]``."""
        if self.token(i, key) != "[":
            if self.tokens[i] in ",:]":
                raise self.error(key, "missing value", self.settings)
            return i
        while self.token(i, key) != "]":
            i += 1
        return i

    def divisions(self, i: int, key: str) -> tuple[int, ...]:
        """``parseRoundUpPower2Divisions``: one power of two for all sizes, or ``[MiB:divisions,...,>:divisions]``."""
        table = [0] * ROUNDUP_INTERVALS
        if self.tokens[i] != "[":
            value = self.uint(i, key)
            if value <= 0 or value & (value - 1):
                raise self.error(key, "divisions must be a power of 2", value)
            return (value,) * ROUNDUP_INTERVALS
        first, last_index = True, 0
        i += 1
        while self.tokens[i] != "]":
            boundary = self.tokens[i]
            self.expect(i + 1, ":", key)
            value = self.uint(i + 2, key)
            if value & (value - 1):
                raise self.error(key, "divisions must be a power of 2 or 0", value)
            if boundary == ">":
                table[last_index + 1 :] = [value] * (ROUNDUP_INTERVALS - last_index - 1)
            else:
                if not _UINT.fullmatch(boundary) or int(boundary) == 0 or int(boundary) & (int(boundary) - 1):
                    raise self.error(key, "interval bounds must be powers of 2 (MiB) or >", boundary)
                index = min(int(boundary).bit_length() - 1, ROUNDUP_INTERVALS - 1)
                if first:
                    table[:index] = [value] * index
                    first = False
                table[index] = value
                last_index = index
            i += 3
            if self.tokens[i] != "]":
                self.expect(i, ",", key)
                i += 1
        return tuple(table)

    def check_no_effect(self, i: int, key: str) -> None:
        if key in ("expandable_segments_reserve", "expandable_segments_reserve_by_class"):
            return  # torch itself only warns on a bad value here
        if key.endswith("_mb"):
            mb = self.uint(i, key)
            if key == "pinned_reserve_segment_size_mb" and mb == 0:
                raise self.error(key, "must be greater than 0", mb)
        elif key == "pinned_num_register_threads":
            n = self.uint(i, key)
            if n == 0 or n & (n - 1) or n > PINNED_MAX_REGISTER_THREADS:
                raise self.error(key, f"must be a power of 2 up to {PINNED_MAX_REGISTER_THREADS}", n)
        else:
            self.boolean(i, key)
