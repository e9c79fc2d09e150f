"""The host tier of the prefix cache: HostTier's slots and eviction, and KVCacheManager copying
committed blocks there behind the step and back on a hit (the copies owed, in order, and when a
step must wait for the offload stream), with both tiers leak-checked."""

from __future__ import annotations

from engine.kv_cache.host_tier import HostTier
from engine.kv_cache.manager import BlockCopy, KVCacheManager
from engine.kv_cache.retention import RetentionRange
from engine.kv_cache.write_behind import WriteBehind
from engine.step.request import Request

BLOCK_SIZE = 4


def test_slots_evict_by_priority_then_lru_and_skip_lent_ones() -> None:
    tier = HostTier(2)
    a = tier.store(1, priority=35)
    b = tier.store(2, priority=90)
    assert tier.store(1, priority=35) is None  # already here
    for slot in (a, b):
        tier.release(slot)
    c = tier.store(3, priority=35)  # full: the lowest priority (hash 1) goes
    assert c == a and not tier.has(1) and tier.has(2) and tier.num_dropped == 1
    assert tier.store(4, priority=35) == b  # the only unlent slot left, whatever its priority
    assert tier.store(5, priority=35) is None and tier.num_dropped == 3  # every slot lent
    tier.release(c)
    tier.release(b)
    slot = tier.lend(4)  # a hit: lent until its copy back is queued, and it stays here
    tier.check_integrity({slot})
    tier.release(slot)
    tier.check_integrity()
    assert tier.num_cached == 2 and tier.has(3) and tier.has(4)
    assert tier.store(6, priority=35) == c  # 4 was read last: 3 is the oldest
    tier.release(c)
    tier.refresh(4, priority=10)  # left the device with a lower priority: it goes first
    assert tier.store(7, priority=35) == b and not tier.has(4)
    tier.release(b)
    tier.check_integrity()


def finished(kv: KVCacheManager, req_id: str, tokens: list[int]) -> None:
    req = Request(req_id, tokens)
    match = kv.match_prefix(req, partial=True)
    kv.allocate(req, len(tokens) - match.num_tokens, match)
    req.num_computed_tokens = len(tokens)
    kv.cache_full_blocks(req)
    kv.free(req)


def test_committed_blocks_are_copied_behind_the_step_and_come_back_on_a_hit() -> None:
    kv = KVCacheManager(4, BLOCK_SIZE, "m", host_tier=HostTier(8))
    behind = kv.owed.write_behind
    assert behind is not None and kv.host_tier is not None
    finished(kv, "a", list(range(1, 9)))  # 2 cached blocks, each given a host slot at once
    assert kv.owed.drain_copies() == []  # nothing on the step's stream
    a_offloads = kv.owed.drain_offloads()
    assert [c.kind for c in a_offloads] == ["to_host", "to_host"] and kv.host_tier.num_cached == 2
    assert behind.in_flight and not behind.must_wait
    finished(kv, "b", list(range(100, 116)))  # 4 blocks: a's two are evicted while in flight
    assert kv.owed.drain_copies() == []  # their copies are in host memory (or on their way)
    assert behind.must_wait  # the next step overwrites blocks an offload may still read
    behind.settled()
    kv.check_integrity()
    again = Request("again", [*range(1, 9), 50])
    match = kv.match_prefix(again, partial=True)
    assert match.blocks == [] and len(match.host_hashes) == 2 and match.num_tokens == 8
    kv.allocate(again, 1, match)
    assert again.num_computed_tokens == 8
    copies = kv.owed.drain_copies()
    # b's blocks are evicted before their offloads were issued: those copies move onto the
    # step's stream, ahead of a's copies back into the same blocks
    kinds = [c.kind for c in copies]
    assert kinds == ["to_host"] * 3 + ["from_host"] * 2, kinds
    table = kv.block_ids("again")
    a_slots = {c.dst_block_id for c in a_offloads}
    assert {(c.src_block_id, c.dst_block_id) for c in copies[-2:]} <= {
        (s, d) for s in a_slots for d in table[:2]
    }
    assert [c.kind for c in kv.owed.drain_offloads()] == ["to_host"]  # b's last block, still cached
    assert kv.num_host_hit_blocks == 2 and kv.host_tier.num_cached == 6  # the tiers overlap
    kv.check_integrity()
    kv.free(again)
    kv.check_integrity()
    assert kv.num_free_blocks == 4


