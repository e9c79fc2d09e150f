"""Node loss on a real multi-node Ray cluster (`ray.cluster_utils.Cluster`, one raylet per node,
health checks as the cluster YAMLs set them): the raylet of a decode node is killed while
streams run on both decode workers. The streams of its worker migrate and end token-exact; the
controller marks the worker gone from Ray's death notice and drops it from Redis, the router's
membership drops it, and the replacement starts on the spare decode node."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray
from ray.cluster_utils import Cluster

from common.cluster_state import NAMESPACE, WorkerState
from common.messages import GenerateRequest, TokenDelta
from deploy.controller import ControllerConfig, start_controller
from deploy.progress import follow
from deploy.redis_local import LocalRedis
from deploy.router_launch import build_backend
from deploy.worker_launch import WorkerTemplate
from engine.config import CacheConfig, EngineConfig
from engine.sampling.sampling_params import SamplingParams
from tests.factories import make_tiny_checkpoint
from tests.integration.cluster_support import tokens_of

# As deploy/cluster.yaml sets them: a lost node is declared dead after ~1.5 s of missed checks.
HEALTH_CHECKS = {
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 3,
}
NUM_STREAMS = 6
# long enough that the slowest stream is mid-way when the node goes; 6 x <= 139 tokens: 54 blocks
GREEDY = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
START_TIMEOUT_S = 240.0
HANG_BOUND_S = 120.0


@pytest.fixture(scope="module")
def nodes() -> Iterator[tuple[Cluster, list[Any]]]:
    """A head (controller, prefill pool) and three decode nodes, one of them spare."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if ray.is_initialized():
        ray.shutdown()
    head = {"num_cpus": 2, "resources": {"prefill_pool": 1}, "_system_config": HEALTH_CHECKS}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    try:
        decode_nodes = [
            cluster.add_node(num_cpus=1, resources={"decode_pool": 1}) for _ in range(3)
        ]
        ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
        yield cluster, decode_nodes
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def stack(nodes, loop, tmp_path_factory) -> Iterator[tuple[Any, Any]]:
    """The controller with 1 prefill + 2 decode workers of a tiny model, and one router."""
    checkpoint = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))
    engine = EngineConfig(model=str(checkpoint), cache=CacheConfig(num_blocks=64))
    with LocalRedis() as redis:
        config = ControllerConfig(WorkerTemplate(engine, redis.url, threads_per_worker=1))
        controller = loop.run_until_complete(start_controller(config, {"prefill": 1, "decode": 2}))
        try:
            loop.run_until_complete(
                follow(controller, lambda message: None, timeout_s=START_TIMEOUT_S)
            )
            backend, _ = loop.run_until_complete(build_backend(controller))
            try:
                yield controller, backend
            finally:
                loop.run_until_complete(backend.close())
        finally:
            ray.get(controller.shutdown.remote())
            ray.kill(controller)


async def stream_all(backend, tag: str, on_progress=None) -> list[list[TokenDelta]]:
    received: dict[str, list[TokenDelta]] = {f"{tag}{i}": [] for i in range(NUM_STREAMS)}

    async def one(i: int) -> None:
        prompt = tuple(range(10 + i, 60 + 3 * i))  # token ids of the tiny vocabulary
        async for delta in backend.generate(GenerateRequest(f"{tag}{i}", prompt, GREEDY)):
            received[f"{tag}{i}"].append(delta)
            if on_progress is not None:
                on_progress(received)

    await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(NUM_STREAMS))), HANG_BOUND_S)
    return list(received.values())


async def until(check, what: str, timeout_s: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (result := await check()):
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.1)
    return result


async def no_leaks(backend) -> bool:
    actors = {**backend.workers.actors("prefill"), **backend.workers.actors("decode")}
    accounts = await asyncio.gather(*(a.check_no_leaks.remote() for a in actors.values()))
    return all(account.clean for account in accounts)


