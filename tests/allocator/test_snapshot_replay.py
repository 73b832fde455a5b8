"""The replay of a real snapshot's own events through the allocator model: the four shipped H200 snapshots, small
snapshots worked by hand, and ``hyperdryrun compare --replay``."""

from __future__ import annotations

import gzip
import pickle
from pathlib import Path

import pytest

from hyperdryrun.allocator import CachingAllocatorModel
from hyperdryrun.allocator.options import AllocatorOptions
from hyperdryrun.allocator.snapshot_replay import load_snapshot, replay_snapshot, start_state
from hyperdryrun.cli import OneLineParser
from hyperdryrun.commands.compare import register
from hyperdryrun.ingest.files import IngestError

DATA = Path(__file__).parent / "data"
MiB = 1 << 20
BASE = 1 << 40

# torch.cuda.max_memory_reserved() of the measured step on the H200 (/work/shared/gpu/h200_measured.json, rows
# p3-p6): the device's own peak counter, not derived from the snapshot's trace.
MEASURED_MAX_RESERVED = {
    "p3_8b8l_fsdp4_tp2": 22_947_037_184,
    "p4_readme_hsdp2x4_bf16_sgd_mb4": 39_556_481_024,
    "p5_readme_70b_fsdp64_tp8_acfull": 10_353_639_424,
    "p6_readme_8b_fsdp4_tp2": 53_921_972_224,
}


@pytest.mark.parametrize("name", sorted(MEASURED_MAX_RESERVED))
def test_shipped_snapshot_replays_exactly(name):
    data = load_snapshot(DATA / f"{name}.pickle.gz")
    allocs = sum(1 for e in data["device_traces"][0] if e["action"] == "alloc")
    r = replay_snapshot(data, name)
    measured = MEASURED_MAX_RESERVED[name]
    assert abs(r.model_peak_reserved - measured) <= 0.005 * measured  # the bar
    assert r.model_peak_reserved == measured  # and in fact to the byte
    assert r.recorded_peak_reserved == measured
    # Event by event: every request got the address the real allocator gave it, and each new segment matches.
    assert r.allocs == allocs and r.same_address == allocs
    assert r.first_divergence is None
    assert r.model_segment_allocs == r.recorded_segment_allocs
    for pool in r.pools:  # segment for segment at the end of the window
        assert pool.model_segments == pool.recorded_segments == pool.same_segments, pool
        assert pool.model_bytes == pool.recorded_bytes, pool


def test_cold_replay_of_p4_is_off_by_the_dry_runs_excess():
    """From an empty cache the model reserves more than the warm device did: about the +4.8% the dry run of p4 shows
    (ACCURACY.md), so the dry run's excess comes from the cache's history, not from its event order."""
    name = "p4_readme_hsdp2x4_bf16_sgd_mb4"
    r = replay_snapshot(load_snapshot(DATA / f"{name}.pickle.gz"), name, cold=True)
    assert 0.04 < r.relative_error < 0.06
    side = [p for p in r.pools if p.stream != 0]
    assert side and all(p.model_bytes == p.recorded_bytes for p in side)  # FSDP's side-stream pools match


# ----------------------------------------------------------------- small snapshots, worked by hand
def entry(action: str, addr: int, size: int, stream: int = 0) -> dict:
    return {"action": action, "addr": addr, "size": size, "stream": stream, "frames": []}


def segment(address: int, size: int, blocks: list[tuple[int, int, str]], stream: int = 0) -> dict:
    return {
        "device": 0,
        "address": address,
        "total_size": size,
        "stream": stream,
        "segment_type": "small" if size == 2 * MiB else "large",
        "blocks": [{"address": a, "size": s, "requested_size": s, "state": st} for a, s, st in blocks],
    }


def free(addr: int, size: int) -> list[dict]:
    return [entry("free_requested", addr, size), entry("free_completed", addr, size)]


def test_start_state_infers_blocks_alive_before_the_window():
    """A 20 MiB segment whose only block the window frees without allocating it: 19 MiB + 1 KiB requested, rounded
    to 512 B; the 1023 KiB left is at most 1 MiB, so the large pool handed the block out unsplit (20 MiB). The
    second segment was cudaMalloc'd in the window: not there at the start."""
    req = 19 * MiB + 1000
    data = {
        "segments": [
            segment(BASE, 20 * MiB, [(BASE, 20 * MiB, "inactive")]),
            segment(BASE - 64 * MiB, 20 * MiB, []),
        ],
        "device_traces": [[*free(BASE, req), entry("segment_alloc", BASE - 64 * MiB, 20 * MiB)]],
    }
    (seg,) = start_state(data, 0, AllocatorOptions())
    assert (seg.address, seg.size, seg.small) == (BASE, 20 * MiB, False)
    assert seg.blocks == ((BASE, 20 * MiB, req),)


