"""BlockPool: ref counts, prefix cache, eviction by priority then LRU, events, integrity."""

from __future__ import annotations

import pytest

from engine.kv_cache.block_pool import BlockPool, BlockRemoved, BlockStored, NoFreeBlocksError


def test_allocate_and_free_restore_count():
    pool = BlockPool(8)
    blocks = pool.allocate(5)
    assert pool.num_free_blocks == 3
    pool.check_integrity({b.block_id: 1 for b in blocks})
    pool.free(blocks)
    assert pool.num_free_blocks == 8
    pool.check_integrity()


def test_over_allocation_and_double_free_raise():
    pool = BlockPool(2)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(3)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(blocks)


def test_cached_block_survives_free_and_is_found():
    pool = BlockPool(4)
    [block] = pool.allocate(1)
    pool.cache_block(block, 111, None)
    pool.free([block])
    assert pool.lookup(111) is block
    pool.touch([block])
    assert block.ref_cnt == 1 and pool.num_free_blocks == 3
    pool.free([block])
    pool.check_integrity()


def test_uncached_blocks_are_used_before_cached_ones():
    pool = BlockPool(3)
    [cached] = pool.allocate(1)
    pool.cache_block(cached, 7, None)
    pool.free([cached])
    fresh = pool.allocate(2)
    assert cached not in fresh
    assert pool.lookup(7) is cached


def test_eviction_order_priority_then_lru():
    pool = BlockPool(4, record_events=True)
    blocks = pool.allocate(4)
    for i, block in enumerate(blocks):
        pool.cache_block(block, 100 + i, None)
    pool.free([blocks[0]], priority=80)  # kept longest
    pool.free([blocks[1]], priority=10)
    pool.free([blocks[2]], priority=10)
    pool.free([blocks[3]], priority=50)
    pool.drain_events()
    evicted = [pool.allocate(1)[0] for _ in range(4)]
    assert evicted == [blocks[1], blocks[2], blocks[3], blocks[0]]
    assert pool.drain_events() == [BlockRemoved((h,)) for h in (101, 102, 103, 100)]


def test_events_in_order_and_duplicates_ignored():
    pool = BlockPool(4, record_events=True)
    a, b = pool.allocate(2)
    pool.cache_block(a, 1, None)
    pool.cache_block(b, 1, None)  # same content computed twice: first writer wins
    assert pool.drain_events() == [BlockStored((1,), None)]
    assert b.block_hash is None
    pool.free([a, b])
    assert pool.num_free_blocks == 4
    pool.check_integrity()


def test_integrity_detects_wrong_refcount():
    pool = BlockPool(2)
    pool.allocate(1)
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_take_freed_names_the_blocks_left_unreferenced_since_the_last_call():
    """What the engine's copy-back stream must not overwrite early: blocks freed after the
    step in flight was launched (shared blocks count once their last reference goes)."""
    pool = BlockPool(6)
    a, b, c = pool.allocate(3)
    pool.cache_block(b, 222, None)
    pool.touch([b])  # a second reference
    pool.free([a, b])
    assert pool.take_freed() == {a.block_id}
    assert not pool.freed_lately([a.block_id, b.block_id])
    pool.free([b, c])  # b's last reference: it stays cached, still one to wait for
    assert pool.freed_lately([b.block_id]) and not pool.freed_lately([a.block_id])
    assert pool.take_freed() == {b.block_id, c.block_id}
    assert pool.take_freed() == set()
    pool.check_integrity()
