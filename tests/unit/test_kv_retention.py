"""Retention by token range: validation naming the field, the per-block priorities a request's
ranges give, the pool's eviction order with priorities that expire, and such a priority carried
with its deadline into the host and disk tiers (real block files), where it expires too (a
manual clock: the tiers' time)."""

from __future__ import annotations

import pytest
import torch

from engine.kv_cache.block_pool import DEFAULT_PRIORITY, BlockPool
from engine.kv_cache.disk_tier import DiskTier, Spill
from engine.kv_cache.expiry import Expiries, Held
from engine.kv_cache.host_tier import HostTier
from engine.kv_cache.manager import KVCacheManager
from engine.kv_cache.owed_copies import OwedCopies
from engine.kv_cache.retention import (
    InvalidRetention,
    RetentionRange,
    block_retention,
    check_ranges,
)
from engine.step.request import Request
from kvtransfer.disk_blocks import DiskBlockFiles, DiskLayout
from tests.manual_clock import ManualClock


@pytest.mark.parametrize(
    ("ranges", "field"),
    [
        ([RetentionRange(-1, 4, 50)], "kv_retention[0].start"),
        ([RetentionRange(0, 4, 50), RetentionRange(8, 8, 50)], "kv_retention[1].end"),
        ([RetentionRange(0, None, 101)], "kv_retention[0].priority"),
        ([RetentionRange(0, None, -1)], "kv_retention[0].priority"),
        ([RetentionRange(0, 4, 50, 0.0)], "kv_retention[0].duration_s"),
        ([RetentionRange(0, 4, 50, float("inf"))], "kv_retention[0].duration_s"),
        ([RetentionRange(i, None, 50) for i in range(17)], "kv_retention"),
    ],
)
def test_bad_ranges_name_their_field(ranges: list[RetentionRange], field: str) -> None:
    with pytest.raises(InvalidRetention) as info:
        check_ranges(ranges)
    assert info.value.field == field


def test_blocks_take_the_highest_overlapping_range_else_the_default() -> None:
    ranges = [
        RetentionRange(0, 8, 90, duration_s=30.0),  # blocks 0-1 (block size 4)
        RetentionRange(6, 13, 10),  # blocks 1-3, lower than the default
        RetentionRange(20, None, 60),  # block 5 onwards
    ]
    check_ranges(ranges)
    got = block_retention(ranges, 7, 4, DEFAULT_PRIORITY, now=100.0)
    assert got == [
        (90, 130.0),
        (90, 130.0),  # 90 beats 10 where both overlap
        (10, None),
        (10, None),
        (DEFAULT_PRIORITY, None),  # tokens 16..19: no range
        (60, None),
        (60, None),
    ]


def test_a_kept_block_outlives_the_default_ones_until_its_duration_ends() -> None:
    clock = ManualClock()
    pool = BlockPool(3, clock=clock)
    kept, plain, other = pool.allocate(3)
    for i, block in enumerate((kept, plain, other)):
        pool.cache_block(block, 100 + i, None)
    # freed first (oldest in LRU order) but kept at 90 for 10 s
    pool.free([kept], DEFAULT_PRIORITY, [(90, clock.now + 10.0)])
    pool.free([plain, other])
    assert pool.allocate(1)[0] is plain  # the default-priority LRU block goes first
    assert pool.lookup(100) is kept
    clock.now = 11.0  # the retention ran out: kept is the oldest default-priority block now
    assert pool.allocate(1)[0] is other  # LRU among equals: other was freed before kept fell back
    assert pool.allocate(1)[0] is kept
    pool.check_integrity({kept.block_id: 1, plain.block_id: 1, other.block_id: 1})


def test_a_block_reused_before_expiry_keeps_its_new_priority() -> None:
    clock = ManualClock()
    pool = BlockPool(2, clock=clock)
    a, b = pool.allocate(2)
    pool.cache_block(a, 1, None)
    pool.cache_block(b, 2, None)
    pool.free([a], DEFAULT_PRIORITY, [(90, 5.0)])
    pool.free([b])
    pool.touch([a])  # a hit: its expiry entry is stale from now on
    pool.free([a], DEFAULT_PRIORITY, [(95, None)])  # kept without a deadline this time
    clock.now = 6.0
    assert pool.allocate(1)[0] is b
    assert pool.lookup(1) is a and a.priority == 95
    pool.check_integrity({b.block_id: 1})


def test_the_manager_frees_each_block_with_its_ranges_priority_on_every_path() -> None:
    kv = KVCacheManager(8, 4, "m")
    ranges = (RetentionRange(0, 4, 80), RetentionRange(8, None, 5))
    for req_id, hold, first in (("freed", False, 1), ("held", True, 500)):
        req = Request(req_id, list(range(first, first + 12)), retention=ranges)
        kv.allocate(req, 12)
        req.num_computed_tokens = 12
        kv.cache_full_blocks(req)
        if hold:
            kv.keep(req)
            kv.release_kept(req_id)
        else:
            kv.free(req)
    priorities = sorted(b.priority for b in kv.pool.blocks if b.block_hash is not None)
    assert priorities == [5, 5, DEFAULT_PRIORITY, DEFAULT_PRIORITY, 80, 80]
    kv.check_integrity()


def test_stale_expiry_entries_do_not_pile_up_without_evictions() -> None:
    pool = BlockPool(2, clock=ManualClock())
    [block] = pool.allocate(1)
    pool.cache_block(block, 7, None)
    for _ in range(100):  # a long-lived retention, the block hit again and again
        pool.free([block], DEFAULT_PRIORITY, [(90, 3600.0)])
        pool.touch([block])
    pool.free([block], DEFAULT_PRIORITY, [(90, 3600.0)])
    assert len(pool.expiries) == 1 and pool.expiries.num_entries <= 2 + 65
    pool.check_integrity()


