"""The multi-node rehearsal: deploy/fake-cluster.yaml on this machine (Ray's fake_multinode
provider: one raylet per fake node). It starts with one prefill and one decode node; asking
for two decode_pool bundles makes the autoscaler add a second decode node, and a decode_pool
actor runs on each. No model is loaded: this checks the YAML and the pool resources."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest
import ray
from ray.autoscaler.sdk import request_resources

from tests.fake_ray_cluster import FakeCluster, cluster_processes, fake_cluster

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


def scale_pools_and_wait(num_prefill: int, num_decode: int) -> list[str]:
    """Ask the autoscaler for pools of these sizes and wait for them; the decode node ids.

    This is the request the controller makes for `kvrelay scale --prefill P --decode D`; once
    the controller exists, call its scale here instead of request_resources.
    """
    request_resources(
        bundles=[{"prefill_pool": 1}] * num_prefill + [{"decode_pool": 1}] * num_decode
    )
    wait_for_pool_nodes("prefill_pool", num_prefill)
    return wait_for_pool_nodes("decode_pool", num_decode)


@ray.remote(num_cpus=0, resources={"decode_pool": 1})
class DecodeSlot:
    """The smallest stand-in for a decode worker: takes one decode_pool unit, names its node."""

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()


def test_decode_pool_scales_to_a_second_node(cluster: FakeCluster) -> None:
    head = [n for n in ray.nodes() if n["Alive"] and "node:__internal_head__" in n["Resources"]]
    assert len(head) == 1 and not {"prefill_pool", "decode_pool"} & set(head[0]["Resources"])
    assert len(wait_for_pool_nodes("prefill_pool", 1)) == 1  # min_workers, no request yet
    [first_decode] = wait_for_pool_nodes("decode_pool", 1)

    decode_ids = scale_pools_and_wait(num_prefill=1, num_decode=2)
    assert first_decode in decode_ids

    slots = [DecodeSlot.remote() for _ in decode_ids]  # one unit per node: one slot on each
    placed = ray.get([slot.node_id.remote() for slot in slots], timeout=SCALE_TIMEOUT_S)
    assert sorted(placed) == decode_ids
    for slot in slots:
        ray.kill(slot)
