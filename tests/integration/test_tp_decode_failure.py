"""1 prefill worker + 2 decode workers at TP 2 (each two Ray actors in a placement group, gloo)
on a tiny random Llama: the process of one decode worker's rank 1 is killed mid-stream. Its
worker goes down at once (no collective hangs: the broken socket fails rank 0's next step,
RankLost, the worker's process exits), its streams migrate to the other decode worker and end
token-exact, its placement group is removed (its ranks end with it), the controller starts a
replacement, and no block leaks."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import ray
from ray.util.placement_group import placement_group_table

from common.messages import GenerateRequest, TokenDelta
from engine.config import CacheConfig, EngineConfig
from engine.sampling.sampling_params import SamplingParams
from tests.conftest import build_engine
from tests.factories import make_tiny_checkpoint
from tests.integration.cluster_support import (
    cluster_spec,
    reference_batch,
    running_cluster,
    tokens_of,
    wait_until_no_leaks,
)

LONG = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
NUM_STREAMS = 4
HANG_BOUND_S = 90.0
PROMPTS = [[(5 * i + 11 * j) % 500 + 1 for j in range(20 + 3 * i)] for i in range(NUM_STREAMS)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), num_heads=4, num_kv_heads=2)


@pytest.fixture(scope="module")
def cluster(loop, checkpoint):
    engine = EngineConfig(model=str(checkpoint), cache=CacheConfig(num_blocks=64))
    spec = cluster_spec(engine=engine, num_prefill=1, num_decode=2, decode_tp=2, redis_url="")
    yield from running_cluster(loop, spec)


def test_a_killed_decode_rank_takes_its_worker_down_and_its_streams_migrate_exactly(
    cluster, loop, checkpoint
) -> None:
    expected = reference_batch(
        lambda: build_engine(model_path=str(checkpoint), num_blocks=64), PROMPTS, LONG
    )
    status = ray.get(cluster.controller.status.remote(False))
    ranks = {w.worker_id: w.ranks for w in status.pool("decode").workers}
    assert all([r.rank for r in places] == [0, 1] for places in ranks.values())
    placed: dict[str, str] = {}
    killed: list[str] = []
    before = cluster.backend.num_migrations

    async def kill_rank_when_all_stream(received: dict[str, list[TokenDelta]]) -> None:
        for req_id in received:
            worker = cluster.backend.decode_worker_of(req_id)
            if worker is not None and req_id not in placed:
                placed[req_id] = worker
        if not killed and all(len(deltas) >= 2 for deltas in received.values()):
            victim = placed["s0"]
            killed.append(victim)
            os.kill(ranks[victim][1].pid, signal.SIGKILL)  # rank 1's process, not the worker

    async def stream_all() -> list[list[TokenDelta]]:
        received: dict[str, list[TokenDelta]] = {f"s{i}": [] for i in range(NUM_STREAMS)}

        async def one(i: int) -> None:
            request = GenerateRequest(f"s{i}", tuple(PROMPTS[i]), LONG)
            async for delta in cluster.backend.generate(request):
                received[f"s{i}"].append(delta)
                await kill_rank_when_all_stream(received)

        await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(NUM_STREAMS))), HANG_BOUND_S)
        return list(received.values())

    started = time.monotonic()
    results = loop.run_until_complete(stream_all())
    assert time.monotonic() - started < HANG_BOUND_S  # no stream hung on a collective
    assert killed, "the streams finished before the kill"
    victim = killed[0]
    for i, deltas in enumerate(results):
        assert deltas[-1].finish_reason == "length", (i, deltas[-1])
        assert tokens_of(deltas) == expected[i], f"stream {i} (on {placed[f's{i}']})"
    assert cluster.backend.num_migrations > before, "the victim's streams migrated"

    async def victim_gone() -> None:
        deadline = time.monotonic() + 60
        while True:
            status = await cluster.controller.status.remote(with_stats=False)
            [record] = [w for w in status.pool("decode").workers if w.worker_id == victim]
            if record.state.value == "gone":
                return
            assert time.monotonic() < deadline, f"{victim} is still {record.state.value}"
            await asyncio.sleep(0.2)

    loop.run_until_complete(victim_gone())
    groups = {g["name"]: g["state"] for g in placement_group_table().values()}
    assert groups[f"{victim}-ranks"] == "REMOVED"
    with pytest.raises(ProcessLookupError):
        os.kill(ranks[victim][0].pid, 0)  # rank 0 (the worker's process) exited too
    loop.run_until_complete(wait_until_no_leaks(cluster))
