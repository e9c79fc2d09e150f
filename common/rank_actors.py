"""A tensor-parallel worker's ranks as Ray actors: RankActor (one follower rank's process: its
Follower, built then run) and RayFollower (rank 0's FollowerHandle over one, its exit the
actor's death or its run's end). Owns the follower actors' handles; the placement group they
sit in is the controller's (deploy/worker_launch.py creates and removes it).

Rank 0 is the worker actor itself, in bundle 0 of its placement group; it starts ranks
1..N-1 in bundles 1..N-1 of the same group (STRICT_PACK: one node, so the group's store
listens on the loopback address) while its Engine starts (start_ray_follower, the Engine's
start_follower).
"""

from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING, Any

from common.cluster_state import NAMESPACE, RankPlace

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.parallel.step_plan import ReadPlan
    from kvtransfer.base import AgentMetadata
    from kvtransfer.nixl_transfer import NixlTransfer

READ_POLL_S = 0.0002  # a follower's poll of its read in flight
METADATA_TIMEOUT_S = 300.0  # a rank's NIXL registration, after its shard has loaded


def rank_device_name(device: str) -> str:
    """This process's device as a rank runs on it: a Ray actor sees its one GPU as cuda:0."""
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda:0" if device.startswith("cuda") else device


def this_place(rank: int, device: str) -> RankPlace:
    """Where this process (a rank's actor) runs: node, pid, device (with Ray's GPU ids)."""
    import ray

    name = rank_device_name(device)
    if name.startswith("cuda"):
        name = f"{name} (GPU {','.join(str(g) for g in ray.get_gpu_ids())})"
    context = ray.get_runtime_context()
    return RankPlace(rank, ray.util.get_node_ip_address(), context.get_node_id(), os.getpid(), name)


class RankActor:
    """One follower rank of a worker (a Ray actor in its worker's placement group, two
    threads: run() holds one while metadata() answers on the other). It registers its cache
    (and, with host leases, its host tier) with a NIXL agent of its own: a peer reads this
    rank's KV heads from it directly."""

    def __init__(self, rank: int, device: str):
        self.rank, self.device = rank, device
        self._registered = threading.Event()
        self._meta: AgentMetadata | None = None
        self._error: BaseException | None = None

    def place(self) -> RankPlace:
        return this_place(self.rank, self.device)

    def run(self, config: EngineConfig, address: str) -> int:
        """Join rank 0's group, load the shard, register its cache with NIXL, follow rank
        0's steps until its Shutdown; returns the steps run. An error (rank 0 gone: its
        sockets closed) is raised."""
        import torch

        from engine.parallel.follower import Follower
        from engine.parallel.tensor_parallel import rank_kv_heads
        from kvtransfer.nixl_transfer import NixlTransfer

        try:
            device = torch.device(rank_device_name(config.device))
            follower = Follower(config, self.rank, address, device)
            transfer = NixlTransfer(follower.model_config.model_id)
            # with host leases (keep_on_host) a peer reads this rank's heads of kept blocks
            # from its own host tier too: registered beside its cache, as rank 0's is
            host = follower.copies.host if config.cache.keep_on_host else None
            transfer.register(follower.kv_cache, host)
            size, heads = config.tensor_parallel_size, follower.model_config.num_kv_heads
            transfer.set_layout(size, rank_kv_heads(heads, self.rank, size).start, heads)
            follower.on_read = lambda plan: read_heads(transfer, plan)
            self._meta = transfer.metadata()
        except BaseException as error:
            self._error = error
            raise
        finally:
            self._registered.set()
        try:
            follower.run()
        finally:
            transfer.close()
        return follower.num_steps

    def metadata(self) -> AgentMetadata:
        """This rank's NIXL agent (waits for its registration; its failure is raised)."""
        if not self._registered.wait(METADATA_TIMEOUT_S):
            raise TimeoutError(f"rank {self.rank} registered no KV cache in {METADATA_TIMEOUT_S} s")
        if self._meta is None:
            raise RuntimeError(f"rank {self.rank} failed to start: {self._error!r}")
        return self._meta


def read_heads(transfer: NixlTransfer, plan: ReadPlan) -> bool:
    """A follower rank's part of a pull: its own KV heads of plan's blocks from the holder's
    ranks that hold them, waited for (the ranks agree on success right after)."""
    from kvtransfer.base import AgentMetadata, TransferState

    if not isinstance(plan.peer, AgentMetadata):
        raise TypeError(f"a read plan names {type(plan.peer).__name__}, not AgentMetadata")
    peer = transfer.add_peer(plan.peer)
    handle = transfer.read(
        peer, plan.remote_block_ids, plan.local_block_ids, num_remote_host=plan.num_host
    )
    try:
        while (state := transfer.poll(handle)) is TransferState.PENDING:
            time.sleep(READ_POLL_S)
        return state is TransferState.DONE
    finally:
        transfer.release(handle)


class RayFollower:
    """Rank 0's handle on a RankActor: run() was called once; its ObjectRef ends with it."""

    def __init__(self, rank: int, actor: Any, place_ref: Any, run_ref: Any):
        self.rank = rank
        self.actor = actor
        self.place_ref = place_ref
        self.run_ref = run_ref

    def place(self, timeout_s: float = 30.0) -> RankPlace:
        import ray

        return ray.get(self.place_ref, timeout=timeout_s)

    def exit_description(self) -> str | None:
        import ray

        done, _ = ray.wait([self.run_ref], timeout=0)
        if not done:
            return None
        try:
            steps = ray.get(self.run_ref)
        except Exception as error:  # RayActorError: the actor died; else its run's error
            return f"its actor ended: {type(error).__name__}: {str(error).splitlines()[0]}"
        return f"its run ended after {steps} steps"

    def stop(self, timeout_s: float) -> None:
        import ray

        ray.wait([self.run_ref], timeout=timeout_s)
        ray.kill(self.actor, no_restart=True)


def rank_actor_options(rank: int, device: str, placement_group: Any) -> dict[str, Any]:
    """A rank's actor: bundle `rank` of its worker's placement group, that bundle's resources
    (one GPU on CUDA, a CPU on CPU: worker_launch.rank_bundles)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    on_gpu = rank_device_name(device).startswith("cuda")
    return {
        "namespace": NAMESPACE,
        "num_cpus": 0 if on_gpu else 1,
        "num_gpus": 1 if on_gpu else 0,
        "max_restarts": 0,
        "max_concurrency": 2,  # metadata() answers while run() follows rank 0
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group, placement_group_bundle_index=rank
        ),
    }


def start_ray_follower(config: EngineConfig, rank: int, address: str) -> RayFollower:
    """StartFollower for a worker actor in a placement group: rank's actor in bundle rank."""
    import ray
    from ray.util import get_current_placement_group

    group = get_current_placement_group()
    if group is None:
        raise RuntimeError(
            f"tensor_parallel_size {config.tensor_parallel_size}: this worker actor is not in "
            "a placement group (worker_launch.spawn places a TP worker's ranks in one)"
        )
    options = rank_actor_options(rank, config.device, group)
    actor = ray.remote(RankActor).options(**options).remote(rank, config.device)
    return RayFollower(rank, actor, actor.place.remote(), actor.run.remote(config, address))