def test_expiries_keep_one_deadline_a_key_and_give_each_due_one_once() -> None:
    clock = ManualClock()
    due: Expiries[int] = Expiries(clock)
    due.hold(1, Held(5.0, 35))
    due.hold(2, Held(3.0, 10))
    due.hold(1, Held(8.0, 20))  # a newer hold voids the older
    due.hold(3, Held(4.0, 35))
    assert due.cancel(3) == Held(4.0, 35) and due.cancel(3) is None
    clock.now = 6.0
    assert due.due() == [(2, 10)] and due.due() == []
    assert due.held(1) == Held(8.0, 20)
    clock.now = 8.0
    assert due.due() == [(1, 20)] and len(due) == 0


def test_a_priority_held_for_a_while_holds_in_the_host_and_disk_tiers_then_falls_back(
    tmp_path,
) -> None:
    clock = ManualClock()
    pool = BlockPool(2, clock=clock)
    host = HostTier(1, clock=clock)
    kv = torch.randn(4, 2, 2, 2, 16, 8)
    files = DiskBlockFiles(tmp_path, DiskLayout.of("m", kv), kv.dtype)
    disk = DiskTier(2, files, clock=clock)
    owed = OwedCopies(host, disk_tier=disk)
    pool.on_evict = owed.evicted

    def spill_all() -> None:
        owed.drain_copies()  # the copies into the host tier are queued: their slots released
        for spill in owed.drain_spills():
            disk.put(spill, kv[spill.block_hash % 4])

    kept, plain = pool.allocate(2)
    pool.cache_block(kept, 1, None)
    pool.cache_block(plain, 2, None)
    pool.free([kept], DEFAULT_PRIORITY, [(90, 10.0)])  # 90 until t=10, then the default
    pool.free([plain])
    pool.allocate(1)  # plain leaves the device first (35 < 90) for the host tier
    assert [e[0] for e in host.entries()] == [2]
    owed.drain_copies()
    pool.allocate(1)  # then kept: it takes the host slot with its deadline; plain goes to disk
    spill_all()
    assert host.entries() == [(1, 0, 90, Held(10.0, DEFAULT_PRIORITY))]
    host.store(3, DEFAULT_PRIORITY)  # kept is the only block here: it leaves for the disk
    spill_all()
    assert disk.has(1) and disk.has(2)
    # on disk it still ranks at 90 (the default-priority block goes first), while its file
    # records what outlives this process: a restart's clock starts again
    assert files.hint(1) == (DEFAULT_PRIORITY, 0)
    disk.put(Spill(4, 0, True, DEFAULT_PRIORITY), kv[0])
    assert disk.has(1) and not disk.has(2)
    clock.now = 11.0  # the deadline passed: kept ranks as a default-priority block now
    disk.put(Spill(5, 0, True, DEFAULT_PRIORITY), kv[1])
    disk.put(Spill(6, 0, True, DEFAULT_PRIORITY), kv[2])
    assert not disk.has(1) and disk.has(6)
    assert files.scan().priorities == {5: DEFAULT_PRIORITY, 6: DEFAULT_PRIORITY}
    host.check_integrity({0})  # block 3's copy into its slot is still owed
    disk.check_integrity()
    pool.check_integrity({0: 1, 1: 1})


def test_a_clean_shutdowns_spills_carry_each_blocks_deadline(tmp_path) -> None:
    """flush_to_disk's spills (OwedCopies.spill_all): the host tier's blocks and the device's,
    each with the deadline its priority holds to, so the files record the fallback."""
    clock = ManualClock()
    pool, host = BlockPool(2, clock=clock), HostTier(1, clock=clock)
    kv = torch.zeros(2, 1, 2, 1, 4, 2)
    disk = DiskTier(4, DiskBlockFiles(tmp_path, DiskLayout.of("m", kv), kv.dtype))
    owed = OwedCopies(host, disk_tier=disk)
    on_host, on_device = pool.allocate(2)
    pool.cache_block(on_host, 1, None)
    pool.cache_block(on_device, 2, None)
    pool.free([on_host, on_device], DEFAULT_PRIORITY, [(90, 10.0), (80, 20.0)])
    host.store(1, 90, Held(10.0, DEFAULT_PRIORITY))
    owed.spill_all([on_device], pool.expiries.held)
    assert owed.drain_spills() == [
        Spill(1, 0, True, 90, Held(10.0, DEFAULT_PRIORITY)),
        Spill(2, on_device.block_id, False, 80, Held(20.0, DEFAULT_PRIORITY)),
    ]


def test_a_reused_block_starts_at_the_default_and_a_held_one_taken_again_at_its_fallback() -> None:
    """What the host tier stores a committed block at (its priority while in use): a block
    reused for another hash does not carry its last occupant's 90, and a block kept at 90 for a
    while and hit again carries the priority its hold falls back to, which outlives the hold (a
    clean stop's spill records it)."""
    clock = ManualClock()
    pool = BlockPool(2, clock=clock)
    kept, reused = pool.allocate(2)
    pool.cache_block(kept, 1, None)
    pool.cache_block(reused, 2, None)
    pool.free([reused], DEFAULT_PRIORITY, [(90, None)])  # 90 for good
    pool.free([kept], DEFAULT_PRIORITY, [(95, 10.0)])  # 95 until t=10, then the default
    pool.touch([kept])  # hit again while held
    assert kept.priority == DEFAULT_PRIORITY and len(pool.expiries) == 0
    [again] = pool.allocate(1)  # the only free one: block 2's, evicted
    assert again is reused and again.priority == DEFAULT_PRIORITY
    pool.check_integrity({kept.block_id: 1, reused.block_id: 1})
