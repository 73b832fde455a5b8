"""compat/torch_fake_tensor.py: the world's fake mode keys FakeTensorMode's cache with the same list torch builds,
argument kind by argument kind and at every op of real steps, and hands what it does not write to torch's own."""

from __future__ import annotations

import types

import pytest
import torch
from torch._subclasses._fake_tensor_utils import _CacheKeyState
from torch._subclasses.fake_tensor import FakeTensorMode, _BypassDispatchCache

from hyperdryrun.compat.torch_fake_tensor import METADATA_FIELDS, _flatten, _TorchsOwn, cache_key_flattener
from hyperdryrun.compat.torch_fsdp import shard_placement_result
from hyperdryrun.trace.tracker import TrackingFakeTensorMode

aten = torch.ops.aten


def _key(
    mode: FakeTensorMode, func, args, kwargs, torchs: bool, cache_key=FakeTensorMode._cache_key
) -> tuple:
    """The cache key of ``func(*args, **kwargs)`` under ``mode`` (or the bypass reason), built with the mode's own
    ``_prep_args_for_hash`` or, ``torchs``, with torch's for every call (an instance attribute: torch's method
    calls ``self._prep_args_for_hash`` for nested arguments and each tensor's shape and strides)."""
    if torchs:
        mode._prep_args_for_hash = types.MethodType(FakeTensorMode._prep_args_for_hash, mode)
    try:
        return cache_key(mode, _CacheKeyState(mode.shape_env), func, args, kwargs).key
    except _BypassDispatchCache as e:
        return ("bypass", e.reason)
    finally:
        if torchs:
            del mode._prep_args_for_hash


def test_the_world_uses_the_fast_key_on_every_supported_release():
    import dataclasses

    from torch._subclasses.fake_tensor import TensorMetadata

    assert tuple(f.name for f in dataclasses.fields(TensorMetadata)) == METADATA_FIELDS
    fast = cache_key_flattener()
    assert fast is not FakeTensorMode._prep_args_for_hash
    assert TrackingFakeTensorMode._prep_args_for_hash.__code__ is fast.__code__


def test_torchs_own_method_past_the_supported_releases_or_with_other_metadata_fields(monkeypatch):
    import dataclasses

    from torch._subclasses import fake_tensor

    from hyperdryrun.compat import versions

    monkeypatch.setattr(versions, "torch_version", lambda: "2.16.0")
    assert cache_key_flattener() is FakeTensorMode._prep_args_for_hash
    monkeypatch.setattr(versions, "torch_version", lambda: "2.13.0+cpu")
    assert cache_key_flattener() is not FakeTensorMode._prep_args_for_hash

    @dataclasses.dataclass
    class Renamed:  # a release that added a field
        dtype: torch.dtype
        shape: tuple
        extra: int

    monkeypatch.setattr(fake_tensor, "TensorMetadata", Renamed)
    assert cache_key_flattener() is FakeTensorMode._prep_args_for_hash


def test_every_argument_kind_gets_torchs_key_or_torchs_bypass():
    mode = TrackingFakeTensorMode()
    other = FakeTensorMode()
    with other:
        foreign = torch.empty(3)
    with mode:
        a = torch.empty(8, 4, dtype=torch.bfloat16)
        g = torch.empty(8, 4, requires_grad=True)
        cl = torch.empty(2, 3, 4, 5).to(memory_format=torch.channels_last)
        cl3 = torch.empty(2, 3, 4, 5, 6).to(memory_format=torch.channels_last_3d)
        odd4 = torch.empty(2, 3, 4, 5).transpose(1, 3)
        view = torch.empty(16, 8)[2:10, 1:5]
        z = torch.empty(4, dtype=torch.complex64).conj()
        neg = torch.empty(4, dtype=torch.complex64).conj().imag
        i = torch.empty(5, dtype=torch.int64)
        with torch.inference_mode():
            inf = torch.empty(3)
    const = mode.from_tensor(torch.ones(3), static_shapes=True)  # carries a constant
    plain = torch.ones(3)
    calls = [
        (aten.mm.default, (a, a.t()), {}),
        (aten.add.Tensor, (g, g), {"alpha": 2}),
        (aten.add.Tensor, (g, 1.0), {}),
        (aten.add.Tensor, (g, 1), {}),
        (aten.add.Tensor, (g, True), {}),
        (aten.view.default, (a, [4, 8]), {}),
        (aten.view.default, (a, torch.Size([32])), {}),
        (aten.clone.default, (cl,), {"memory_format": torch.channels_last}),
        (aten.clone.default, (cl3,), {}),
        (aten.clone.default, (odd4,), {}),
        (aten.clone.default, (view,), {}),
        (aten.clone.default, (z,), {}),
        (aten.clone.default, (neg,), {}),
        (aten.clone.default, (inf,), {}),
        (aten.index_select.default, (a, 0, i), {}),
        (aten._foreach_add.List, ([a, a], [a, a]), {"alpha": 0.5}),
        (aten._foreach_mul.ScalarList, ([g, g], [2, 2.5]), {}),
        (aten.sum.dim_IntList, (a, [0, 1], False), {"dtype": torch.float32}),
        (aten.empty.memory_format, ([2, 3],), {"dtype": torch.bfloat16, "layout": torch.strided}),
        (aten.empty.memory_format, ([2, 3],), {"device": torch.device("cpu"), "pin_memory": None}),
        (aten._to_copy.default, (a,), {"dtype": torch.float32, "device": "cpu"}),
        (aten.split.Tensor, (a, 2, -1), {}),
        (aten.mm.default, (a, foreign), {}),  # not this mode's fake: torch's bypass
        (aten.add.Tensor, (const, const), {}),  # a constant: torch's bypass
        (aten.add.Tensor, (plain, plain), {}),  # a real tensor: torch's bypass
        (aten.add.Tensor, (a, 1j), {}),  # an argument kind the fast path does not write (complex)
    ]
    for func, args, kwargs in calls:
        ours, theirs = _key(mode, func, args, kwargs, False), _key(mode, func, args, kwargs, True)
        assert ours == theirs, func
    # the fast path wrote what it could: its key holds each tensor's flattened metadata (not a bypass)
    assert _key(mode, aten.mm.default, (a, a.t()), {}, False)[0] is aten.mm.default
    assert _key(mode, aten.mm.default, (a, foreign), {}, False) == ("bypass", "not our fake")


