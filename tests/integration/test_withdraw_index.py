"""Leaving the cluster properly (in-process cluster: real Ray, redis-server, NIXL, SmolLM2).

A router that stops ends its open requests with a final delta per choice, whether they are
decoding or still in their prefill, and refuses new ones with a 503 reason; a scaled-down
prefill worker leaves Redis as the scale call returns (its HASH, block SET, registration and
every block entry), and every key left in Redis has a TTL, the shared ones naming live workers
only."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import redis

from common import kv_index_schema as schema
from common.cluster_state import ScaleRequest
from common.messages import GenerateRequest, TokenDelta
from deploy.local_cluster import LocalCluster
from deploy.progress import follow
from deploy.router_launch import build_backend
from engine.sampling.sampling_params import SamplingParams
from router.serving_gate import ClusterUnavailable
from tests.integration.cluster_support import cluster_spec, wait_until_no_leaks

BOUND_S = 60.0  # a bound on each wait, never a timing claim
REASON = "the server is shutting down"


@pytest.fixture(scope="module")
def cluster(loop):
    spec = cluster_spec(num_prefill=2, num_decode=1, drain_grace_s=0.5)
    cluster = loop.run_until_complete(LocalCluster(spec).start(progress=lambda m: None))
    yield cluster
    loop.run_until_complete(cluster.close())


def prompt(tokenizer, tag: str) -> tuple[int, ...]:
    chat = [{"role": "user", "content": f"{tag}: tell me a long story."}]
    return tuple(tokenizer.apply_chat_template(chat))


async def until(condition, what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        await asyncio.sleep(0.02)


async def collect(stream, into: list[TokenDelta]) -> None:
    async for delta in stream:
        into.append(delta)


async def worker_pids(cluster: LocalCluster, role: str) -> list[int]:
    status = await cluster.controller.status.remote(with_stats=False)
    return [w.pid for pool in status.pools if pool.role == role for w in pool.workers if w.pid]


def test_a_stopping_router_ends_each_open_choice_with_abort(cluster, loop, tokenizer):
    params = SamplingParams(max_tokens=1000, temperature=0.8, seed=1, ignore_eos=True, n=2)

    async def run() -> list[TokenDelta]:
        backend, _ = await build_backend(cluster.controller)  # a second router to stop
        got: list[TokenDelta] = []
        try:
            request = GenerateRequest("drain-n2", prompt(tokenizer, "n2"), params)
            task = asyncio.create_task(collect(backend.generate(request), got))
            await until(lambda: {d.index for d in got if d.token_ids} == {0, 1}, "both choices")
            backend.stop_taking(REASON)
            with pytest.raises(ClusterUnavailable, match=REASON) as info:
                later = GenerateRequest("too-late", prompt(tokenizer, "late"), params)
                await anext(backend.generate(later))
            assert (info.value.code, info.value.retry_after_s) == ("shutting_down", None)
            assert not task.done()  # the open request goes on meanwhile
            assert backend.end_streams(REASON) == 1
            await asyncio.wait_for(task, BOUND_S)
        finally:
            await backend.close()
            await backend.index.close()
        return got

    got = loop.run_until_complete(run())
    ends = {d.index: d for d in got if d.finished}
    assert sorted(ends) == [0, 1] and len([d for d in got if d.finished]) == 2
    assert all(d.finish_reason == "abort" and d.error == REASON for d in ends.values())
    loop.run_until_complete(wait_until_no_leaks(cluster))


def test_a_request_still_in_its_prefill_ends_with_abort(cluster, loop, tokenizer):
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)

    async def run() -> list[TokenDelta]:
        backend, _ = await build_backend(cluster.controller)
        pids = await worker_pids(cluster, "prefill")
        got: list[TokenDelta] = []
        try:
            for pid in pids:  # every prefill worker takes the request and answers nothing
                os.kill(pid, signal.SIGSTOP)
            request = GenerateRequest("drain-prefill", prompt(tokenizer, "pf"), params)
            task = asyncio.create_task(collect(backend.generate(request), got))
            await until(lambda: "drain-prefill" in backend.last_placements, "placed")
            backend.end_streams(REASON)
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
        try:
            await asyncio.wait_for(task, BOUND_S)
        finally:
            await backend.close()
            await backend.index.close()
        return got

    got = loop.run_until_complete(run())
    assert got == [TokenDelta("drain-prefill", (), True, "abort", error=REASON)]
    loop.run_until_complete(wait_until_no_leaks(cluster))


def test_a_scaled_down_prefill_worker_leaves_redis_at_once(cluster, loop):
    client = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
    model = cluster.model.model_id
    gone = "kvrelay-prefill-1"  # the newest ready worker is the one a scale-down drains
    assert client.scard(schema.worker_blocks_key(model, gone)), "its warm-up blocks"
    assert client.sismember(schema.registry_key(model), gone)

    async def scale_down() -> None:
        await cluster.controller.scale.remote(ScaleRequest(prefill=1))
        await follow(cluster.controller, lambda line: None, BOUND_S)  # what `kvrelay scale` waits

    loop.run_until_complete(scale_down())
    # right away, no TTL waited for
    assert not client.exists(schema.worker_key(model, gone))
    assert not client.exists(schema.worker_blocks_key(model, gone))
    assert not client.sismember(schema.registry_key(model), gone)
    for key in client.scan_iter(f"{schema.block_key_prefix(model)}*"):
        assert gone not in {m.removesuffix(schema.HOST) for m in client.smembers(key)}, key
    assert_each_key_has_a_ttl_and_names_live_workers(client, model)
    loop.run_until_complete(wait_until_no_leaks(cluster))


def assert_each_key_has_a_ttl_and_names_live_workers(client: redis.Redis, model: str) -> None:
    """Every key has a TTL (the SETs several workers share too: the registry, each block's
    holders), and every worker a shared SET names has a live HASH."""
    live = {
        key.removeprefix(schema.worker_key_prefix(model))
        for key in client.scan_iter(f"{schema.worker_key_prefix(model)}*")
    }
    assert live == {"kvrelay-prefill-0", "kvrelay-decode-0"}
    keys = list(client.scan_iter("kvr:*"))
    assert any(key.startswith(schema.block_key_prefix(model)) for key in keys), "blocks published"
    assert [key for key in keys if client.pttl(key) <= 0] == [], "keys without a TTL"
    for key in keys:
        shared = key == schema.registry_key(model) or key.startswith(schema.block_key_prefix(model))
        holders = {m.removesuffix(schema.HOST) for m in client.smembers(key)} if shared else set()
        assert holders <= live, f"{key} names {holders - live}, which are not live"
