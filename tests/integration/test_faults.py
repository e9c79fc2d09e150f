"""Faults injected into a running cluster (2 prefill + 1 decode workers; real Ray, Redis, NIXL,
SmolLM2, HTTP): a prefill worker killed before its handle returns and after handing off, a
frozen decode worker, an abort storm and malformed HTTP requests. Every request ends within a
bound, every completed greedy output equals an undisturbed run, and every pool ends with no
block in use. A router stalled past the decode worker's patience has its streams resumed.
Decode death, router death, node loss and Redis down are covered by test_cluster_decode_failure,
test_two_routers, test_node_loss and test_cluster (test_redis_down_then_back).

Kills and freezes are signals to the worker's process (its pid from the controller's status):
SIGKILL is a crash, SIGSTOP / SIGCONT a stall. A SIGSTOP before a kill pins the moment of death
(the worker holds the request and answers nothing), so no test depends on timing."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Callable, Iterator

import aiohttp
import pytest
import ray

from common.messages import GenerateRequest, TokenDelta
from engine.sampling.sampling_params import SamplingParams
from tests.integration.cluster_support import (
    ClusterHarness,
    cluster_spec,
    collect,
    reference_batch,
    tokens_of,
    wait_until_no_leaks,
)

MODEL = "SmolLM2-135M-Instruct"
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
LONG = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)  # outlasts a router timeout
HANG_BOUND_S = 120.0  # every request must end well within this
FREEZE_S = 3.0
ROUTER_TIMEOUT_S = 2.0  # decode workers abort a router's requests after this much silence
NUM_ABORTS = 30
ABORT_WAVE = 10  # storm requests in flight at once


@pytest.fixture(scope="module")
def harness() -> Iterator[ClusterHarness]:
    spec = cluster_spec(num_prefill=2, num_decode=1, router_timeout_s=ROUTER_TIMEOUT_S)
    harness = ClusterHarness(spec)
    try:
        yield harness
    finally:
        harness.stop()


@pytest.fixture(autouse=True)
def no_leaks_after(harness: ClusterHarness) -> Iterator[None]:
    yield
    harness.run(wait_until_no_leaks(harness.cluster, timeout_s=60), timeout_s=90)


def chat_prompts(tokenizer, tag: str, n: int) -> list[list[int]]:
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": f"{tag}: tell me fact {i}."}])
        for i in range(n)
    ]


def reference(
    make_engine, prompts: list[list[int]], params: SamplingParams = GREEDY
) -> list[list[int]]:
    return reference_batch(make_engine, prompts, params)


def start(
    harness: ClusterHarness, req_id: str, prompt: list[int], params: SamplingParams = GREEDY
) -> asyncio.Task:
    request = GenerateRequest(req_id, tuple(prompt), params)
    return asyncio.create_task(collect(harness.cluster.backend, request))


async def worker_pid(harness: ClusterHarness, worker_id: str) -> int:
    status = await harness.cluster.controller.status.remote(with_stats=False)
    return next(w.pid for pool in status.pools for w in pool.workers if w.worker_id == worker_id)


async def until(condition: Callable[[], bool], what: str, bound_s: float = HANG_BOUND_S) -> None:
    deadline = time.monotonic() + bound_s
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        await asyncio.sleep(0.02)


async def ended(tasks: list[asyncio.Task]) -> list[list[TokenDelta]]:
    """Every request's deltas; fails if one did not end within the bound (a hang)."""
    return await asyncio.wait_for(asyncio.gather(*tasks), HANG_BOUND_S)


def assert_exact(results: list[list[TokenDelta]], expected: list[list[int]]) -> None:
    for i, deltas in enumerate(results):
        assert deltas[-1].finish_reason == "length", (i, deltas[-1])
        assert tokens_of(deltas) == expected[i], f"request {i}"


