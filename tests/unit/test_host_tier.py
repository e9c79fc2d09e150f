"""The host tier of the prefix cache: HostTier's slots and eviction, and KVCacheManager moving
evicted blocks there and back (the copies owed, in order), with both tiers leak-checked."""

from __future__ import annotations

from engine.kv_cache.host_tier import HostTier
from engine.kv_cache.manager import BlockCopy, KVCacheManager
from engine.kv_cache.retention import RetentionRange
from engine.request import Request

BLOCK_SIZE = 4


def test_slots_evict_by_priority_then_lru_and_skip_lent_ones() -> None:
    tier = HostTier(2)
    a = tier.store(1, priority=35)
    b = tier.store(2, priority=90)
    assert tier.store(1, priority=35) is None  # already here
    for slot in (a, b):
        tier.release(slot, keep=True)
    c = tier.store(3, priority=35)  # full: the lowest priority (hash 1) goes
    assert c == a and not tier.has(1) and tier.has(2) and tier.num_dropped == 1
    assert tier.store(4, priority=35) == b  # the only unlent slot left, whatever its priority
    assert tier.store(5, priority=35) is None and tier.num_dropped == 3  # every slot lent
    tier.release(c, keep=True)
    tier.release(b, keep=True)
    slot = tier.take(4)
    tier.check_integrity({slot})
    tier.release(slot, keep=False)
    tier.check_integrity()
    assert tier.num_cached == 1 and tier.has(3)


def finished(kv: KVCacheManager, req_id: str, tokens: list[int]) -> None:
    req = Request(req_id, tokens)
    match = kv.match_prefix(req, partial=True)
    kv.allocate(req, len(tokens) - match.num_tokens, match)
    req.num_computed_tokens = len(tokens)
    kv.cache_full_blocks(req)
    kv.free(req)


def test_evicted_blocks_go_to_the_host_and_come_back_on_a_hit() -> None:
    kv = KVCacheManager(4, BLOCK_SIZE, "m", host_tier=HostTier(8))
    finished(kv, "a", list(range(1, 9)))  # 2 cached blocks
    assert kv.drain_copies() == []
    finished(kv, "b", list(range(100, 116)))  # 4 blocks: a's two are evicted, offloaded
    offloads = kv.drain_copies()
    assert [c.kind for c in offloads] == ["to_host", "to_host"]
    assert kv.host_tier is not None and kv.host_tier.num_cached == 2
    kv.check_integrity()
    again = Request("again", [*range(1, 9), 50])
    match = kv.match_prefix(again, partial=True)
    assert match.blocks == [] and len(match.host_hashes) == 2 and match.num_tokens == 8
    kv.allocate(again, 1, match)
    assert again.num_computed_tokens == 8
    copies = kv.drain_copies()
    # b's blocks make room first (offloaded in LRU order), then a's come back into them
    kinds = [c.kind for c in copies]
    assert kinds.count("to_host") == 3 and kinds[-2:] == ["from_host", "from_host"]
    table = kv.block_ids("again")
    host_slots = {c.dst_block_id for c in offloads}
    assert {(c.src_block_id, c.dst_block_id) for c in copies[-2:]} <= {
        (s, d) for s in host_slots for d in table[:2]
    }
    assert kv.num_host_hit_blocks == 2
    kv.check_integrity()
    kv.free(again)
    kv.check_integrity()
    assert kv.num_free_blocks == 4


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
    finished(kv, "y", [8, 8, 8, 8])  # evicts a's first block to the host
    kv.drain_copies()
    req = Request("b", [1, 2, 3, 4, 5, 6, *[0] * 5])  # host block, partial copy, a new one
    match = kv.match_prefix(req, partial=True)
    assert len(match.host_hashes) == 1 and match.partial_src is not None
    assert match.partial_src.block_id == src
    kv.allocate(req, 5, match)
    copies = kv.drain_copies()
    table = kv.block_ids("b")
    assert table[0] == src  # the copy back lands in the partial copy's source
    assert copies.index(BlockCopy(src, table[1])) < copies.index(
        next(c for c in copies if c.kind == "from_host")
    ), copies
    kv.free(req)
    kv.check_integrity()
    assert kv.num_free_blocks == 3
