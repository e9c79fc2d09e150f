"""1 prefill + 2 decode workers: a burst is spread over both decode workers, and when one dies
its streams are migrated to the other and go on token-exact (greedy and seeded), or, past the
migration budget, end with a clear error (real Ray, NIXL and Redis)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest
import ray

from common.messages import GenerateRequest, TokenDelta
from deploy.local_cluster import LocalCluster
from engine.sampling.sampling_params import SamplingParams
from router.serving_gate import ServingGate
from tests.integration.cluster_support import (
    cluster_spec,
    reference_batch,
    tokens_of,
    wait_until_no_leaks,
)

LONG = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
NUM_STREAMS = 8
NUM_SEEDED = 2  # of the streams, these sample (temperature 0.9, a seed each)
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


def params_of(i: int) -> SamplingParams:
    if i < NUM_STREAMS - NUM_SEEDED:
        return LONG
    return SamplingParams(max_tokens=48, temperature=0.9, seed=100 + i, ignore_eos=True)


def reference(make_engine, prompts: list[list[int]]) -> list[list[int]]:
    return reference_batch(make_engine, prompts, [params_of(i) for i in range(len(prompts))])


async def stream_all(cluster, prompts, prefix: str, on_progress=None) -> list[list[TokenDelta]]:
    """Run every prompt as a concurrent stream; `on_progress(received)` after each delta."""
    received: dict[str, list[TokenDelta]] = {f"{prefix}{i}": [] for i in range(len(prompts))}

    async def one(i: int, prompt: list[int]) -> None:
        req_id = f"{prefix}{i}"
        request = GenerateRequest(req_id, tuple(prompt), params_of(i))
        async for delta in cluster.backend.generate(request):
            received[req_id].append(delta)
            if on_progress is not None:
                await on_progress(received)

    tasks = [one(i, p) for i, p in enumerate(prompts)]
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


def kill_one_when_all_stream(cluster, placed: dict[str, str], killed: list[str], first: str):
    """An on_progress hook: once every stream has a decode token, kill `first`'s worker."""

    async def hook(received) -> None:
        for req_id in received:
            worker = cluster.backend.decode_worker_of(req_id)
            if worker is not None and req_id not in placed:
                placed[req_id] = worker
        if not killed and all(len(deltas) >= 2 for deltas in received.values()):
            victim = placed[first]
            killed.append(victim)
            ray.kill(cluster.decode_actors[victim])

    return hook


async def both_decode_workers_ready(cluster) -> None:
    """The controller has replaced a killed decode worker and the router knows it."""
    deadline = time.monotonic() + 180
    while True:
        status = await cluster.controller.status.remote(with_stats=False)
        if status.pool("decode").settled and len(cluster.backend.workers.known("decode")) == 2:
            return
        assert time.monotonic() < deadline, "the dead decode worker was not replaced"
        await asyncio.sleep(0.2)


def test_a_dead_decode_workers_streams_migrate_and_stay_exact(
    cluster, loop, tokenizer, make_engine
):
    prompts = prompts_for(tokenizer, "doom")
    expected = reference(make_engine, prompts)
    placed: dict[str, str] = {}
    killed: list[str] = []
    before = cluster.backend.num_migrations
    # The victim is the worker of a seeded stream, so a seeded stream is always migrated.
    hook = kill_one_when_all_stream(cluster, placed, killed, f"doom{NUM_STREAMS - 1}")

    started = time.monotonic()
    results = loop.run_until_complete(stream_all(cluster, prompts, "doom", hook))
    assert time.monotonic() - started < HANG_BOUND_S  # no stream hung
    assert killed, "the streams finished before the kill"
    victim = killed[0]
    assert victim not in cluster.decode_actors, "the router dropped the dead worker at once"
    assert sorted(Counter(placed.values()).values()) == [4, 4], placed
    # Every stream finished, with no duplicated or missing token: the migrated ones (those of
    # the victim, seeded ones included) equal an undisturbed run too.
    for i, deltas in enumerate(results):
        assert deltas[-1].finish_reason == "length", (i, deltas[-1])
        assert tokens_of(deltas) == expected[i], f"stream {i} (on {placed[f'doom{i}']})"
        assert all(d.req_id == f"doom{i}" for d in deltas)
    on_victim = sum(worker == victim for worker in placed.values())
    assert cluster.backend.num_migrations - before == on_victim == 4
    assert placed[f"doom{NUM_STREAMS - 1}"] == victim

    # The controller sees the death and removes the worker from Redis (not at its TTL).
    async def death_recorded() -> tuple[str, str]:
        deadline = time.monotonic() + 30
        while True:
            status = await cluster.controller.status.remote(with_stats=False)
            [dead] = [w for w in status.pool("decode").workers if w.worker_id == victim]
            live = {w.worker_id for w in await cluster.backend.index.live_workers("decode")}
            if dead.state == "gone" and victim not in live:
                return dead.state, dead.error or ""
            assert time.monotonic() < deadline, (dead, live)
            await asyncio.sleep(0.1)

    _, error = loop.run_until_complete(death_recorded())
    assert "died" in error
    loop.run_until_complete(both_decode_workers_ready(cluster))
    loop.run_until_complete(wait_until_no_leaks(cluster))