def test_write_behind_waits_only_for_blocks_and_slots_in_flight() -> None:
    behind = WriteBehind()
    behind.owe(BlockCopy(3, 7, "to_host"))
    assert behind.take_owed(3) == BlockCopy(3, 7, "to_host") and not behind.owed
    behind.owe(BlockCopy(4, 8, "to_host"))
    behind.reuse_block(4)  # owed, not issued: its copy goes on the step's stream instead
    assert not behind.must_wait
    assert behind.issue() == [BlockCopy(4, 8, "to_host")] and behind.in_flight
    behind.reuse_block(5)
    behind.read_slot(7)
    assert not behind.must_wait
    behind.read_slot(8)  # a copy back from the slot the offload is writing
    assert behind.must_wait
    behind.settled()
    behind.reuse_block(4)
    assert not behind.must_wait and not behind.in_flight


def test_a_partial_copy_reads_its_source_before_any_copy_back_overwrites_it() -> None:
    """The prompt's first block comes back from the host into the very block its partial copy
    reads (the pool is full and evicts it): the partial copy is queued first."""
    kv = KVCacheManager(3, BLOCK_SIZE, "m", partial_reuse_min_tokens=1, host_tier=HostTier(8))
    now = [0.0]
    kv.pool.clock = lambda: now[0]  # a unit test of the manager: the retention's clock
    a = Request("a", [1, 2, 3, 4, 5, 6, 7, 8], retention=(RetentionRange(4, 8, 90, 10.0),))
    kv.allocate(a, 8)
    a.num_computed_tokens = 8
    kv.cache_full_blocks(a)
    src = kv.block_ids("a")[1]
    kv.free(a)
    finished(kv, "x", [9, 9, 9, 9])  # the free block
    now[0] = 11.0  # a's second block falls back to the default priority, behind x's
    finished(kv, "y", [8, 8, 8, 8])  # evicts a's first block (in the host since its commit)
    kv.owed.drain_copies()
    kv.owed.drain_offloads()
    req = Request("b", [1, 2, 3, 4, 5, 6, *[0] * 5])  # host block, partial copy, a new one
    match = kv.match_prefix(req, partial=True)
    assert len(match.host_hashes) == 1 and match.partial_src is not None
    assert match.partial_src.block_id == src
    kv.allocate(req, 5, match)
    copies = kv.owed.drain_copies()
    table = kv.block_ids("b")
    assert table[0] == src  # the copy back lands in the partial copy's source
    assert copies.index(BlockCopy(src, table[1])) < copies.index(
        next(c for c in copies if c.kind == "from_host")
    ), copies
    kv.free(req)
    kv.check_integrity()
    assert kv.num_free_blocks == 3


def test_kept_blocks_on_host_pin_the_host_copies_and_free_their_device_blocks() -> None:
    kv = KVCacheManager(4, BLOCK_SIZE, "m", host_tier=HostTier(8), keep_on_host=True)
    tier = kv.host_tier
    assert tier is not None
    req = Request("p", list(range(1, 11)))  # 2 full blocks and a partial one
    kv.allocate(req, 10)
    req.num_computed_tokens = 10
    kv.cache_full_blocks(req)
    partial = kv.block_ids("p")[2]
    kept = kv.keep(req)
    ids = kept.block_ids
    assert kept.num_host_blocks == 2 and ids[2] == partial  # slots first, then device
    assert kv.kept.block_ids() == {"p": tuple(ids)}
    assert kv.num_free_blocks == 3  # the leading blocks are free on the device (still cached)
    kv.owed.drain_offloads()
    kv.check_integrity()  # the kept slots count as lent
    for i in range(4):  # 8 more blocks through an 8-slot tier: everything unpinned is evicted
        finished(kv, f"x{i}", list(range(100 + 8 * i, 108 + 8 * i)))
        kv.owed.drain_copies()
        kv.owed.drain_offloads()
    assert all(tier.has(h) for h in req.block_hashes[:2])  # pinned: never evicted
    assert kv.release_kept("p") and not kv.release_kept("p")
    kv.check_integrity()
    assert kv.num_free_blocks == 4 and len(kv.kept) == 0


def test_a_duplicate_of_a_cached_block_gets_no_host_slot() -> None:
    """Two requests compute the same prefix at once: the second's block is not cached (the
    first writer wins), so it is neither given a slot nor copied."""
    kv = KVCacheManager(8, BLOCK_SIZE, "m", host_tier=HostTier(8))
    first, second = Request("a", [1, 2, 3, 4, 5]), Request("b", [1, 2, 3, 4, 6])
    for req in (first, second):
        kv.allocate(req, 5)
        req.num_computed_tokens = 5
    for req in (first, second):
        kv.cache_full_blocks(req)
    offloads = kv.owed.drain_offloads()
    assert [c.src_block_id for c in offloads] == [kv.block_ids("a")[0]]
    for req in (first, second):
        kv.free(req)
    kv.check_integrity()