def test_a_lost_decode_node_is_seen_its_streams_migrate_and_its_worker_is_replaced(
    nodes, stack, loop, caplog: pytest.LogCaptureFixture
) -> None:
    cluster, decode_nodes = nodes
    controller, backend = stack
    baseline = [tokens_of(d) for d in loop.run_until_complete(stream_all(backend, "base"))]
    status = ray.get(controller.status.remote(with_stats=False))
    node_of = {w.worker_id: w.node_id for w in status.pool("decode").workers}
    pid_of = {w.worker_id: w.pid for w in status.pool("decode").workers}
    assert len(set(node_of.values())) == 2, "one decode worker per decode node"

    placed: dict[str, str] = {}
    lost: list[str] = []

    def kill_node_when_all_stream(received) -> None:
        for req_id in received:
            if (worker := backend.decode_worker_of(req_id)) is not None:
                placed.setdefault(req_id, worker)
        if not lost and all(len(d) >= 2 for d in received.values()):
            # the node of the stream furthest from its end: some of its streams are in flight
            # (a faster one may have received all its tokens already)
            slowest = min(received, key=lambda req_id: len(tokens_of(received[req_id])))
            lost.append(placed[slowest])
            [node] = [n for n in decode_nodes if n.node_id == node_of[lost[0]]]
            # The whole node goes at once: its worker is stopped first (so its streams cannot
            # finish while its raylet dies), then the raylet is killed, then the worker.
            os.kill(pid_of[lost[0]], signal.SIGSTOP)
            cluster.remove_node(node, allow_graceful=False)
            os.kill(pid_of[lost[0]], signal.SIGKILL)

    migrations_before = backend.num_migrations
    with caplog.at_level(logging.WARNING, logger="router.cluster_backend"):
        results = loop.run_until_complete(stream_all(backend, "lost", kill_node_when_all_stream))
    assert lost, "the streams ended before the node was lost"
    victim = lost[0]
    on_victim = {req_id for req_id, worker in placed.items() if worker == victim}
    assert 0 < len(on_victim) < NUM_STREAMS, placed
    # Each of the victim's streams either had all its tokens before the node went or migrated
    # (the token-exact check below holds for both); none on the other worker migrated.
    migrated = {
        record.args[0]
        for record in caplog.records
        if record.name == "router.cluster_backend" and "migrating it" in record.getMessage()
    }
    assert migrated and migrated <= on_victim, (migrated, placed)
    assert backend.num_migrations - migrations_before == len(migrated)
    for i, deltas in enumerate(results):
        assert deltas[-1].finish_reason == "length", (i, deltas[-1])
        assert tokens_of(deltas) == baseline[i], f"stream {i} (on {placed[f'lost{i}']})"

    async def recorded_gone():
        status = await controller.status.remote(with_stats=False)
        [dead] = [w for w in status.pool("decode").workers if w.worker_id == victim]
        live = {w.worker_id for w in await backend.index.live_workers("decode")}
        return dead if dead.state == WorkerState.GONE and victim not in live else None

    dead = loop.run_until_complete(until(recorded_gone, "the lost worker is still listed"))
    assert "node" in (dead.error or ""), dead.error
    assert victim not in {w.worker_id for w in backend.workers.known("decode")}

    async def replaced():
        status = await controller.status.remote(with_stats=False)
        ready = [w for w in status.pool("decode").workers if w.state == WorkerState.READY]
        known = {w.worker_id for w in backend.workers.known("decode")}
        return ready if len(ready) == 2 and {w.worker_id for w in ready} == known else None

    ready = loop.run_until_complete(until(replaced, "no replacement", START_TIMEOUT_S))
    spare = {n.node_id for n in decode_nodes} - set(node_of.values())
    assert {w.node_id for w in ready} == (set(node_of.values()) - {node_of[victim]}) | spare
    after = [tokens_of(d) for d in loop.run_until_complete(stream_all(backend, "after"))]
    assert after == baseline
    loop.run_until_complete(until(lambda: no_leaks(backend), "blocks still in use", 30.0))
