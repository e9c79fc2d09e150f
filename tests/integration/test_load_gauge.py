"""/metrics' kvrelay_worker_load is each worker's own report at the scrape: after traffic ends it
matches what the workers say (0 running, their free blocks), and a worker that leaves its pool
has no series any more. Real router, Ray workers, Redis index and SmolLM2."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.cluster_state import ScaleRequest, WorkerStats
from tests.integration.cluster_support import ClusterHarness, cluster_spec

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def stack() -> Iterator[ClusterHarness]:
    harness = ClusterHarness(cluster_spec(num_prefill=1, num_decode=2, drain_grace_s=1.0))
    try:
        yield harness
    finally:
        harness.stop()


def chat(stack: ClusterHarness, i: int, max_tokens: int) -> None:
    """One streamed chat request, read to its end."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Write a long story about the number {i}."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    request = urllib.request.Request(
        stack.base_url + "/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        chunks = [line for line in response if line.startswith(b"data:")]
    assert chunks[-1].strip() == b"data: [DONE]"


def load_gauge(stack: ClusterHarness) -> dict[tuple[str, str], float]:
    """(worker id, field) -> value of every kvrelay_worker_load series of one scrape."""
    with urllib.request.urlopen(stack.base_url + "/metrics", timeout=60) as response:
        text = response.read().decode()
    [family] = [f for f in text_string_to_metric_families(text) if f.name == "kvrelay_worker_load"]
    return {(s.labels["worker_id"], s.labels["field"]): s.value for s in family.samples}


def own_stats(stack: ClusterHarness) -> dict[str, WorkerStats]:
    actors = {**stack.cluster.prefill_actors, **stack.cluster.decode_actors}

    async def ask() -> dict[str, WorkerStats]:
        answers = await asyncio.gather(*(a.stats.remote() for a in actors.values()))
        return dict(zip(actors, answers, strict=True))

    return stack.run(ask())


def test_the_load_gauge_follows_the_workers_and_forgets_one_that_left(stack):
    # Two long streams run on the decode workers; a short request is placed while the index
    # shows them busy (the load a placement sees); then all end.
    index = stack.cluster.backend.index
    with ThreadPoolExecutor(2) as pool:
        streams = [pool.submit(chat, stack, i, 160) for i in range(2)]

        async def until_the_index_shows_a_busy_decode_worker() -> None:
            while not any(w.load.running for w in await index.live_workers("decode")):
                await asyncio.sleep(0.05)

        stack.run(until_the_index_shows_a_busy_decode_worker(), timeout_s=120)
        assert not any(s.done() for s in streams), "the long streams ended too soon"
        chat(stack, 9, 4)
        for stream in streams:
            stream.result()
    stack.wait_until_no_leaks()
    gauge = load_gauge(stack)
    stats = own_stats(stack)
    assert len(stats) == 3
    for worker_id, own in stats.items():
        assert gauge[worker_id, "running"] == own.load.running == 0
        assert gauge[worker_id, "waiting"] == own.load.waiting == 0
        assert gauge[worker_id, "free_blocks"] == own.load.free_blocks
        assert gauge[worker_id, "total_blocks"] == own.load.total_blocks > 0

    leaving = sorted(stack.cluster.decode_actors)

    async def shrink() -> None:
        await stack.cluster.controller.scale.remote(ScaleRequest(decode=1))
        while len(stack.cluster.decode_actors) > 1:  # until the router's membership drops it
            await asyncio.sleep(0.1)

    stack.run(shrink(), timeout_s=120)
    [staying] = stack.cluster.decode_actors
    [gone] = set(leaving) - {staying}
    gauge = load_gauge(stack)
    assert {worker_id for worker_id, _ in gauge} == set(stack.cluster.prefill_actors) | {staying}
    assert (gone, "running") not in gauge