def test_a_call_handed_to_torch_leaves_no_partial_key():
    """A call the fast path starts and then hands back (here: a slice after a tensor) is torch's whole, from the
    call's first argument: nothing the fast path appended is left in the key."""
    mode = TrackingFakeTensorMode()
    with mode:
        a = torch.empty(4)
    result: list[object] = ["before"]
    mode._prep_args_for_hash(result, (a, [1, slice(None)]), _CacheKeyState(), [])
    expected: list[object] = ["before"]
    mode._prep_args_for_hash = types.MethodType(FakeTensorMode._prep_args_for_hash, mode)
    try:
        mode._prep_args_for_hash(expected, (a, [1, slice(None)]), _CacheKeyState(), [])
    finally:
        del mode._prep_args_for_hash
    assert len(expected) > 20  # the tensor's metadata, then the list
    assert result == expected


@pytest.mark.parametrize(
    "job",
    [
        ["--model", "llama-tiny", "--world-size", "8", "--tp", "2", "--pp", "2", "--ac", "selective"],
        ["--model", "moe-tiny", "--world-size", "4", "--ep", "2", "--ac", "full"],
    ],
    ids=["tp-pp-sac", "moe-ep"],
)
def test_every_key_of_a_step_equals_torchs_and_the_reports_are_the_same(job, tmp_path, capsys, monkeypatch):
    """Every cache key the world's fake mode builds in a whole dry run (set-up, step, optimizer) equals the key
    torch's own method builds for the same call; and the reports equal those of a run on torch's own method."""
    from hyperdryrun.cli import main

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    argv = ["run", *job, "--seq-len", "32", "--num-micro-batches", "2", "--no-stacks", "--quiet"]
    if "--ep" in job and shard_placement_result() is None:  # torch 2.11: the experts as their own FSDP2 unit
        argv += ["--fsdp-wrap", "torchtitan-2024"]
    keys = {"equal": 0, "fast": 0}
    own = FakeTensorMode._cache_key

    def fast(mode, args) -> bool:
        try:
            _flatten(mode, [], args)
        except _TorchsOwn:
            return False
        return True

    def checking(self, state, func, args, kwargs):
        if isinstance(self, TrackingFakeTensorMode):
            ours, theirs = _key(self, func, args, kwargs, False), _key(self, func, args, kwargs, True)
            assert ours == theirs, func
            keys["equal"] += 1
            # a key the fast path wrote whole (not handed to torch's method) and not bypassed by torch
            keys["fast"] += ours[0] != "bypass" and fast(self, args) and fast(self, kwargs)
        return own(self, state, func, args, kwargs)

    outputs = {}
    for path in ("fast", "torch"):
        with monkeypatch.context() as m:
            if path == "fast":
                m.setattr(FakeTensorMode, "_cache_key", checking)
            else:
                m.setattr(TrackingFakeTensorMode, "_prep_args_for_hash", FakeTensorMode._prep_args_for_hash)
            assert main([*argv, "--output-dir", str(tmp_path / path)]) == 0
        out = tmp_path / path
        outputs[path] = {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    capsys.readouterr()
    # every key was checked equal above; the fast path wrote most of them (78-84 % here). How many keys a run
    # builds depends on the process's caches that earlier tests warmed (DTensor's sharding propagation): 1,430 alone,
    # 1,206 in the full suite, for the first job
    assert keys["equal"] > 500 and keys["fast"] > 0.6 * keys["equal"], keys
    assert len(outputs["torch"]) == 3 and outputs["fast"] == outputs["torch"]
