"""Keeping a finished request's blocks (engine/kv_cache/kept_blocks.py, KVCacheManager.keep /
release_kept) over a real BlockPool: the neutral operation a prefill worker's leases use. Kept
blocks hold one reference each, stay findable in the prefix cache, are named host slots first,
and are freed exactly once; a pool with blocks kept is not leak-free."""

from __future__ import annotations

import pytest

from engine.kv_cache.block_pool import KVBlock
from engine.kv_cache.host_tier import HostTier
from engine.kv_cache.kept_blocks import Kept, KeptBlocks
from engine.kv_cache.manager import KVCacheManager
from engine.step.request import Request

BLOCK_SIZE = 4


def computed(kv: KVCacheManager, req_id: str, tokens: list[int]) -> Request:
    req = Request(req_id, tokens)
    match = kv.match_prefix(req)
    kv.allocate(req, len(tokens) - match.num_tokens, match)
    req.num_computed_tokens = len(tokens)
    kv.cache_full_blocks(req)
    return req


def test_the_table_names_host_slots_first_and_lists_each_request_once() -> None:
    blocks = [KVBlock(7), KVBlock(8)]
    kept = Kept(blocks, priority=35, retention=(), host_slots=(2, 3))
    assert kept.block_ids == (2, 3, 7, 8) and kept.num_host_blocks == 2
    table = KeptBlocks()
    table.add("r", kept)
    table.add("s", Kept([KVBlock(9)], 35, ()))
    assert "r" in table and len(table) == 2
    assert table.block_ids() == {"r": (2, 3, 7, 8), "s": (9,)}
    assert table.host_slots() == {2, 3}
    assert sorted(b.block_id for bs in table.device_blocks() for b in bs) == [7, 8, 9]
    with pytest.raises(AssertionError):
        table.add("r", kept)  # one entry a req_id until it is released
    assert table.pop("r") is kept and table.pop("r") is None and "r" not in table


def test_kept_blocks_keep_their_references_until_released_once() -> None:
    kv = KVCacheManager(4, BLOCK_SIZE, "m")
    req = computed(kv, "p", list(range(1, 11)))  # 2 full blocks and a partial one
    table = list(kv.block_ids("p"))
    kept = kv.keep(req)
    assert kept.block_ids == tuple(table) and kept.num_host_blocks == 0
    assert kv.block_ids("p") == [] and "p" in kv.kept
    assert kv.kept.block_ids() == {"p": tuple(table)}
    assert kv.num_free_blocks == 1
    kv.check_integrity()  # the kept entry accounts for each block's reference
    with pytest.raises(AssertionError):
        kv.assert_all_free()
    other = computed(kv, "q", [*range(1, 9), 99])  # a prefix hit on kept blocks
    assert kv.block_ids("q")[:2] == table[:2]
    assert kv.pool.blocks[table[0]].ref_cnt == 2
    kv.free(other)
    assert kv.release_kept("p") and not kv.release_kept("p")
    kv.assert_all_free()
    assert kv.pool.lookup(req.block_hashes[0]) is not None  # freed, still cached


def test_keep_on_host_keeps_the_leading_cached_blocks_as_their_host_copies() -> None:
    kv = KVCacheManager(4, BLOCK_SIZE, "m", host_tier=HostTier(4), keep_on_host=True)
    req = computed(kv, "p", list(range(1, 11)))
    kv.owed.drain_offloads()
    kept = kv.keep(req)
    assert kept.num_host_blocks == 2 and len(kept.block_ids) == 3
    assert kv.kept.host_slots() == set(kept.block_ids[:2])
    assert kv.num_free_blocks == 3  # only the partial block stays on the device
    kv.check_integrity()
    assert kv.release_kept("p")
    kv.assert_all_free()


def test_keep_on_host_needs_a_host_tier_and_caching() -> None:
    assert not KVCacheManager(4, BLOCK_SIZE, "m", keep_on_host=True).keep_on_host
    uncached = KVCacheManager(4, BLOCK_SIZE, "m", False, host_tier=HostTier(4), keep_on_host=True)
    assert not uncached.keep_on_host
    kv = KVCacheManager(4, BLOCK_SIZE, "m", enable_caching=False)
    kept = kv.keep(computed(kv, "p", list(range(1, 11))))
    assert kept.num_host_blocks == 0 and len(kept.block_ids) == 3
    assert kv.release_kept("p")
    kv.assert_all_free()
