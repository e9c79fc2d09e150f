"""Conditional prefill on a real cluster (1 prefill + 1 decode worker, SmolLM2, Ray, NIXL,
Redis): a short prompt is computed on the decode worker itself; a long one goes through the
prefill pool, and its next chat turn, mostly in the decode worker's prefix cache, is computed
there too, in 16-token chunks beside running decodes. Every output equals the engine's alone
(greedy and seeded); an abort mid-prompt frees every block."""

from __future__ import annotations

import asyncio
import time

import pytest

from common.messages import GenerateRequest
from common.placement_rules import LocalPrefill
from deploy.local_cluster import LocalCluster
from engine.kv_cache.hashing import hash_blocks
from engine.sampling.sampling_params import SamplingParams
from tests.integration.cluster_support import (
    cluster_spec,
    collect,
    leave_after,
    tokens_of,
    wait_until_no_leaks,
)
from tests.integration.cluster_support import reference_tokens as reference_of

MAX_UNCACHED = 24  # tokens a decode worker computes itself
CHUNK = 16  # prompt tokens per decode step beside the running decodes
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, temperature=0.8, seed=7, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(loop):
    spec = cluster_spec(
        num_prefill=1,
        num_decode=1,
        local_prefill=LocalPrefill(MAX_UNCACHED, 0.6, chunk_tokens=CHUNK),
        decode_prefill_chunk_tokens=CHUNK,
    )
    cluster = loop.run_until_complete(LocalCluster(spec).start(progress=lambda m: None))
    yield cluster
    loop.run_until_complete(cluster.close())


@pytest.fixture(autouse=True)
def no_leaks_after(cluster, loop):
    yield
    loop.run_until_complete(wait_until_no_leaks(cluster))


def counts(cluster, loop) -> tuple[int, int, int]:
    """(the router's local prefills, the decode worker's, the prefill worker's requests)."""
    [decode] = cluster.decode_actors.values()
    [prefill] = cluster.prefill_actors.values()

    async def both():
        return await asyncio.gather(decode.stats.remote(), prefill.stats.remote())

    decode_stats, prefill_stats = loop.run_until_complete(both())
    return (
        cluster.backend.num_local_prefills,
        decode_stats.num_local_prefills,
        prefill_stats.num_requests,
    )


def chat(tokenizer, *turns: str) -> list[int]:
    roles = ["user", "assistant"]
    messages = [{"role": roles[i % 2], "content": text} for i, text in enumerate(turns)]
    return tokenizer.apply_chat_template(messages)


def test_a_short_prompt_is_prefilled_on_the_decode_worker(cluster, loop, tokenizer, make_engine):
    prompt = tokenizer.encode("The capital of France is")
    assert len(prompt) <= MAX_UNCACHED
    before = counts(cluster, loop)
    for i, params in enumerate((GREEDY, SEEDED)):
        deltas = loop.run_until_complete(
            collect(cluster.backend, GenerateRequest(f"short{i}", tuple(prompt), params))
        )
        assert tokens_of(deltas) == reference_of(make_engine, prompt, params)
        assert deltas[0].num_prompt_tokens == len(prompt)
        assert all(d.transfer is None for d in deltas), "no KV moved"
    after = counts(cluster, loop)
    assert (after[0] - before[0], after[1] - before[1]) == (2, 2)
    assert after[2] == before[2], "the prefill worker never saw them"


def test_the_next_chat_turn_runs_where_its_history_is_cached(cluster, loop, tokenizer, make_engine):
    story = "Tell me a story about a lighthouse keeper and a storm at sea, in detail. " * 2
    first = chat(tokenizer, story)
    before = counts(cluster, loop)
    reply = loop.run_until_complete(
        collect(cluster.backend, GenerateRequest("turn1", tuple(first), GREEDY))
    )
    assert sum(d.transfer.num_blocks for d in reply if d.transfer) > 0, "went to the pool"
    assert counts(cluster, loop)[0] == before[0]

    answer = tokenizer.decode(tokens_of(reply))
    second = chat(tokenizer, story, answer, "And then?")
    hashes = hash_blocks(second, 16, cluster.model.model_id, None)
    # The decode worker publishes its prefix cache; wait until the index shows the history.
    loop.run_until_complete(index_shows(cluster, hashes, len(first) // 16))
    # The second turn decodes beside three long streams from the pool, computed 16 tokens a step.
    others = [chat(tokenizer, f"Describe the colour number {i} at length.") * 2 for i in range(3)]
    long = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)

    async def run():
        streams = [
            asyncio.create_task(collect(cluster.backend, GenerateRequest(f"bg{i}", tuple(p), long)))
            for i, p in enumerate(others)
        ]
        names = [f"bg{i}" for i in range(len(others))]
        while not all(cluster.backend.decode_worker_of(n) for n in names):
            await asyncio.sleep(0.02)  # every background stream decodes before the turn comes
        turn = await collect(cluster.backend, GenerateRequest("turn2", tuple(second), GREEDY))
        return turn, await asyncio.gather(*streams)

    turn, background = loop.run_until_complete(run())
    assert tokens_of(turn) == reference_of(make_engine, second, GREEDY)
    assert turn[0].num_cached_tokens >= len(first) // 16 * 16 - 16, "its history was reused"
    for prompt, deltas in zip(others, background, strict=True):
        assert tokens_of(deltas) == reference_of(make_engine, prompt, long)
    assert counts(cluster, loop)[0] - before[0] == 1


async def index_shows(cluster, hashes, num_blocks: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        view = await cluster.backend.index.view("decode", hashes)
        if max(view.overlap.values(), default=0) >= num_blocks:
            return
        assert time.monotonic() < deadline, view.overlap
        await asyncio.sleep(0.1)


def test_a_locally_prefilled_request_left_mid_stream_is_freed(cluster, loop, tokenizer):
    # Mostly cached (the same long prompt twice), so the second one runs on the decode worker.
    prompt = chat(tokenizer, "Name every planet and one fact about each of them. " * 6)
    long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    warm = GenerateRequest("warm", tuple(prompt), GREEDY)
    loop.run_until_complete(collect(cluster.backend, warm))
    hashes = hash_blocks(prompt, 16, cluster.model.model_id, None)
    loop.run_until_complete(index_shows(cluster, hashes, (len(prompt) - 1) // 16))
    before = cluster.backend.num_local_prefills

    leave = GenerateRequest("leave", tuple(prompt), long)
    got = loop.run_until_complete(leave_after(cluster.backend, leave, 2))
    assert len(got) == 2 and not got[-1].finished
    assert cluster.backend.num_local_prefills - before == 1
    # the autouse fixture then waits until every block on both workers is free again
