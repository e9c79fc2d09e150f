"""A tensor-parallel worker's ranks as Ray actors on a real multi-node Ray cluster
(`ray.cluster_utils.Cluster`, two decode nodes of 2 CPUs): the placement group worker_launch
makes for a TP-2 worker puts both ranks on one node; rank 0 (an actor in bundle 0, as the
worker actor is) runs an Engine whose follower is a RankActor in bundle 1
(common/rank_actors.py), token-exact against one rank; a rank killed fails the next step with
RankLost naming its actor's end, every block freed; removing the group ends the ranks. Then
the controller runs two TP-2 decode workers, one a node, each with both ranks on its node;
`kvrelay scale` down removes one: its group and both its ranks' processes are gone."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray
from ray.cluster_utils import Cluster
from ray.exceptions import RayActorError
from ray.util.placement_group import placement_group_table

from common.cluster_state import NAMESPACE, RankPlace, ScaleRequest, WorkerState
from common.rank_actors import RayFollower, this_place
from deploy.controller import ControllerConfig, start_controller
from deploy.progress import follow
from deploy.worker_launch import (
    WorkerTemplate,
    actor_options,
    rank_bundles,
    rank_group,
    release_ranks,
    worker_engine_config,
)
from engine.config import CacheConfig, EngineConfig
from engine.sampling.sampling_params import SamplingParams
from tests.conftest import build_engine, run_to_completion
from tests.factories import make_tiny_checkpoint

PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPTS = [[5, 17, 300, 42], [(7 * i + 3) % 500 + 1 for i in range(40)], [7]]


class EngineHost:
    """Rank 0 as a worker actor hosts it (WorkerBase's start-up, without the NIXL handoff)."""

    def __init__(self, config: EngineConfig):
        import torch

        from common.rank_actors import start_ray_follower
        from engine.engine import Engine

        torch.set_num_threads(1)
        self.engine = Engine(config, start_follower=start_ray_follower)

    def generate(self, prompts: list[list[int]]) -> list[list[int]]:
        for i, prompt in enumerate(prompts):
            self.engine.add_request(f"r{i}", prompt, PARAMS)
        got = run_to_completion(self.engine)
        return [got[f"r{i}"] for i in range(len(prompts))]

    def places(self) -> list[RankPlace]:
        ranks = [f.place() for f in self.engine.followers if isinstance(f, RayFollower)]
        return [this_place(0, self.engine.config.device), *ranks]

    def follower_actors(self) -> list[Any]:
        return [f.actor for f in self.engine.followers if isinstance(f, RayFollower)]

    def free_blocks(self) -> tuple[int, int, bool]:
        """(free blocks, total blocks, requests in flight) of rank 0's pool."""
        kv = self.engine.kv
        return kv.num_free_blocks, kv.num_blocks, self.engine.has_unfinished_requests


def runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def nodes() -> Iterator[Cluster]:
    """A head without CPUs (the driver, the controller, a TP-1 prefill worker) and two decode
    nodes of 2 CPUs: a TP-2 worker fits on either, not across them (its bundles are a CPU
    each, STRICT_PACK)."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if ray.is_initialized():
        ray.shutdown()
    head = {"num_cpus": 0, "resources": {"prefill_pool": 1}}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=2, resources={"decode_pool": 1})
        ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny")))


def test_tp_worker_ranks_share_a_node_run_token_exact_and_end_with_their_group(
    nodes: Cluster, checkpoint: str
) -> None:
    engine = EngineConfig(model=checkpoint, cache=CacheConfig(num_blocks=32))
    template = WorkerTemplate(engine, None, threads_per_worker=1, decode_tp=2)
    assert rank_bundles("decode", template) == [{"decode_pool": 1.0, "CPU": 1.0}, {"CPU": 1.0}]
    config = worker_engine_config("decode", template)
    assert config.tensor_parallel_size == 2

    group = rank_group("decode", "tpw-0", template)
    assert group is not None
    ray.get(group.ready(), timeout=60)
    host_cls = ray.remote(EngineHost)
    host = host_cls.options(**actor_options("decode", "tpw-0", template, group)).remote(config)

    reference = build_engine(model_path=checkpoint, num_blocks=32)
    for i, prompt in enumerate(PROMPTS):
        reference.add_request(f"r{i}", prompt, PARAMS)
    expected = run_to_completion(reference)
    assert ray.get(host.generate.remote(PROMPTS), timeout=120) == [
        expected[f"r{i}"] for i in range(len(PROMPTS))
    ]

    places = ray.get(host.places.remote(), timeout=30)
    assert [p.rank for p in places] == [0, 1]
    assert len({p.pid for p in places}) == 2, "a rank a process"
    table = placement_group_table(group)
    assert table["strategy"] == "STRICT_PACK"
    [group_node] = set(table["bundles_to_node_id"].values())
    assert {p.node_id for p in places} == {group_node}, "both ranks on the group's one node"
    assert all(p.device == "cpu" for p in places)

    # a rank killed: the next step fails at once with RankLost naming it; no block is held
    [follower] = ray.get(host.follower_actors.remote(), timeout=30)
    ray.kill(follower, no_restart=True)
    with pytest.raises(Exception, match=r"RankLost.*rank 1 \(its actor ended"):
        ray.get(host.generate.remote(PROMPTS[:1]), timeout=120)
    free, total, in_flight = ray.get(host.free_blocks.remote(), timeout=30)
    assert (free, in_flight) == (total, False)

    # the worker retired: its group removed, rank 0's actor ends with it (Ray kills it after
    # the removal returns: a call already queued may still be answered, the next ones not)
    release_ranks(group)
    deadline = time.monotonic() + 60
    with pytest.raises(RayActorError):
        while time.monotonic() < deadline:
            ray.get(host.places.remote(), timeout=60)
            time.sleep(0.2)
    assert placement_group_table(group)["state"] == "REMOVED"


def test_tp_decode_workers_ranks_share_their_node_and_scale_down_ends_them(
    nodes: Cluster, checkpoint: str, loop
) -> None:
    engine = EngineConfig(model=checkpoint, cache=CacheConfig(num_blocks=32))
    template = WorkerTemplate(engine, None, threads_per_worker=1, decode_tp=2)
    config = ControllerConfig(template, drain_grace_s=0.5)
    controller = loop.run_until_complete(start_controller(config, {"prefill": 1, "decode": 2}))
    try:
        status = loop.run_until_complete(follow(controller, lambda m: None, timeout_s=180))
        workers = status.pool("decode").workers
        assert [w.state for w in workers] == [WorkerState.READY] * 2
        for worker in workers:
            assert [r.rank for r in worker.ranks] == [0, 1]
            assert {r.node_id for r in worker.ranks} == {worker.node_id}, "ranks on its node"
        assert len({w.node_id for w in workers}) == 2, "a worker a decode node (2 CPUs each)"

        ray.get(controller.scale.remote(ScaleRequest(decode=1)))
        status = loop.run_until_complete(follow(controller, lambda m: None, timeout_s=120))
        [kept] = [w for w in status.pool("decode").workers if w.state == WorkerState.READY]
        [removed] = [w for w in workers if w.worker_id != kept.worker_id]
        groups = {g["name"]: g["state"] for g in placement_group_table().values()}
        assert groups[f"{removed.worker_id}-ranks"] == "REMOVED"
        assert groups[f"{kept.worker_id}-ranks"] == "CREATED"
        deadline = time.monotonic() + 30
        while any(runs(r.pid) for r in removed.ranks):  # the removed worker's ranks end
            assert time.monotonic() < deadline, f"a rank of {removed.worker_id} still runs"
            time.sleep(0.1)
        assert all(runs(r.pid) for r in kept.ranks)
    finally:
        ray.get(controller.shutdown.remote())
        ray.kill(controller)
