"""Retention by token range: validation naming the field, the per-block priorities a request's
ranges give, and the pool's eviction order with priorities that expire (a fake clock: this is a
unit test of the pool and the range module)."""

from __future__ import annotations

import pytest

from engine.kv_cache.block_pool import DEFAULT_PRIORITY, BlockPool
from engine.kv_cache.manager import KVCacheManager
from engine.kv_cache.retention import (
    InvalidRetention,
    RetentionRange,
    block_retention,
    check_ranges,
)
from engine.step.request import Request
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
    assert len(pool._expiring) <= 2 * pool.num_blocks + 1
    pool.check_integrity()
