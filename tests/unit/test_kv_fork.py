"""KVCacheManager.fork (n > 1): full blocks shared by reference, the partial one copied, every
table freed on its own with the pool's invariants intact."""

from __future__ import annotations

from engine.kv_cache.manager import BlockCopy, KVCacheManager
from engine.step.request import Request

BLOCK_SIZE = 4


def computed(kv: KVCacheManager, req_id: str, num_tokens: int) -> Request:
    req = Request(req_id, list(range(1, num_tokens + 1)))
    kv.allocate(req, num_tokens)
    req.num_computed_tokens = num_tokens
    kv.cache_full_blocks(req)
    return req


def test_fork_shares_full_blocks_and_copies_the_partial_one() -> None:
    kv = KVCacheManager(8, BLOCK_SIZE, "m")
    parent = computed(kv, "p", 10)  # 2 full blocks + 2 tokens
    children = [Request(f"p#{i}", list(parent.prompt_token_ids)) for i in (1, 2)]
    assert kv.can_fork("p", 10)
    copies = [kv.fork("p", child, 10) for child in children]
    table = kv.block_ids("p")
    for child, copy in zip(children, copies, strict=True):
        assert kv.block_ids(child.req_id)[:2] == table[:2]
        assert copy == BlockCopy(table[2], kv.block_ids(child.req_id)[2])
        assert child.num_computed_tokens == 10
    assert kv.pool.blocks[table[0]].ref_cnt == 3 and kv.pool.blocks[table[2]].ref_cnt == 1
    assert kv.num_free_blocks == 8 - 5
    kv.check_integrity()
    for req in (parent, *children):
        kv.free(req)
        kv.check_integrity()
    assert kv.num_free_blocks == 8


def test_a_block_aligned_prompt_copies_nothing_and_a_full_pool_cannot_fork() -> None:
    kv = KVCacheManager(3, BLOCK_SIZE, "m")
    parent = computed(kv, "p", 8)
    child = Request("p#1", list(parent.prompt_token_ids))
    assert kv.fork("p", child, 8) is None
    assert kv.block_ids("p#1") == kv.block_ids("p")
    other = computed(kv, "q", 3)
    assert not kv.can_fork("q", 3)  # its partial block needs a free one
    for req in (parent, child, other):
        kv.free(req)
    kv.check_integrity()
    assert kv.num_free_blocks == 3
