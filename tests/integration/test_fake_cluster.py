"""The multi-node rehearsal: deploy/fake-cluster.yaml on this machine (Ray's fake_multinode
provider: one raylet per fake node). It starts with one prefill and one decode node; the
controller serves a tiny random model on them, and `kvrelay scale --decode 2` beyond the decode
nodes makes the autoscaler add a second decode node that the new worker runs on."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from common.cluster_state import ClusterStatus, WorkerState
from deploy.controller import ControllerConfig, start_controller
from deploy.progress import follow
from deploy.redis_local import LocalRedis
from deploy.worker_launch import WorkerTemplate
from engine.config import CacheConfig, EngineConfig
from tests.factories import make_tiny_checkpoint
from tests.fake_ray_cluster import FakeCluster, cluster_processes, fake_cluster

REPO = Path(__file__).resolve().parents[2]

NAMESPACE = "kvrelay"
SCALE_TIMEOUT_S = 90.0  # a fake node is a raylet start: a few seconds, more on a busy machine


@pytest.fixture(scope="module")
def cluster() -> Iterator[FakeCluster]:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if ray.is_initialized():  # a driver left by an earlier module must not hide ours
        ray.shutdown()
    with fake_cluster() as running:
        ray.init(address=running.address, namespace=NAMESPACE, log_to_driver=False)
        try:
            yield running
        finally:
            ray.shutdown()
    assert not cluster_processes(running.temp_dir)


def pool_node_ids(pool: str) -> list[str]:
    """Alive nodes that carry `pool` (prefill_pool / decode_pool), by node id."""
    return sorted(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get(pool))


def wait_for_pool_nodes(pool: str, num_nodes: int, timeout_s: float = SCALE_TIMEOUT_S) -> list:
    deadline = time.monotonic() + timeout_s
    while len(node_ids := pool_node_ids(pool)) != num_nodes:
        if time.monotonic() > deadline:
            raise AssertionError(f"{pool}: {len(node_ids)} nodes, wanted {num_nodes}: {node_ids}")
        time.sleep(0.2)  # polling the GCS, not waiting for a guess at the duration
    return node_ids


@pytest.fixture(scope="module")
def controller(cluster: FakeCluster, tmp_path_factory) -> Iterator[object]:
    """The controller on the fake head, 1 prefill + 1 decode worker of a tiny random model."""
    checkpoint = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))
    engine = EngineConfig(model=str(checkpoint), cache=CacheConfig(num_blocks=64))
    with LocalRedis() as redis:
        config = ControllerConfig(WorkerTemplate(engine, redis.url, threads_per_worker=1))
        sizes = {"prefill": 1, "decode": 1}
        handle = asyncio.run(start_controller(config, sizes))
        try:
            asyncio.run(follow(handle, lambda message: None, timeout_s=SCALE_TIMEOUT_S))
            yield handle
        finally:
            ray.get(handle.shutdown.remote())
            ray.kill(handle)


def kvrelay_scale(cluster: FakeCluster, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_AUTH_MODE": "disabled"}
    command = [sys.executable, "-m", "deploy.cli", "scale", *args, "--address", cluster.address]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


def test_scaling_decode_beyond_its_nodes_adds_a_node(cluster, controller) -> None:
    head = [n for n in ray.nodes() if n["Alive"] and "node:__internal_head__" in n["Resources"]]
    assert len(head) == 1 and not {"prefill_pool", "decode_pool"} & set(head[0]["Resources"])
    assert len(wait_for_pool_nodes("prefill_pool", 1)) == 1  # min_workers
    [first_decode_node] = wait_for_pool_nodes("decode_pool", 1)

    done = kvrelay_scale(cluster, "--decode", "2")
    assert done.returncode == 0, done.stderr
    assert "ready" in done.stderr

    decode_nodes = wait_for_pool_nodes("decode_pool", 2)
    assert first_decode_node in decode_nodes
    status: ClusterStatus = ray.get(controller.status.remote())
    decode = status.pool("decode")
    assert decode.num_ready == 2
    placed = sorted(w.node_id for w in decode.workers if w.state == WorkerState.READY)
    assert placed == decode_nodes, "one decode worker on each decode node"
    [prefill] = status.pool("prefill").workers
    assert prefill.node_id in wait_for_pool_nodes("prefill_pool", 1)
