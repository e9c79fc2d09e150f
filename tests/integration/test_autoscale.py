"""Autoscale on a local cluster (real Ray, Redis, NIXL, SmolLM2): the controller, told it may run
1..2 decode workers, grows the decode pool while a load keeps six streams in flight, the new
worker serves part of the load, and once the load ends the pool shrinks back to one by a drain.
No request fails, every output equals the engine's alone, and no block is left in use."""

from __future__ import annotations

import asyncio
import time

import pytest

from common.cluster_state import ClusterStatus, WorkerState
from common.messages import GenerateRequest, TokenDelta
from deploy.autoscale import AutoscaleConfig
from deploy.local_cluster import LocalCluster
from engine.sampling.sampling_params import SamplingParams
from tests.integration.cluster_support import (
    cluster_spec,
    reference_batch,
    tokens_of,
    wait_until_no_leaks,
)

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
IN_FLIGHT = 6  # streams kept running: 6x the decode target of 1 per worker
NUM_PROMPTS = 4
AUTOSCALE = AutoscaleConfig(
    min_size={"prefill": 1, "decode": 1},
    max_size={"prefill": 1, "decode": 2},
    window_s=3.0,
    cooldown_s=3.0,
    warmup_s=1.0,
    target_batch=1,
)
BOUND_S = 240.0  # each phase must end within this


@pytest.fixture(scope="module")
def cluster(loop):
    spec = cluster_spec(num_prefill=1, num_decode=1, drain_grace_s=1.0, autoscale=AUTOSCALE)
    cluster = loop.run_until_complete(LocalCluster(spec).start(progress=lambda m: None))
    yield cluster
    loop.run_until_complete(cluster.close())


async def decode_pool(cluster) -> ClusterStatus:
    return await cluster.controller.status.remote(with_stats=True)


async def until(check, what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while not await check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.2)


def test_the_decode_pool_grows_under_load_and_shrinks_after(
    cluster, loop, tokenizer, make_engine
) -> None:
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": f"Tell me fact {i}."}])
        for i in range(NUM_PROMPTS)
    ]
    expected = reference_batch(make_engine, prompts, GREEDY)
    results: list[tuple[int, list[TokenDelta]]] = []

    async def run() -> None:
        stop = asyncio.Event()

        async def client(slot: int) -> None:
            n = 0
            while not stop.is_set():
                index = (slot + n) % NUM_PROMPTS
                request = GenerateRequest(f"as{slot}-{n}", tuple(prompts[index]), GREEDY)
                results.append((index, [d async for d in cluster.backend.generate(request)]))
                n += 1

        async def grown() -> bool:
            pool = (await decode_pool(cluster)).pool("decode")
            fresh = [w for w in pool.workers if w.worker_id != "kvrelay-decode-0"]
            served = [w for w in fresh if w.stats is not None and w.stats.num_requests > 0]
            return pool.num_ready == 2 and bool(served)

        clients = [asyncio.create_task(client(slot)) for slot in range(IN_FLIGHT)]
        try:
            await until(grown, "the decode pool did not grow to 2 and serve on the new worker")
        finally:
            stop.set()
            await asyncio.wait_for(asyncio.gather(*clients), BOUND_S)

        async def shrunk() -> bool:
            pool = (await decode_pool(cluster)).pool("decode")
            return pool.desired == 1 and pool.settled

        await until(shrunk, "the decode pool did not shrink back to 1 once the load ended")

    loop.run_until_complete(run())
    status = loop.run_until_complete(decode_pool(cluster))
    decode = status.pool("decode")
    assert "autoscale 1..2, last 2 -> 1" in decode.autoscale, decode.autoscale
    drained = [w for w in decode.workers if w.state == WorkerState.GONE]
    assert drained and all(w.exit_check is not None and w.exit_check.clean for w in drained)
    assert status.pool("prefill").desired == 1, "a fixed pool stays as it is"
    assert results, "no request ran"
    for index, deltas in results:
        assert deltas[-1].finish_reason == "length", deltas[-1]
        assert tokens_of(deltas) == expected[index]
    loop.run_until_complete(wait_until_no_leaks(cluster))
