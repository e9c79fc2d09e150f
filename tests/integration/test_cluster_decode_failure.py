"""1 prefill + 2 decode workers: a burst is spread over both decode workers, and the death of
one fails only its own streams (real Ray, NIXL and Redis)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest
import ray

from common.messages import GenerateRequest, TokenDelta
from deploy.local_cluster import LocalCluster
from engine.sampling_params import SamplingParams
from tests.integration.cluster_support import cluster_spec, tokens_of, wait_until_no_leaks

LONG = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
NUM_STREAMS = 8
HANG_BOUND_S = 120.0  # every stream must end well within this


@pytest.fixture(scope="module")
def cluster(loop):
    spec = cluster_spec(num_prefill=1, num_decode=2)
    cluster = loop.run_until_complete(LocalCluster(spec).start(progress=lambda m: None))
    yield cluster
    loop.run_until_complete(cluster.close())


def prompts_for(tokenizer, tag: str) -> list[list[int]]:
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": f"{tag}: tell me story {i}."}])
        for i in range(NUM_STREAMS)
    ]


def reference(make_engine, prompts: list[list[int]]) -> list[list[int]]:
    engine = make_engine()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"ref{i}", prompt, LONG)
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests:
        for o in engine.step():
            out.setdefault(o.req_id, []).extend(o.new_token_ids)
    return [out[f"ref{i}"] for i in range(len(prompts))]


async def stream_all(cluster, prompts, prefix: str, on_progress=None) -> list[list[TokenDelta]]:
    """Run every prompt as a concurrent stream; `on_progress(received)` after each delta."""
    received: dict[str, list[TokenDelta]] = {f"{prefix}{i}": [] for i in range(len(prompts))}

    async def one(req_id: str, prompt: list[int]) -> None:
        async for delta in cluster.backend.generate(GenerateRequest(req_id, tuple(prompt), LONG)):
            received[req_id].append(delta)
            if on_progress is not None:
                await on_progress(received)

    tasks = [one(f"{prefix}{i}", p) for i, p in enumerate(prompts)]
    await asyncio.wait_for(asyncio.gather(*tasks), HANG_BOUND_S)
    return list(received.values())


def test_a_burst_is_spread_over_idle_decode_workers(cluster, loop, tokenizer, make_engine):
    prompts = prompts_for(tokenizer, "burst")
    seen: dict[str, str] = {}

    async def note_placement(received) -> None:
        for req_id in received:
            worker = cluster.backend.decode_worker_of(req_id)
            if worker is not None:
                seen[req_id] = worker

    results = loop.run_until_complete(stream_all(cluster, prompts, "burst", note_placement))
    assert sorted(Counter(seen.values()).values()) == [4, 4], seen
    assert [tokens_of(r) for r in results] == reference(make_engine, prompts)
    loop.run_until_complete(wait_until_no_leaks(cluster))


def test_a_dead_decode_worker_fails_only_its_own_streams(cluster, loop, tokenizer, make_engine):
    prompts = prompts_for(tokenizer, "doom")
    expected = reference(make_engine, prompts)
    placed: dict[str, str] = {}
    killed: list[str] = []

    async def kill_when_all_stream(received) -> None:
        for req_id in received:
            worker = cluster.backend.decode_worker_of(req_id)
            if worker is not None:
                placed[req_id] = worker
        # Every stream has its first decode token: kill the decode worker of the first one.
        if not killed and all(len(deltas) >= 2 for deltas in received.values()):
            victim = placed["doom0"]
            killed.append(victim)
            ray.kill(cluster.decode_actors[victim])

    started = time.monotonic()
    results = loop.run_until_complete(stream_all(cluster, prompts, "doom", kill_when_all_stream))
    assert time.monotonic() - started < HANG_BOUND_S  # no stream hung
    assert killed, "the streams finished before the kill"
    victim = killed[0]
    assert victim not in cluster.decode_actors, "the router dropped the dead worker at once"
    assert sorted(Counter(placed.values()).values()) == [4, 4], placed
    for i, deltas in enumerate(results):
        last = deltas[-1]
        if placed[f"doom{i}"] == victim:
            assert last.finished and last.finish_reason == "error", last
            assert victim in (last.error or ""), last.error
            assert tokens_of(deltas) == expected[i][: len(tokens_of(deltas))], "no wrong token"
        else:
            assert last.finish_reason == "length", f"stream {i} of a healthy worker: {last}"
            assert tokens_of(deltas) == expected[i], f"stream {i}"

    # The dead worker left placement at once: a later request goes to another worker.
    async def later_request() -> tuple[list, set[str | None]]:
        deltas, workers = [], set()
        async for delta in cluster.backend.generate(
            GenerateRequest("after", tuple(prompts[0]), LONG)
        ):
            deltas.append(delta)
            workers.add(cluster.backend.decode_worker_of("after"))
        return deltas, workers - {None}

    later, later_workers = loop.run_until_complete(later_request())
    assert later[-1].finish_reason == "length" and tokens_of(later) == expected[0]
    assert later_workers and victim not in later_workers, later_workers
    loop.run_until_complete(wait_until_no_leaks(cluster))
