"""Two models served side by side by one router (real Ray, Redis, NIXL; two tiny random Llama
checkpoints of different seeds beside SmolLM2's tokenizer), the second under a served name with
a slash as vLLM users give (--served-model-name): /v1/models lists both, a request's
`model` picks that model's pools and each answers token for token as its own transformers
oracle, a prompt cached under one model is no prefix hit for the other, `kvrelay scale --model`
resizes one model's decode pool while the other keeps its workers, the first model's autoscaler
(its decode pool 1..2) grows that pool under its load and shrinks it after while the second's
pools keep their size, and no block leaks."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
import ray

from common.cluster_state import WorkerState
from common.messages import GenerateRequest
from deploy.autoscale import AutoscaleConfig
from deploy.controller import find_controllers
from deploy.local_cluster import ModelPools
from deploy.ops_cli import only_model
from engine.config import CacheConfig, EngineConfig
from engine.kv_cache.hashing import hash_blocks
from engine.models.loader import resolve_model
from engine.sampling.sampling_params import SamplingParams
from tests.factories import make_tiny_checkpoint, transformers_greedy
from tests.integration.cluster_support import (
    NUM_BLOCKS,
    ClusterHarness,
    cluster_spec,
    collect,
    tokens_of,
)
from tests.server_harness import post

FOLDERS = ("tiny-a", "tiny-b")
B = "org/tiny-b"  # the second folder's served name (its folder's name is refused)
MODELS = ("tiny-a", B)  # the ids served
NEW_TOKENS = 8
PROMPT = list(range(300, 340))  # 40 tokens: two full blocks of 16 to find in the index
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
REPO = Path(__file__).resolve().parents[2]
# model A's decode pool only: 1..2, grown past one request a worker held for 3 s
A_AUTOSCALE = AutoscaleConfig(
    min_size={"prefill": 1, "decode": 1},
    max_size={"prefill": 1, "decode": 2},
    window_s=3.0,
    cooldown_s=3.0,
    warmup_s=1.0,
    target_batch=1,
    autoscaled=("decode",),
)
IN_FLIGHT = 6  # streams kept running on model A: 6x its decode target of 1 per worker


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two tiny random Llamas of different seeds, with SmolLM2's tokenizer and vocabulary."""
    smollm = Path(resolve_model("default"))
    folders = {}
    for seed, (name, folder_name) in enumerate(zip(MODELS, FOLDERS, strict=True)):
        folder = tmp_path_factory.mktemp("models") / folder_name
        make_tiny_checkpoint(folder, vocab_size=49152, seed=seed)
        for file in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(smollm / file, folder / file)
        folders[name] = folder
    return folders


@pytest.fixture(scope="module")
def oracle(checkpoints: dict[str, Path]) -> dict[str, list[int]]:
    """Each model's transformers greedy continuation of PROMPT."""
    return {m: transformers_greedy(p, [PROMPT], NEW_TOKENS)[0] for m, p in checkpoints.items()}


@pytest.fixture(scope="module")
def harness(checkpoints: dict[str, Path]) -> Iterator[ClusterHarness]:
    def engine(model: str, name: str | None = None) -> EngineConfig:
        cache = CacheConfig(num_blocks=NUM_BLOCKS)
        return EngineConfig(model=str(checkpoints[model]), served_model_name=name, cache=cache)

    spec = cluster_spec(
        engine=engine("tiny-a"),
        num_prefill=1,
        num_decode=1,
        autoscale=A_AUTOSCALE,
        more_models=(ModelPools(engine(B, B), num_prefill=1, num_decode=1),),
        drain_grace_s=0.5,
    )
    harness = ClusterHarness(spec)
    yield harness
    harness.stop()


def get(harness: ClusterHarness, path: str) -> str:
    with urllib.request.urlopen(harness.base_url + path, timeout=30) as response:
        return response.read().decode()


def generate(harness: ClusterHarness, model: str, req_id: str) -> list:
    request = GenerateRequest(req_id, tuple(PROMPT), GREEDY, model=model)
    return harness.run(collect(harness.cluster.backend, request))


