"""The disaggregated cluster on one machine: real Ray actors, real NIXL transfers, real Redis."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import ray

from common.messages import GenerateRequest
from deploy.local_cluster import LocalCluster
from engine.config import CacheConfig
from engine.kv_cache.retention import RetentionRange
from engine.sampling.sampling_params import SamplingParams
from router.policy import make_prefill_policy
from router.prefix_index import IndexUnavailable
from tests.integration.cluster_support import (
    cluster_spec,
    collect,
    decode_from_extra_prefill,
    decode_handle,
    leave_after,
    start_extra_prefill,
    tokens_of,
    wait_until_no_leaks,
)
from tests.integration.cluster_support import reference_tokens as reference_of

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(loop):
    cluster = loop.run_until_complete(LocalCluster(cluster_spec()).start(progress=lambda m: None))
    yield cluster
    loop.run_until_complete(cluster.close())


@pytest.fixture(autouse=True)
def no_leaks_after(cluster, loop):
    yield
    loop.run_until_complete(wait_until_no_leaks(cluster))


def request(req_id: str, prompt: list[int], params=GREEDY, salt: str | None = None):
    return GenerateRequest(req_id, tuple(prompt), params, cache_salt=salt)


def test_token_exact_for_concurrent_requests(cluster, loop, make_engine, tokenizer):
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": f"Tell me fact number {i}."}])
        for i in range(16)
    ]
    reference = make_engine()
    for i, p in enumerate(prompts):
        reference.add_request(f"ref{i}", p, GREEDY)
    expected = {}
    while reference.has_unfinished_requests:
        for out in reference.step():
            expected.setdefault(out.req_id, []).extend(out.new_token_ids)

    async def run():
        return await asyncio.gather(
            *(collect(cluster.backend, request(f"c{i}", p)) for i, p in enumerate(prompts))
        )

    results = loop.run_until_complete(run())
    for i, deltas in enumerate(results):
        assert tokens_of(deltas) == expected[f"ref{i}"], f"request {i}"
        assert deltas[-1].finished and deltas[-1].finish_reason == "length"
    transferred = [d.transfer.num_blocks for ds in results for d in ds if d.transfer]
    assert sum(transferred) > 0, "KV must move over NIXL"


def shared_prefix_prompts(tokenizer, topic: str, n: int) -> list[list[int]]:
    system = " ".join(f"{topic} rule {i}: be exact." for i in range(30))
    return [
        tokenizer.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": f"Q{i}?"}]
        )
        for i in range(n)
    ]


def run_sequentially(cluster, loop, prompts, prefix):
    async def run():
        out = []
        for i, p in enumerate(prompts):
            deltas = await collect(cluster.backend, request(f"{prefix}{i}", p))
            out.append(deltas)
        return out

    return loop.run_until_complete(run())


def test_kv_aware_routing_beats_round_robin(cluster, loop, tokenizer):
    kv_aware = run_sequentially(cluster, loop, shared_prefix_prompts(tokenizer, "Alpha", 6), "kv")
    hits_kv = [ds[0].num_cached_tokens for ds in kv_aware]
    assert all(h > 0 for h in hits_kv[1:]), hits_kv
    cluster.backend.policy = make_prefill_policy("round_robin")
    try:
        rr = run_sequentially(cluster, loop, shared_prefix_prompts(tokenizer, "Beta", 6), "rr")
    finally:
        cluster.backend.policy = make_prefill_policy("kv_aware")
    hits_rr = [ds[0].num_cached_tokens for ds in rr]
    assert sum(1 for h in hits_rr if h > 0) < sum(1 for h in hits_kv if h > 0)


def test_only_missing_blocks_move(cluster, loop, tokenizer):
    prompts = shared_prefix_prompts(tokenizer, "Gamma", 2)
    first, second = run_sequentially(cluster, loop, prompts, "mv")
    moved_first = sum(d.transfer.num_blocks for d in first if d.transfer)
    moved_second = sum(d.transfer.num_blocks for d in second if d.transfer)
    assert moved_first >= len(prompts[0]) // 16
    assert 0 < moved_second < moved_first


def test_cache_salt_isolation(cluster, loop, tokenizer):
    prompt = shared_prefix_prompts(tokenizer, "Delta", 1)[0]

    async def run():
        a1 = await collect(cluster.backend, request("salt-a1", prompt, salt="a"))
        b1 = await collect(cluster.backend, request("salt-b1", prompt, salt="b"))
        a2 = await collect(cluster.backend, request("salt-a2", prompt, salt="a"))
        return a1, b1, a2

    a1, b1, a2 = loop.run_until_complete(run())
    assert a1[0].num_cached_tokens == 0 and b1[0].num_cached_tokens == 0
    assert a2[0].num_cached_tokens > 0
    assert tokens_of(a1) == tokens_of(b1) == tokens_of(a2)


def test_retention_ranges_travel_to_both_workers_token_exact(cluster, loop, tokenizer):
    """kv_retention reaches the prefill worker (its lease's blocks) and the decode worker (the
    pulled prompt's blocks, freed at the end) without changing a token."""
    prompt = shared_prefix_prompts(tokenizer, "Kappa", 1)[0]
    ranges = (RetentionRange(0, 64, 90, duration_s=60.0), RetentionRange(64, None, 10))
    kept = dataclasses.replace(request("keep", prompt), kv_retention=ranges)

    async def run():
        return await collect(cluster.backend, kept), await collect(
            cluster.backend, request("plain", prompt, salt="other")
        )

    with_ranges, without = loop.run_until_complete(run())
    assert with_ranges[-1].finished and with_ranges[-1].finish_reason == "length"
    assert tokens_of(with_ranges) == tokens_of(without)
    assert sum(d.transfer.num_blocks for d in with_ranges if d.transfer) > 0, "a real pull"


def test_a_drifted_index_is_noticed_and_the_worker_republishes(cluster, loop, tokenizer):
    """Redis says a prefill worker holds a prompt's blocks (and one block of nothing) that it
    does not: the prefill reuses nothing, the router counts the drift and the worker
    re-publishes its full state, which drops the entries it never had."""
    import redis

    from common import kv_index_schema as schema
    from engine.kv_cache.hashing import hash_blocks, hash_hex

    prompt = shared_prefix_prompts(tokenizer, "Drift", 1)[0]
    model_id, block_size = cluster.backend.model_id, cluster.backend.block_size
    hashes = hash_blocks(prompt, block_size, model_id, None)
    phantom = hash_blocks(list(range(1, 1 + block_size)), block_size, model_id, "phantom")[0]
    victim = sorted(cluster.prefill_actors)[-1]
    client = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
    for block_hash in [*hashes, phantom]:
        client.sadd(schema.block_key(model_id, block_hash), victim)
        client.sadd(schema.worker_blocks_key(model_id, victim), hash_hex(block_hash))
    drifts_before = cluster.backend.num_index_drifts

    deltas = loop.run_until_complete(collect(cluster.backend, request("drift0", prompt)))
    assert deltas[0].num_cached_tokens == 0, "the worker had none of the promised blocks"
    assert cluster.backend.num_index_drifts == drifts_before + 1

    async def phantom_gone() -> bool:
        deadline = asyncio.get_running_loop().time() + 30
        while client.sismember(schema.block_key(model_id, phantom), victim):
            if asyncio.get_running_loop().time() > deadline:
                return False
            await asyncio.sleep(0.1)
        return True

    assert loop.run_until_complete(phantom_gone()), "the full re-publish drops what it lacks"
    client.close()


def test_abort_mid_stream_frees_both_sides(cluster, loop, tokenizer):
    prompt = tokenizer.encode("Write a very long story about dragons and castles. " * 4)
    long_params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)

    abort_me = request("abort-me", prompt, long_params)
    got = loop.run_until_complete(leave_after(cluster.backend, abort_me, 3))
    assert len(got) == 3 and not got[-1].finished