def pending_free_snapshot(second_at: int, both_done_first: bool = False) -> dict:
    """Block R (20 MiB, alive at the start) is freed at entry 0 but used on another stream until entry 4: the
    19.5 MiB request at entry 2 cannot have it, so the allocator cudaMallocs a 20 MiB segment at a lower address
    (19.5 MiB rounded to 2 MiB; 0.5 MiB left: unsplit). That block is freed at entry 3, in use elsewhere until
    entry 6, so the request at entry 5 gets R's block. ``both_done_first``: both complete before that request."""
    low = BASE - 64 * MiB
    req = 19 * MiB + MiB // 2
    later = [entry("alloc", second_at, req), entry("free_completed", low, req)]
    trace = [
        entry("free_requested", BASE, 20 * MiB),
        entry("segment_alloc", low, 20 * MiB),
        entry("alloc", low, req),
        entry("free_requested", low, req),
        entry("free_completed", BASE, 20 * MiB),
        *(reversed(later) if both_done_first else later),
        *free(second_at, req),
    ]
    return {
        "segments": [
            segment(BASE, 20 * MiB, [(BASE, 20 * MiB, "inactive")]),
            segment(low, 20 * MiB, [(low, 20 * MiB, "inactive")]),
        ],
        "device_traces": [trace],
    }


def test_pending_free_waits_for_its_free_completed():
    r = replay_snapshot(pending_free_snapshot(second_at=BASE), "hand")
    # By hand: 20 MiB at the start, 40 MiB after the segment_alloc, never more.
    assert (r.recorded_start_reserved, r.recorded_peak_reserved, r.model_peak_reserved) == (
        20 * MiB,
        40 * MiB,
        40 * MiB,
    )
    assert r.model_segment_allocs == 1 and r.same_address == r.allocs == 2
    assert r.first_divergence is None


def test_first_divergent_event_is_reported():
    """With both blocks free before the second request, best fit sees two free 20 MiB blocks and takes the lower
    address (the newer segment). Recorded there: no divergence; recorded at R's block: entry 6 diverges, named
    with both addresses."""
    low = BASE - 64 * MiB
    agree = replay_snapshot(pending_free_snapshot(low, both_done_first=True), "hand")
    assert agree.first_divergence is None and agree.same_address == 2
    r = replay_snapshot(pending_free_snapshot(BASE, both_done_first=True), "hand")
    div = r.first_divergence
    assert div is not None and (div.event, div.action) == (6, "alloc")
    assert f"{BASE:#x}" in div.recorded and f"{low:#x}" in div.modelled
    assert r.same_address == 1


def test_best_fit_ties_go_to_the_lower_address_not_the_older_segment():
    """``BlockComparatorSize`` orders free blocks by (stream, size, ptr): of two free 20 MiB segments the lower
    address wins even when it is the newer one (cudaMalloc hands out addresses top-down on the device)."""
    m = CachingAllocatorModel()
    m.next_segment_address = BASE
    m.malloc(1, 20 * MiB)
    m.next_segment_address = BASE - 64 * MiB
    m.malloc(2, 20 * MiB)
    m.free(1)
    m.free(2)
    m.malloc(3, 5 * MiB)
    assert m.address_of(3) == BASE - 64 * MiB
    assert m.reserved == 40 * MiB


def test_add_segment_rejects_overlapping_blocks():
    m = CachingAllocatorModel()
    with pytest.raises(ValueError, match="block 2"):
        m.add_segment(
            BASE, 20 * MiB, 0, False, [(BASE, 8 * MiB, 8 * MiB, 1), (BASE + 4 * MiB, 8 * MiB, 1, 2)]
        )


# ----------------------------------------------------------------- the command
def cli(argv: list[str], capsys) -> tuple[int, str, str]:
    parser = OneLineParser(prog="hyperdryrun")
    register(parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser))
    try:
        args = parser.parse_args(["compare", *argv])
        rc = args.func(args)
    except SystemExit as exc:
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, err


def test_compare_replay_command(capsys, tmp_path):
    snap = str(DATA / "p3_8b8l_fsdp4_tp2.pickle.gz")
    rc, out, _ = cli(["--replay", snap], capsys)
    assert rc == 0
    assert "first divergent event: none" in out and "22,947,037,184" in out and "944/944" in out
    rc, out, _ = cli(["--replay", snap, "--cold"], capsys)  # +3.1% from an empty cache
    assert rc == 1 and "OUTSIDE tolerance" in out
    rc, out, _ = cli(["--replay", snap, "--cold", "--tolerance", "0.05"], capsys)
    assert rc == 0
    bad = tmp_path / "x.pickle.gz"
    bad.write_bytes(gzip.compress(b"not a pickle"))
    rc, out, err = cli(["--replay", str(bad)], capsys)
    assert rc == 2 and err.count("\n") == 1 and "x.pickle.gz" in err and "Traceback" not in err
    notsnap = tmp_path / "y.pickle"
    notsnap.write_bytes(pickle.dumps({"segments": 1}))
    rc, _, err = cli(["--replay", str(notsnap)], capsys)
    assert rc == 2 and "y.pickle" in err
    rc, _, err = cli(["--replay", snap, "other.json"], capsys)
    assert rc == 2 and "--replay" in err
    rc, _, err = cli(["only_a.json"], capsys)
    assert rc == 2 and "needs A and B" in err


def test_load_snapshot_names_the_file(tmp_path):
    p = tmp_path / "empty.pickle"
    p.write_bytes(b"")
    with pytest.raises(IngestError, match="empty.pickle"):
        load_snapshot(p)