def test_past_the_migration_budget_a_stream_ends_with_a_clear_error(
    cluster, loop, tokenizer, make_engine
):
    loop.run_until_complete(both_decode_workers_ready(cluster))
    prompts = prompts_for(tokenizer, "budget")
    expected = reference(make_engine, prompts)
    placed: dict[str, str] = {}
    killed: list[str] = []
    cluster.backend.max_migrations = 0
    try:
        hook = kill_one_when_all_stream(cluster, placed, killed, "budget0")
        results = loop.run_until_complete(stream_all(cluster, prompts, "budget", hook))
    finally:
        cluster.backend.max_migrations = 2
    assert killed, "the streams finished before the kill"
    victim = killed[0]
    for i, deltas in enumerate(results):
        last = deltas[-1]
        if placed[f"budget{i}"] == victim:
            assert last.finished and last.finish_reason == "error", last
            assert victim in (last.error or "") and "not migrated" in (last.error or "")
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


def test_a_dead_decode_workers_n3_requests_resume_every_open_choice(
    cluster, loop, tokenizer, make_engine
):
    """n = 3, seeded sampling and greedy side by side: when the seeded request's decode worker
    dies mid-stream, each of its open choices resumes as a request of its own on the other
    worker (seed + i, from the tokens it sent), and every choice ends as in an undisturbed
    run, with no duplicated or missing token. The router starts draining as the worker dies:
    the choices resume all the same (only new requests are refused)."""
    loop.run_until_complete(both_decode_workers_ready(cluster))
    prompt = tuple(prompts_for(tokenizer, "forked")[0])
    seeded = SamplingParams(max_tokens=48, temperature=0.9, seed=7, ignore_eos=True, n=3)
    greedy = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True, n=3)
    killed: list[str] = []

    async def run(req_id: str, params: SamplingParams, kill: bool):
        choices: dict[int, list[int]] = {i: [] for i in range(3)}
        reasons: dict[int, str | None] = {}
        async for delta in cluster.backend.generate(GenerateRequest(req_id, prompt, params)):
            assert delta.req_id == req_id and delta.error is None, delta
            choices[delta.index].extend(delta.token_ids)
            if delta.finished:
                reasons[delta.index] = delta.finish_reason
            if kill and not killed and all(len(t) >= 3 for t in choices.values()):
                victim = cluster.backend.decode_worker_of(req_id)
                assert victim is not None
                killed.append(victim)
                cluster.backend.gate.refuse("draining")  # a drain begins as the worker dies
                ray.kill(cluster.decode_actors[victim])
        return choices, reasons

    async def storm():
        return await asyncio.wait_for(
            asyncio.gather(run("storm", seeded, True), run("calm-greedy", greedy, False)),
            HANG_BOUND_S,
        )

    undisturbed, _ = loop.run_until_complete(run("calm", seeded, False))
    before = cluster.backend.num_migrations
    gate = cluster.backend.gate
    cluster.backend.gate = ServingGate()  # refuses for this test only
    try:
        (migrated, reasons), (greedy_choices, greedy_reasons) = loop.run_until_complete(storm())
        assert cluster.backend.gate.refusal == "draining"
    finally:
        cluster.backend.gate = gate
    assert killed, "the request finished before the kill"
    assert cluster.backend.num_migrations > before
    assert migrated == undisturbed and reasons == {0: "length", 1: "length", 2: "length"}
    single = reference_batch(
        make_engine, [list(prompt)], [SamplingParams(**{**greedy.__dict__, "n": 1})]
    )
    assert greedy_choices == {i: single[0] for i in range(3)}
    assert set(greedy_reasons.values()) == {"length"}
    loop.run_until_complete(both_decode_workers_ready(cluster))
    loop.run_until_complete(wait_until_no_leaks(cluster))


def test_when_every_decode_worker_dies_the_streams_wait_and_resume_on_the_replacements(
    cluster, loop, tokenizer, make_engine
):
    """No decode worker is left to migrate to: each stream waits (MIGRATION_WAIT_S) for the
    controller's replacements and resumes there, token-exact, rather than ending in an error."""
    loop.run_until_complete(both_decode_workers_ready(cluster))
    prompts = prompts_for(tokenizer, "last")
    expected = reference(make_engine, prompts)
    killed: list[str] = []
    before = cluster.backend.num_migrations

    async def kill_both(received) -> None:
        if not killed and all(len(deltas) >= 2 for deltas in received.values()):
            for worker_id, actor in list(cluster.decode_actors.items()):
                killed.append(worker_id)
                ray.kill(actor)

    results = loop.run_until_complete(stream_all(cluster, prompts, "last", kill_both))
    assert len(killed) == 2, "the streams finished before the kill"
    for i, deltas in enumerate(results):
        assert deltas[-1].finish_reason == "length", (i, deltas[-1])
        assert tokens_of(deltas) == expected[i], f"stream {i}"
    assert cluster.backend.num_migrations - before == NUM_STREAMS  # each resumed once
    assert not set(killed) & set(cluster.decode_actors)
    loop.run_until_complete(both_decode_workers_ready(cluster))
    loop.run_until_complete(wait_until_no_leaks(cluster))