def test_prefill_worker_dies_after_handle(cluster, loop, tokenizer, make_engine):
    prompt = tokenizer.encode("The doomed prefill worker computed this prompt before dying.")
    doomed = start_extra_prefill("doomed-prefill", cluster.spec.engine)
    tokens, before, after = loop.run_until_complete(
        decode_from_extra_prefill(cluster, doomed, request("orphan", prompt), kill_prefill=True)
    )
    assert tokens == reference_tokens(make_engine, prompt)
    assert after.num_recomputed == before.num_recomputed + 1


def test_incompatible_handshake_is_refused_and_request_recomputed(
    cluster, loop, tokenizer, make_engine
):
    prompt = tokenizer.encode("A prefill worker with another block size must be refused.")
    other_engine = dataclasses.replace(
        cluster.spec.engine, cache=CacheConfig(block_size=32, num_blocks=64)
    )
    odd = start_extra_prefill("odd-prefill", other_engine)
    try:
        tokens, before, after = loop.run_until_complete(
            decode_from_extra_prefill(cluster, odd, request("odd", prompt))
        )
        assert loop.run_until_complete(odd.num_leases.remote()) == 0
    finally:
        ray.kill(odd)
    assert tokens == reference_tokens(make_engine, prompt)
    assert after.num_recomputed == before.num_recomputed + 1
    assert after.num_transferred_blocks == before.num_transferred_blocks
    assert after.num_refused_handshakes == before.num_refused_handshakes + 1