def test_a_frozen_decode_worker_resumes_its_streams(harness, tokenizer, make_engine):
    prompts = chat_prompts(tokenizer, "frozen", 4)
    expected = reference(make_engine, prompts)
    cluster = harness.cluster

    async def run() -> list[list[TokenDelta]]:
        decode_id = next(iter(cluster.decode_actors))
        pid = await worker_pid(harness, decode_id)
        tasks = [start(harness, f"frozen{i}", p) for i, p in enumerate(prompts)]
        names = [f"frozen{i}" for i in range(len(prompts))]
        await until(lambda: all(cluster.backend.decode_worker_of(n) for n in names), "decoding")
        os.kill(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(FREEZE_S)  # the fault itself, not a synchronisation
        finally:
            os.kill(pid, signal.SIGCONT)
        return await ended(tasks)

    assert_exact(harness.run(run(), timeout_s=HANG_BOUND_S + 30), expected)


def test_a_stalled_routers_streams_are_resumed_after_the_worker_gave_them_up(
    harness, tokenizer, make_engine
):
    """The router's event loop stops for longer than the decode worker waits for its polls:
    the worker aborts its requests (blocks freed) and ends each with a resumable error; the
    router, running again, reads the tokens it missed and that end, and migrates each request,
    which finishes token-exact."""
    prompts = chat_prompts(tokenizer, "stalled", 4)
    expected = reference(make_engine, prompts, LONG)
    cluster = harness.cluster
    [decode] = cluster.decode_actors.values()
    aborted_before = ray.get(decode.stats.remote()).num_orphans_aborted

    def stall_until_aborted() -> int:
        """The fault: this router's loop (its polls included) stops, here until the worker
        has given its requests up; returns how many it aborted."""
        deadline = time.monotonic() + HANG_BOUND_S
        while (aborted := ray.get(decode.stats.remote()).num_orphans_aborted) == aborted_before:
            assert time.monotonic() < deadline, "the worker never gave the requests up"
            time.sleep(0.2)
        return aborted - aborted_before

    async def run() -> tuple[int, list[list[TokenDelta]]]:
        tasks = [start(harness, f"stalled{i}", p, LONG) for i, p in enumerate(prompts)]
        names = [f"stalled{i}" for i in range(len(prompts))]
        await until(lambda: all(cluster.backend.decode_worker_of(n) for n in names), "decoding")
        num_aborted = stall_until_aborted()
        return num_aborted, await ended(tasks)

    migrations_before = cluster.backend.num_migrations
    num_aborted, results = harness.run(run(), timeout_s=2 * HANG_BOUND_S)
    assert num_aborted == 4
    assert_exact(results, expected)
    assert cluster.backend.num_migrations - migrations_before == 4


async def stream_then_leave(session: aiohttp.ClientSession, url: str, i: int) -> int:
    """A streaming chat request that disconnects after two content chunks; returns how many
    it read (fewer than two: it finished before it could leave)."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Tell me a very long story, number {i}."}],
        "max_tokens": 500,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    num_chunks = 0
    async with session.post(url, json=body) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            if choice["delta"].get("content"):
                num_chunks += 1
            if num_chunks == 2:
                response.close()  # the client goes away mid-stream
                break
    return num_chunks


def test_an_abort_storm_frees_every_block(harness, tokenizer, make_engine):
    """NUM_ABORTS HTTP streams disconnect mid-stream while other requests run: those finish
    token-exact, and every pool is back to all blocks free (the fixture checks)."""
    prompts = chat_prompts(tokenizer, "storm", 4)
    expected = reference(make_engine, prompts)
    url = f"{harness.base_url}/v1/chat/completions"

    async def run() -> tuple[list[int], list[list[TokenDelta]]]:
        tasks = [start(harness, f"storm{i}", p) for i, p in enumerate(prompts)]
        read: list[int] = []
        async with aiohttp.ClientSession() as session:
            for wave in range(0, NUM_ABORTS, ABORT_WAVE):
                left = (stream_then_leave(session, url, wave + k) for k in range(ABORT_WAVE))
                read += await asyncio.wait_for(asyncio.gather(*left), HANG_BOUND_S)
        return read, await ended(tasks)

    read, results = harness.run(run(), timeout_s=3 * HANG_BOUND_S)
    assert read == [2] * NUM_ABORTS, "every storm request left mid-stream"
    assert_exact(results, expected)


LONG_PROMPT = "many words " * 5000  # over SmolLM2's 8192-token context
CHAT = [{"role": "user", "content": "Hello"}]

# (endpoint, body, the field the 400 must name)
RETAIN_101 = [{"start": 0, "end": 64, "priority": 101}]  # a priority is 0..100
RETAIN_FIELD = "kv_retention[0].priority"
RETAIN_BACKWARDS = [{"start": 0, "priority": 50}, {"start": 9, "end": 4, "priority": 50}]
END_FIELD = "kv_retention[1].end"
MALFORMED: list[tuple[str, dict, str]] = [
    ("chat", {"model": MODEL, "messages": CHAT, "max_tokens": "ten"}, "max_tokens"),
    ("chat", {"model": MODEL, "messages": CHAT, "max_tokens": -3}, "max_tokens"),
    ("chat", {"model": MODEL, "messages": CHAT, "temperature": "hot"}, "temperature"),
    ("chat", {"model": MODEL, "messages": CHAT, "temperature": -1.0}, "temperature"),
    ("chat", {"model": MODEL, "messages": CHAT, "top_p": 1.5}, "top_p"),
    ("chat", {"model": MODEL, "messages": CHAT, "top_k": -7}, "top_k"),
    ("chat", {"model": MODEL, "messages": CHAT, "min_p": 2.0}, "min_p"),
    ("chat", {"model": MODEL, "messages": CHAT, "seed": "abc"}, "seed"),
    ("chat", {"model": MODEL, "messages": CHAT, "seed": 2**70}, "seed"),
    ("chat", {"model": MODEL, "messages": []}, "messages"),
    ("chat", {"model": MODEL, "messages": "Hello"}, "messages"),
    ("chat", {"model": MODEL, "messages": [{"content": "Hello"}]}, "messages.0.role"),
    ("chat", {"model": "gpt-4o", "messages": CHAT}, "model"),
    ("chat", {"model": 5, "messages": CHAT}, "model"),  # none: the served model (not refused)
    ("chat", {"model": MODEL, "messages": CHAT, "stop_token_ids": [10**9]}, "stop_token_ids"),
    ("chat", {"model": MODEL, "messages": CHAT, "n": 17}, "n"),  # n is 1..16
    ("chat", {"model": MODEL, "messages": CHAT, "stream": "yes"}, "stream"),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": LONG_PROMPT}]}, "messages"),
    ("completions", {"model": MODEL, "prompt": LONG_PROMPT}, "prompt"),
    ("completions", {"model": MODEL, "prompt": [5, 10**9]}, "prompt"),
    ("chat", {"model": MODEL, "messages": CHAT, "kv_retention": RETAIN_101}, RETAIN_FIELD),
    ("completions", {"model": MODEL, "prompt": "Hi", "kv_retention": RETAIN_BACKWARDS}, END_FIELD),
]


def test_malformed_requests_get_400s_naming_the_field(harness, tokenizer, make_engine):
    prompts = chat_prompts(tokenizer, "valid", 4)
    expected = reference(make_engine, prompts)
    urls = {
        "chat": f"{harness.base_url}/v1/chat/completions",
        "completions": f"{harness.base_url}/v1/completions",
    }

    async def post(session: aiohttp.ClientSession, endpoint: str, body: dict) -> tuple[int, dict]:
        async with session.post(urls[endpoint], json=body) as response:
            return response.status, await response.json()

    async def run() -> tuple[list[tuple[int, dict]], list[list[TokenDelta]]]:
        tasks = [start(harness, f"valid{i}", p) for i, p in enumerate(prompts)]
        async with aiohttp.ClientSession() as session:
            answers = await asyncio.gather(*(post(session, e, b) for e, b, _ in MALFORMED))
        return answers, await ended(tasks)

    answers, results = harness.run(run(), timeout_s=HANG_BOUND_S + 30)
    for (endpoint, body, field), (status, reply) in zip(MALFORMED, answers, strict=True):
        case = f"{endpoint} {json.dumps(body)[:120]}"
        assert status == 400, (case, status, reply)
        error = reply["error"]
        assert error["param"] == field, (case, error)
        assert error["type"] == "invalid_request_error" and error["message"], (case, error)
    assert_exact(results, expected)


def test_a_prefill_worker_killed_before_its_handle_returns(harness, tokenizer, make_engine):
    """Both prefill workers stall; the one that took the first request dies with its requests
    in prefill: they are placed again on the other, and every request completes token-exact."""
    prompts = chat_prompts(tokenizer, "before", 4)
    expected = reference(make_engine, prompts)
    backend = harness.cluster.backend
    names = [f"before{i}" for i in range(len(prompts))]

    async def run() -> tuple[str, list[str], list[list[TokenDelta]]]:
        pids = {w: await worker_pid(harness, w) for w in harness.cluster.prefill_actors}
        for pid in pids.values():
            os.kill(pid, signal.SIGSTOP)  # they take requests and answer none
        try:
            tasks = [start(harness, name, p) for name, p in zip(names, prompts, strict=True)]
            await until(lambda: all(n in backend.last_placements for n in names), "placed")
            victim = backend.last_placements[names[0]]
            on_victim = [n for n in names if backend.last_placements[n] == victim]
            os.kill(pids[victim], signal.SIGKILL)
        finally:
            for pid in pids.values():
                os.kill(pid, signal.SIGCONT)  # the survivor resumes (the victim is gone)
        return victim, on_victim, await ended(tasks)

    victim, on_victim, results = harness.run(run(), timeout_s=HANG_BOUND_S + 30)
    assert on_victim, "no request was in prefill on the killed worker"
    assert_exact(results, expected)
    assert victim not in harness.cluster.prefill_actors, "the router dropped the dead worker"


def test_a_prefill_worker_killed_after_handing_off(harness, tokenizer, make_engine):
    """Its handle is out and the decode worker has not read the blocks yet: the pull fails, the
    decode worker recomputes the prompt and the request completes token-exact."""
    prompt = chat_prompts(tokenizer, "after", 1)[0]
    expected = reference(make_engine, [prompt])
    cluster = harness.cluster

    async def run() -> tuple[list[TokenDelta], int]:
        decode_id, decode = next(iter(cluster.decode_actors.items()))
        before = (await decode.stats.remote()).num_recomputed
        decode_pid = await worker_pid(harness, decode_id)
        os.kill(decode_pid, signal.SIGSTOP)  # the handoff waits at the decode worker
        try:
            task = start(harness, "after0", prompt)
            await until(lambda: cluster.backend.decode_worker_of("after0") is not None, "handed")
            holder = cluster.backend.last_placements["after0"]
            os.kill(await worker_pid(harness, holder), signal.SIGKILL)
        finally:
            os.kill(decode_pid, signal.SIGCONT)
        (deltas,) = await ended([task])
        return deltas, (await decode.stats.remote()).num_recomputed - before

    deltas, num_recomputed = harness.run(run(), timeout_s=HANG_BOUND_S + 30)
    assert_exact([deltas], expected)
    assert num_recomputed == 1
    assert deltas[1].transfer is not None and deltas[1].transfer.recomputed
