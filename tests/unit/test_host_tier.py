"""The host tier of the prefix cache: HostTier's slots and eviction, and KVCacheManager moving
evicted blocks there and back (the copies owed, in order), with both tiers leak-checked."""

from __future__ import annotations

from engine.kv_cache.host_tier import HostTier
from engine.kv_cache.manager import BlockCopy, KVCacheManager
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


def test_a_partial_reuse_source_is_never_evicted_for_the_blocks_beside_it() -> None:
    kv = KVCacheManager(4, BLOCK_SIZE, "m", partial_reuse_min_tokens=1, host_tier=HostTier(4))
    finished(kv, "a", [1, 2, 3, 4, 5, 6, 7, 8])  # blocks 0 and 1 cached, two uncached free
    req = Request("b", [1, 2, 3, 4, 5, 6, *[0] * 6])  # 1 + 2 new blocks + the source: all 4
    match = kv.match_prefix(req, partial=True)
    assert match.partial_src is not None and kv.can_allocate(req, 6, match)
    src = match.partial_src.block_id
    kv.allocate(req, 6, match)
    assert src not in kv.block_ids("b")  # the new blocks came from elsewhere
    assert kv.drain_copies() == [BlockCopy(src, kv.block_ids("b")[1])]  # nothing offloaded
    kv.free(req)
    kv.check_integrity()


def test_a_full_pool_falls_back_to_whole_blocks() -> None:
    kv = KVCacheManager(3, BLOCK_SIZE, "m", partial_reuse_min_tokens=1)
    finished(kv, "a", [1, 2, 3, 4, 5, 6, 7, 8])
    req = Request("b", [1, 2, 3, 4, 5, 6, *[0] * 5])  # 3 blocks: the source cannot stay too
    match = kv.match_prefix(req, partial=True)
    assert not kv.can_allocate(req, 5, match)
    whole = match.without_partial()
    assert whole.num_tokens == 4 and kv.can_allocate(req, 7, whole)
