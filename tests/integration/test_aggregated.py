"""Aggregated workers on a real cluster (`--prefill 0`: one decode worker, SmolLM2, Ray, NIXL,
Redis): every prompt is computed on the decode worker, token for token as the engine alone,
with its prefix cache reused and published to the index; the prefill pool scaled 0 -> 1 -> 0
while requests flow loses none (each placed on whichever pool the router sees, or moved to the
decode workers when its prefill worker drains), and scaled up again it starts warm: the new
prefill worker takes over the drained one's disk-tier folder (every worker has a disk tier
under one path) and a prompt the old one computed hits its files; every block is free at the
end."""

from __future__ import annotations

import asyncio
import time

import pytest

from common.cluster_state import ClusterStatus, ScaleRequest, WorkerState
from common.messages import GenerateRequest, TokenDelta
from engine.config import CacheConfig, EngineConfig
from engine.kv_cache.hashing import hash_blocks
from engine.sampling.sampling_params import SamplingParams
from tests.integration.cluster_support import (
    NUM_BLOCKS,
    cluster_spec,
    collect,
    reference_batch,
    running_cluster,
    tokens_of,
    wait_until_no_leaks,
)

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(loop, tmp_path_factory):
    disk = tmp_path_factory.mktemp("disk-tier")  # each worker claims a folder under it
    cache = CacheConfig(num_blocks=NUM_BLOCKS, disk_kv_cache_bytes=64 << 20, disk_kv_path=str(disk))
    spec = cluster_spec(
        num_prefill=0, num_decode=1, drain_grace_s=1.0, engine=EngineConfig(cache=cache)
    )
    yield from running_cluster(loop, spec)


def chat(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}])


async def decode_stats(cluster):
    [decode] = cluster.decode_actors.values()
    return await decode.stats.remote()


def test_prefill_0_serves_token_exact_with_prefix_reuse(cluster, loop, tokenizer, make_engine):
    history = "You are a careful assistant. Answer every question in one short sentence. " * 3
    first = chat(tokenizer, history + "What colour is the sky?")
    second = chat(tokenizer, history + "What colour is grass?")
    expected = reference_batch(make_engine, [first, second], GREEDY)
    assert loop.run_until_complete(cluster.backend.health())["ok"]  # no prefill worker needed
    before = loop.run_until_complete(decode_stats(cluster))

    got = loop.run_until_complete(
        collect(cluster.backend, GenerateRequest("a1", tuple(first), GREEDY))
    )
    assert tokens_of(got) == expected[0]
    assert all(d.transfer is None for d in got), "no KV moved: computed where it decodes"
    # The decode worker's prefix cache reaches the index (what the router weighs).
    hashes = hash_blocks(second, 16, cluster.model.model_id, None)
    shared = sum(a == b for a, b in zip(first, second, strict=False)) // 16

    async def index_shows() -> None:
        deadline = time.monotonic() + 20
        while (
            max((await cluster.backend.index.view("decode", hashes)).overlap.values(), default=0)
            < shared
        ):
            assert time.monotonic() < deadline, "the decode worker's cache never reached the index"
            await asyncio.sleep(0.1)

    loop.run_until_complete(index_shows())
    got = loop.run_until_complete(
        collect(cluster.backend, GenerateRequest("a2", tuple(second), GREEDY))
    )
    assert tokens_of(got) == expected[1]
    assert got[0].num_cached_tokens >= (shared - 1) * 16 > 0, "the shared prefix was reused"
    stats = loop.run_until_complete(decode_stats(cluster))
    assert stats.num_local_prefills - before.num_local_prefills == 2
    # Its own prompts are in its stats (the periodic stats line's prompt rate and hits).
    prompt_tokens = stats.num_local_prompt_tokens - before.num_local_prompt_tokens
    assert prompt_tokens == len(first) + len(second)
    cached = stats.num_local_cached_tokens - before.num_local_cached_tokens
    assert cached >= got[0].num_cached_tokens
    loop.run_until_complete(wait_until_no_leaks(cluster))


async def status_of(cluster) -> ClusterStatus:
    return await cluster.controller.status.remote(False)


