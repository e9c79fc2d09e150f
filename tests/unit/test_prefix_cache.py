"""PrefixCache (engine/kv_cache/prefix_cache.py) over a real BlockPool and HostTier: a match
finds the device blocks, then the host tier's, leaves the last token to compute, never crosses a
cache_salt, and past the full blocks finds the cached block that continues the prompt longest;
committing a block makes it findable and owes its copy into the host tier."""

from __future__ import annotations

from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.host_tier import HostTier
from engine.kv_cache.owed_copies import OwedCopies
from engine.kv_cache.prefix_cache import NO_MATCH, PrefixCache, common_prefix_len
from engine.step.request import Request

BLOCK_SIZE = 4


def make_cache(partial_min: int = 0, host_slots: int = 0) -> PrefixCache:
    tier = HostTier(host_slots) if host_slots else None
    owed = OwedCopies(tier, write_behind=True)
    pool = BlockPool(8, sibling_key_len=partial_min)
    return PrefixCache(pool, BLOCK_SIZE, "m", partial_min, tier, owed)


def commit_all(cache: PrefixCache, req: Request) -> None:
    """Commit every full block of req's tokens (fresh blocks, left referenced)."""
    cache.update_hashes(req)
    for i in range(len(req.block_hashes)):
        (block,) = cache.pool.allocate(1)
        cache.commit(req, block, i)


def test_a_match_takes_full_device_blocks_and_leaves_the_last_token() -> None:
    cache = make_cache()
    commit_all(cache, Request("a", list(range(1, 13))))  # 3 full blocks
    same = cache.match(Request("b", list(range(1, 13))))
    assert len(same.blocks) == 2 and same.num_tokens == 8  # the last token yields logits
    longer = cache.match(Request("c", [*range(1, 13), 50]))
    assert len(longer.blocks) == 3 and longer.num_tokens == 12
    salted = Request("d", list(range(1, 13)), cache_salt="tenant")
    assert cache.match(salted).num_tokens == 0  # another tenant's chain
    assert cache.match(Request("e", [1, 2, 3])) == NO_MATCH


def test_a_match_continues_in_the_host_tier_after_the_device_blocks() -> None:
    cache = make_cache(host_slots=4)
    req = Request("a", list(range(1, 13)))
    commit_all(cache, req)
    assert len(cache.owed.drain_offloads()) == 3  # each committed block owes its copy
    blocks = [cache.pool.lookup(h) for h in req.block_hashes]
    cache.pool.free([b for b in blocks[1:] if b is not None])
    cache.pool.evict_all_cached()  # blocks 2 and 3 leave the device, stay on the host
    match = cache.match(Request("b", [*range(1, 13), 50]))
    assert match.blocks == blocks[:1] and match.host_hashes == tuple(req.block_hashes[1:])
    assert match.num_tokens == 12


def test_a_partial_match_takes_the_longest_continuation_over_the_minimum() -> None:
    cache = make_cache(partial_min=2)
    commit_all(cache, Request("a", [1, 2, 3, 4, 5, 6, 9, 9]))
    commit_all(cache, Request("b", [1, 2, 3, 4, 5, 6, 7, 9]))
    probe = Request("c", [1, 2, 3, 4, 5, 6, 7, 8, 0])
    match = cache.match(probe, partial=True)
    assert match.num_partial_tokens == 3 and match.num_tokens == 7
    assert match.partial_src is not None and match.partial_src.token_ids == (5, 6, 7, 9)
    assert cache.match(probe).partial_src is None  # only when asked
    assert cache.match(Request("d", [1, 2, 3, 4, 5, 0, 0, 0, 0]), partial=True).num_tokens == 4
    assert common_prefix_len([1, 2, 3], [1, 2, 4, 5]) == 2