def test_a_decode_pull_reads_the_prefill_workers_host_tier(cluster, loop, tokenizer, make_engine):
    """Host leases: the prefill worker leases the host tier's copies of the prompt's full blocks
    (their device blocks freed, still cached) and the decode worker reads them from its host
    memory over NIXL, the partial last block from its device pool: token-exact, no recompute,
    and both of the holder's tiers end leak-free."""
    prompt = shared_prefix_prompts(tokenizer, "Hostlease", 1)[0]
    cache = CacheConfig(num_blocks=64, host_kv_cache_bytes=64 << 20, keep_on_host=True)
    holder = start_extra_prefill(
        "host-lease-prefill", dataclasses.replace(cluster.spec.engine, cache=cache)
    )
    req = request("hostlease", prompt)

    async def run():
        handle = await holder.prefill.remote(req)
        tokens, before, after = await decode_handle(cluster, req, handle)
        for _ in range(200):  # the read's DONE notice releases the lease
            if await holder.num_leases.remote() == 0:
                break
            await asyncio.sleep(0.05)
        return handle, tokens, before, after, await holder.check_no_leaks.remote()

    try:
        handle, tokens, before, after, leaks = loop.run_until_complete(run())
    finally:
        ray.kill(holder)
    num_full = len(prompt) // cache.block_size
    assert handle.num_host_blocks == num_full > 0 and len(handle.block_ids) == num_full + 1
    assert tokens == reference_tokens(make_engine, prompt)
    assert after.num_host_read_blocks - before.num_host_read_blocks == num_full
    assert after.num_transferred_blocks - before.num_transferred_blocks == num_full + 1
    assert after.num_recomputed == before.num_recomputed
    assert leaks.num_held_blocks == 0 and leaks.num_free_blocks == leaks.num_total_blocks


def test_redis_down_then_back(cluster, loop, tokenizer):
    prompts = shared_prefix_prompts(tokenizer, "Epsilon", 3)
    cluster.redis.stop()
    try:
        down = run_sequentially(cluster, loop, prompts, "down")
        assert all(ds[-1].finished and ds[-1].finish_reason == "length" for ds in down)
        assert cluster.backend.num_index_unavailable > 0
    finally:
        cluster.redis.start()

    async def index_whole() -> bool:
        for _ in range(100):
            try:
                workers = await cluster.backend.index.live_workers()
            except IndexUnavailable:
                workers = []
            if len(workers) == 3:
                return True
            await asyncio.sleep(0.1)
        return False

    assert loop.run_until_complete(index_whole())
    again = run_sequentially(cluster, loop, prompts[:1], "back")
    assert again[0][0].num_cached_tokens > 0, "re-published prefix blocks are found again"


def reference_tokens(make_engine, prompt) -> list[int]:
    return reference_of(make_engine, prompt, GREEDY)