async def until(check, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


def test_scaling_the_prefill_pool_0_1_0_under_load_loses_nothing(
    cluster, loop, tokenizer, make_engine
):
    prompts = [chat(tokenizer, f"Name a river, number {i}.") for i in range(6)]
    expected = reference_batch(make_engine, prompts, GREEDY)
    results: dict[str, tuple[int, list[TokenDelta]]] = {}
    failures: list[str] = []

    async def one(req_id: str, i: int) -> None:
        try:
            request = GenerateRequest(req_id, tuple(prompts[i % len(prompts)]), GREEDY)
            results[req_id] = (i % len(prompts), await collect(cluster.backend, request))
        except Exception as e:  # counted: the test requires none
            failures.append(f"{req_id}: {type(e).__name__}: {e}")

    def burst(tag: str, n: int) -> list[asyncio.Task[None]]:
        return [asyncio.create_task(one(f"{tag}{i}", i)) for i in range(n)]

    async def pool(role: str):
        return (await status_of(cluster)).pool(role)

    async def scenario() -> None:
        # Up: requests in flight on the aggregated decode worker while the prefill worker joins.
        flying = burst("up", 3)
        await cluster.controller.scale.remote(ScaleRequest(prefill=1))
        await until(lambda: _settled(pool("prefill"), 1), "a ready prefill worker")
        await until(lambda: _known(cluster), "the router to see the prefill worker")
        remote = burst("p", 2)
        await asyncio.gather(*flying, *remote)
        assert all(any(d.transfer for d in results[f"p{i}"][1]) for i in range(2)), "pool used"
        # Down: requests placed on the prefill worker as it drains; the router moves on.
        flying = burst("down", 3)
        await cluster.controller.scale.remote(ScaleRequest(prefill=0))
        more = burst("after", 2)
        await until(lambda: _settled(pool("prefill"), 0), "the prefill worker to drain")
        await asyncio.gather(*flying, *more, *burst("last", 2))

    loop.run_until_complete(scenario())
    assert not failures, failures
    assert len(results) == 12
    for req_id, (i, deltas) in results.items():
        assert deltas[-1].finish_reason == "length", (req_id, deltas[-1])
        assert tokens_of(deltas) == expected[i], req_id
    status = loop.run_until_complete(status_of(cluster))
    [gone] = status.pool("prefill").workers
    assert gone.state == WorkerState.GONE and gone.exit_check is not None and gone.exit_check.clean
    assert loop.run_until_complete(cluster.backend.health())["ok"]

    async def warm_restart() -> list[TokenDelta]:
        """Up again: the new worker finds what the drained one wrote at its clean stop."""
        await cluster.controller.scale.remote(ScaleRequest(prefill=1))
        await until(lambda: _settled(pool("prefill"), 1), "a ready prefill worker again")
        await until(lambda: _known(cluster), "the router to see the new prefill worker")
        request = GenerateRequest("warm", tuple(prompts[0]), GREEDY)  # the drained one's "p0"
        return await collect(cluster.backend, request)

    got = loop.run_until_complete(warm_restart())
    assert tokens_of(got) == expected[0]
    assert any(d.transfer for d in got), "computed by the new prefill worker"
    assert got[0].num_cached_tokens >= 16, "its prompt's blocks were found again"
    [fresh] = cluster.prefill_actors.values()
    tiers = {t.tier: t for t in loop.run_until_complete(fresh.stats.remote()).tiers}
    assert tiers["disk"].hit_blocks * 16 >= got[0].num_cached_tokens, tiers["disk"]

    async def down_again() -> None:
        await cluster.controller.scale.remote(ScaleRequest(prefill=0))
        await until(lambda: _settled(pool("prefill"), 0), "the new prefill worker to drain")

    loop.run_until_complete(down_again())
    loop.run_until_complete(wait_until_no_leaks(cluster))


async def _settled(pool_status, size: int) -> bool:
    pool = await pool_status
    return pool.settled and pool.num_ready == size


async def _known(cluster) -> bool:
    return bool(cluster.backend.workers.known("prefill"))