def kvrelay(*args: str) -> subprocess.CompletedProcess[str]:
    """The `kvrelay` CLI in its own process against this test's Ray cluster."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_AUTH_MODE": "disabled"}
    address = ray.get_runtime_context().gcs_address
    command = [sys.executable, "-m", "deploy.cli", *args, "--address", address]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


def test_two_models_side_by_side(harness: ClusterHarness, oracle: dict[str, list[int]]) -> None:
    cluster = harness.cluster
    assert oracle["tiny-a"] != oracle[B]  # different seeds: a mix-up would show

    # /v1/models lists both; an unknown model is refused as before (400, naming `model`).
    listed = json.loads(get(harness, "/v1/models"))["data"]
    assert [m["id"] for m in listed] == list(MODELS)
    ready = json.loads(get(harness, "/ready"))  # every model's pools have a ready worker
    assert ready["ready"] and ready["tiny-a/prefill_workers"] == ready[f"{B}/decode_workers"] == 1
    status, reply = post(harness, "/v1/completions", {"model": "nope", "prompt": PROMPT})
    assert status == 400 and reply["error"]["param"] == "model"
    assert f"'tiny-a', '{B}'" in reply["error"]["message"]
    status, reply = post(harness, "/v1/completions", {"model": "tiny-b", "prompt": PROMPT})
    assert status == 400 and reply["error"]["param"] == "model"  # served as B, not its folder
    assert json.loads(get(harness, f"/v1/models/{B}"))["id"] == B

    # Model A computes PROMPT (token for token as its oracle): its blocks go to A's namespace,
    # held by A's prefill worker; B's index finds none of them, hashed as B's or as A's.
    first_a = generate(harness, "tiny-a", "first-a")
    assert tokens_of(first_a) == oracle["tiny-a"] and first_a[0].num_cached_tokens == 0
    a_index, b_index = cluster.backends["tiny-a"].index, cluster.backends[B].index
    a_hashes = hash_blocks(PROMPT, 16, "tiny-a")
    b_hashes = hash_blocks(PROMPT, 16, B)
    assert set(a_hashes).isdisjoint(b_hashes)

    async def a_holds_prompt() -> bool:  # the worker publishes its blocks after its step
        view = await a_index.view("prefill", a_hashes)
        assert [w.worker_id for w in view.workers] == ["kvrelay-tiny-a-prefill-0"]
        return view.overlap["kvrelay-tiny-a-prefill-0"] == 2

    harness.run(until_true(a_holds_prompt))
    for hashes in (a_hashes, b_hashes):
        b_view = harness.run(b_index.view("", hashes))
        b_workers = {f"kvrelay-{B}-prefill-0", f"kvrelay-{B}-decode-0"}
        assert {w.worker_id for w in b_view.workers} == b_workers
        assert not any(b_view.overlap.values())

    # So B's request of the same prompt is no prefix hit: computed on B's pools, token for
    # token as B's own oracle; a repeat on A is a hit on A.
    first_b = generate(harness, B, "first-b")
    assert tokens_of(first_b) == oracle[B] and first_b[0].num_cached_tokens == 0
    again = generate(harness, "tiny-a", "again-a")
    assert tokens_of(again) == oracle["tiny-a"] and again[0].num_cached_tokens == 32

    # Over HTTP the request's `model` picks the pools (the text: B's oracle tokens decoded).
    tokenizer = harness.servers.frontend.routes[B].tokenizer
    body = {"model": B, "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0}
    status, reply = post(harness, "/v1/completions", {**body, "ignore_eos": True})
    assert status == 200, reply
    assert reply["model"] == B
    assert reply["choices"][0]["text"] == tokenizer.decode(oracle[B])
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 32

    # Metrics carry the model (only the HTTP request passed the front end).
    metrics = get(harness, "/metrics")
    assert f'kvrelay_model_requests_total{{finish_reason="length",model="{B}"}} 1.0' in metrics
    assert 'kvrelay_model_requests_total{finish_reason="length",model="tiny-a"}' not in metrics
    assert f'kvrelay_time_to_first_token_seconds_count{{model="{B}"}} 1.0' in metrics
    assert f'kvrelay_request_latency_seconds_count{{model="{B}"}} 1.0' in metrics
    assert 'kvrelay_time_to_first_token_seconds_count{model="tiny-a"}' not in metrics

    # Scaling: one controller per model; without --model the CLI refuses to guess.
    controllers = find_controllers()
    assert set(controllers) == set(MODELS)
    with pytest.raises(ValueError, match=rf"several models \('{B}', 'tiny-a'\): give --model"):
        only_model(controllers)
    a_workers = set(cluster.backends["tiny-a"].workers.actors("decode"))
    done = kvrelay("scale", "--model", B, "--decode", "2")
    assert done.returncode == 0, done.stderr
    assert f"pools wanted of {B}: prefill 1, decode 2" in done.stderr

    def ready_decode(model: str) -> list[str]:
        return [w.worker_id for w in cluster.backends[model].workers.known("decode")]

    harness.run(until(lambda: len(ready_decode(B)) == 2))
    assert ready_decode(B) == [f"kvrelay-{B}-decode-0", f"kvrelay-{B}-decode-1"]
    assert set(cluster.backends["tiny-a"].workers.actors("decode")) == a_workers
    a_status = ray.get(cluster.controllers["tiny-a"].status.remote(False))
    assert [(p.role, p.desired) for p in a_status.pools] == [("prefill", 1), ("decode", 1)]

    # Both models still answer exactly, side by side, after the change.
    for model in MODELS:
        assert harness.run(burst(cluster.backend, model, 4)) == [oracle[model]] * 4
    harness.wait_until_no_leaks()


def test_one_models_autoscaler_resizes_its_pool_and_no_other(
    harness: ClusterHarness, oracle: dict[str, list[int]]
) -> None:
    """Model A under a load of six streams: its controller grows A's decode pool to 2 and the
    new worker serves A; model B's pools keep their workers throughout, and A's prefill pool
    (not autoscaled) its size; once the load ends A's decode pool drains back to 1, the drained
    worker's exit check clean. Every answer is its model's oracle. (The suite's one autoscale
    test on a cluster: a single model's is model A's path. The module's harness autoscales A
    from its start: the first test's bursts, shorter than a 3 s window, never grow it.)"""
    cluster = harness.cluster
    b_before = {r: set(cluster.backends[B].workers.actors(r)) for r in ("prefill", "decode")}
    answers: list[list[int]] = []

    async def a_decode():
        return (await cluster.controllers["tiny-a"].status.remote(True)).pool("decode")

    async def load() -> None:
        stop = asyncio.Event()

        async def client(slot: int) -> None:
            n = 0
            while not stop.is_set():
                request = GenerateRequest(f"as{slot}-{n}", tuple(PROMPT), GREEDY, model="tiny-a")
                answers.append(tokens_of(await collect(cluster.backend, request)))
                n += 1

        async def grown() -> bool:
            pool = await a_decode()
            fresh = [w for w in pool.workers if w.worker_id != "kvrelay-tiny-a-decode-0"]
            served = [w for w in fresh if w.stats is not None and w.stats.num_requests > 0]
            return pool.num_ready == 2 and bool(served)

        clients = [asyncio.create_task(client(slot)) for slot in range(IN_FLIGHT)]
        try:
            await until_true(grown, 240.0)
        finally:
            stop.set()
            await asyncio.wait_for(asyncio.gather(*clients), 240.0)
        assert answers and all(a == oracle["tiny-a"] for a in answers)

        async def shrunk() -> bool:
            pool = await a_decode()
            return pool.desired == 1 and pool.settled

        await until_true(shrunk, 240.0)

    harness.run(load())
    decode = harness.run(a_decode())
    assert "autoscale 1..2, last 2 -> 1" in decode.autoscale, decode.autoscale
    drained = [w for w in decode.workers if w.state == WorkerState.GONE]
    assert drained and all(w.exit_check is not None and w.exit_check.clean for w in drained)
    a_status = ray.get(cluster.controllers["tiny-a"].status.remote(False))
    assert a_status.pool("prefill").desired == 1, "A's prefill pool is not autoscaled"
    b_after = {r: set(cluster.backends[B].workers.actors(r)) for r in ("prefill", "decode")}
    assert b_after == b_before, "the other model's pools changed"
    b_status = ray.get(cluster.controllers[B].status.remote(False))
    assert not any(p.autoscale for p in b_status.pools), "B is not autoscaled"
    assert harness.run(burst(cluster.backend, B, 2)) == [oracle[B]] * 2
    harness.wait_until_no_leaks()


async def burst(backend, model: str, num: int) -> list[list[int]]:
    """`num` requests of PROMPT on `model` at once: each one's tokens."""
    requests = [
        GenerateRequest(f"{model}-{i}", tuple(PROMPT), GREEDY, model=model) for i in range(num)
    ]
    outputs = await asyncio.gather(*(collect(backend, r) for r in requests))
    return [tokens_of(deltas) for deltas in outputs]


async def until_true(check: Callable[[], Awaitable[bool]], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def until(check: Callable[[], bool], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.2)
