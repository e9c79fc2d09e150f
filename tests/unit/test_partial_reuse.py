"""KVCacheManager partial reuse: a prompt that diverges inside a cached block reuses that block's
matching tokens through a copy into a fresh block, counted exactly, isolated by cache salt, and
every table freed with the pool's invariants intact."""

from __future__ import annotations

from engine.kv_cache.manager import BlockCopy, KVCacheManager
from engine.step.request import Request

BLOCK_SIZE = 4


def cached(kv: KVCacheManager, req_id: str, tokens: list[int], salt: str | None = None) -> None:
    """A request that computed `tokens`, left its full blocks in the prefix cache and ended."""
    req = Request(req_id, tokens, cache_salt=salt)
    kv.allocate(req, len(tokens))
    req.num_computed_tokens = len(tokens)
    kv.cache_full_blocks(req)
    kv.free(req)


def admit(kv: KVCacheManager, req: Request) -> int:
    """Allocate req's prompt the way the scheduler admits it; returns the reused tokens."""
    match = kv.match_prefix(req, partial=True)
    kv.allocate(req, req.num_tokens - match.num_tokens, match)
    return match.num_tokens


def test_diverging_inside_a_block_reuses_its_matching_tokens() -> None:
    kv = KVCacheManager(16, BLOCK_SIZE, "m", partial_reuse_min_tokens=1)
    cached(kv, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    src = kv.pool.blocks[1]  # tokens 5..8: the second block of "a"
    assert src.token_ids == (5, 6, 7, 8)
    req = Request("b", [1, 2, 3, 4, 5, 6, 99, 100, 101])  # diverges at the 7th token
    assert admit(kv, req) == 6  # one full block + two tokens of the second
    assert req.num_computed_tokens == 6
    table = kv.block_ids("b")
    assert table[0] == 0 and table[1] != src.block_id  # shared first block, a fresh second
    assert kv.owed.drain_copies() == [BlockCopy(src.block_id, table[1])]
    assert kv.owed.drain_copies() == []  # each copy once
    assert kv.num_partial_reused_tokens == 2
    kv.check_integrity()
    kv.free(req)
    kv.check_integrity()
    assert kv.num_free_blocks == 16


def test_longest_matching_sibling_is_chosen_and_the_last_token_is_left_to_compute() -> None:
    kv = KVCacheManager(16, BLOCK_SIZE, "m", partial_reuse_min_tokens=1)
    cached(kv, "a", [1, 2, 3, 4, 5, 6, 7, 8])
    cached(kv, "b", [1, 2, 3, 4, 5, 9, 9, 9])
    req = Request("c", [1, 2, 3, 4, 5, 6, 7])  # every token of it is cached under "a"
    assert admit(kv, req) == 6  # not 7: the last prompt token yields the first logits
    under_a = next(b for b in kv.pool.blocks if b.token_ids == (5, 6, 7, 8))
    assert kv.owed.drain_copies()[0].src_block_id == under_a.block_id  # 2 tokens match, not 1
    kv.free(req)
    kv.check_integrity()


def test_threshold_salt_and_the_off_switch() -> None:
    kv = KVCacheManager(16, BLOCK_SIZE, "m", partial_reuse_min_tokens=3)
    cached(kv, "a", [1, 2, 3, 4, 5, 6, 7, 8], salt="tenant-a")
    short = Request("short", [1, 2, 3, 4, 5, 6, 0, 0], cache_salt="tenant-a")
    assert admit(kv, short) == 4  # 2 matching tokens < 3: full blocks only
    other = Request("other", [1, 2, 0, 0, 0], cache_salt="tenant-b")
    assert admit(kv, other) == 0  # another tenant's first block is not under its root
    first = Request("first", [1, 2, 3, 0, 0], cache_salt="tenant-a")
    assert admit(kv, first) == 3  # a first block reused in part, under the tenant's root
    assert first.num_computed_tokens == 3  # no full block before it: still counted computed
    assert kv.num_partial_reused_tokens == 3
    for req in (short, other, first):
        kv.free(req)
    kv.owed.drain_copies()
    off = KVCacheManager(16, BLOCK_SIZE, "m")  # partial_reuse_min_tokens=0
    cached(off, "a", [1, 2, 3, 4, 5, 6, 7, 8])
    req = Request("b", [1, 2, 3, 4, 5, 6, 0, 0])
    assert admit(off, req) == 4 and off.owed.drain_copies() == []
    off.free(req)
    kv.check_integrity()
    off.check_integrity()


def test_an_evicted_block_is_no_longer_offered_for_partial_reuse() -> None:
    kv = KVCacheManager(3, BLOCK_SIZE, "m", partial_reuse_min_tokens=1)
    cached(kv, "a", [1, 2, 3, 4, 5, 6, 7, 8])
    kv.pool.evict_all_cached()
    kv.check_integrity()
    req = Request("b", [1, 2, 3, 0, 0])
    assert admit(kv, req) == 0 and kv.owed.drain_copies() == []
    kv.free(req)
    kv.check_integrity()
