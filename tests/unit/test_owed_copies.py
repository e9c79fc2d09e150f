"""OwedCopies (engine/kv_cache/owed_copies.py) over a real BlockPool and HostTier: copies leave in
the order they were owed, each host slot is lent exactly while a copy or a pin uses it, a block
committed is copied behind the step, one evicted before its copy left gets it on the step's
stream, and the next step waits for an offload it would race."""

from __future__ import annotations

import pytest

from engine.kv_cache.block_copy import BlockCopy
from engine.kv_cache.block_pool import BlockPool, KVBlock
from engine.kv_cache.host_tier import HostTier
from engine.kv_cache.owed_copies import OwedCopies


def tiered(num_blocks: int = 2, num_slots: int = 4) -> tuple[BlockPool, HostTier, OwedCopies]:
    tier = HostTier(num_slots)
    owed = OwedCopies(tier, write_behind=True)
    pool = BlockPool(num_blocks)
    pool.on_evict = owed.evicted
    return pool, tier, owed


def committed(pool: BlockPool, owed: OwedCopies, block_hash: int) -> KVBlock:
    (block,) = pool.allocate(1)
    pool.cache_block(block, block_hash, None)
    owed.committed(block)
    return block


def test_a_committed_block_is_copied_behind_the_step_and_its_slot_released() -> None:
    pool, tier, owed = tiered()
    block = committed(pool, owed, 11)
    assert tier.has(11) and owed.drain_copies() == []  # nothing on the step's stream
    owed.check_integrity()  # the slot is lent to the copy owed behind the step
    assert owed.drain_offloads() == [BlockCopy(block.block_id, 0, "to_host")]
    assert owed.drain_offloads() == []  # each copy once
    owed.committed(block)  # its hash has a slot already: nothing more is owed
    assert owed.drain_offloads() == []
    owed.check_integrity()
    pool.free([block])
    pool.check_integrity()


def test_a_block_evicted_before_its_offload_left_gets_its_copy_before_the_step() -> None:
    pool, tier, owed = tiered(num_blocks=1)
    block = committed(pool, owed, 11)
    pool.free([block])
    owed.queue(BlockCopy(5, 6))  # a device copy owed first keeps its place
    (again,) = pool.allocate(1)  # evicts block 11, whose copy never left
    assert again is block and block.block_hash is None and tier.has(11)
    assert owed.drain_copies() == [BlockCopy(5, 6), BlockCopy(block.block_id, 0, "to_host")]
    assert owed.drain_offloads() == []
    owed.check_integrity()
    pool.free([again])


def test_a_host_hit_lends_its_slot_until_the_copy_back_is_drained() -> None:
    pool, tier, owed = tiered()
    block = committed(pool, owed, 11)
    owed.drain_offloads()
    pool.free([block])
    pool.evict_all_cached()
    (slot,) = owed.lend_hits([11])
    (fresh,) = pool.allocate(1)
    owed.reused([fresh])
    behind = owed.write_behind
    assert behind is not None and behind.must_wait  # the offload may still read or write them
    owed.queue(BlockCopy(slot, fresh.block_id, "from_host"))
    owed.check_integrity()
    with pytest.raises(AssertionError):
        tier.check_integrity()  # lent to the copy back until it is drained
    assert owed.drain_copies() == [BlockCopy(slot, fresh.block_id, "from_host")]
    tier.check_integrity()
    behind.settled()
    assert not behind.must_wait
    pool.free([fresh])


def test_pinned_copies_are_lent_until_unpinned_and_never_evicted() -> None:
    pool, tier, owed = tiered(num_blocks=3, num_slots=2)
    blocks = [committed(pool, owed, h) for h in (11, 12)]
    owed.drain_offloads()
    (uncommitted,) = pool.allocate(1)  # no hash: the pin stops before it
    slots = owed.pin_copies([*blocks, uncommitted])
    assert slots == [0, 1]
    owed.check_integrity(pinned=slots)
    with pytest.raises(AssertionError):
        owed.check_integrity()  # a pin nobody accounts for
    assert tier.store(13, priority=35) is None  # every slot pinned: nothing to evict
    owed.unpin(slots)
    owed.check_integrity()
    pool.free([*blocks, uncommitted])
    pool.check_integrity()


def test_without_a_host_tier_only_device_copies_are_owed() -> None:
    owed = OwedCopies()
    pool = BlockPool(2)
    block = committed(pool, owed, 11)
    owed.reused([block])
    owed.queue(BlockCopy(0, 1))
    owed.queue(BlockCopy(1, 0))
    assert owed.drain_copies() == [BlockCopy(0, 1), BlockCopy(1, 0)]
    assert owed.drain_offloads() == [] and owed.drain_events() == []
    assert owed.write_behind is None
    owed.check_integrity()
    pool.free([block])
