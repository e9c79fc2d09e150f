"""What both worker roles share: building a worker's engine, NIXL agent and Redis publisher,
reading its load and served model, shutting it down, and WorkerLifecycle (the one piece with
state: the worker's published state, its counters of user requests, when it turned ready)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from common.cluster_state import (
    WARMUP_REQ_PREFIX,
    LeakCheck,
    WorkerDescription,
    WorkerState,
    WorkerUnavailable,
)
from common.kv_publisher import KVPublisher
from common.messages import ServedModel, WorkerLoad

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.engine import Engine
    from kvtransfer.nixl_transfer import NixlTransfer


class WorkerParts(NamedTuple):
    """A worker's engine, its KV pool registered with its NIXL agent, and its publisher."""

    engine: Engine
    transfer: NixlTransfer
    publisher: KVPublisher | None


def build_worker_parts(
    role: str,
    worker_id: str,
    actor_name: str,
    engine_config: EngineConfig,
    redis_url: str | None,
    num_threads: int | None,
    **transfer_options: Any,
) -> WorkerParts:
    """Run in the actor's process: imports torch, loads the model, registers the KV pool."""
    from engine.engine import Engine
    from kvtransfer.nixl_transfer import NixlTransfer

    set_threads(num_threads)
    engine = Engine(engine_config)
    transfer = NixlTransfer(engine.model_id, agent_name=f"{worker_id}-nixl", **transfer_options)
    # with host leases, decode workers read a prefill worker's host tier as well
    host = engine.copies.host if engine.config.cache.host_leases else None
    transfer.register(engine.kv_cache, host)
    publisher = make_publisher(redis_url, worker_id, engine, actor_name, role, transfer.agent_name)
    return WorkerParts(engine, transfer, publisher)


def engine_load(engine: Engine) -> WorkerLoad:
    sched = engine.scheduler
    queued = sum(r.num_tokens - r.num_computed_tokens for r in sched.waiting)
    queued += sum(r.num_tokens - r.num_computed_tokens for r in sched.running)
    return WorkerLoad(
        running=len(sched.running),
        waiting=len(sched.waiting) + len(engine.loader.loading),
        free_blocks=engine.kv.num_free_blocks,
        total_blocks=engine.kv.num_blocks,
        queued_tokens=queued,
        prefill_tok_s=round(engine.stats.rate.tokens_per_s),
        step_us=round(engine.stats.rate.step_s * 1e6),
    )


def cache_counters(engine: Engine) -> dict[str, int]:
    """The WorkerStats counters of the prefix cache beyond whole device blocks, and of
    speculative decoding."""
    kv = engine.kv
    return {
        "num_partial_reused_tokens": kv.num_partial_reused_tokens,
        "num_host_offloaded_blocks": 0 if kv.host_tier is None else kv.host_tier.num_stored,
        "num_host_hit_blocks": kv.num_host_hit_blocks,
        "num_spec_verify_steps": engine.speculator.num_verify_steps,
        "num_spec_drafted_tokens": engine.speculator.num_drafted_tokens,
        "num_spec_accepted_tokens": engine.speculator.num_accepted_tokens,
    }


def served_model(engine: Engine) -> ServedModel:
    return ServedModel(
        model_id=engine.model_id,
        checkpoint_dir=str(engine.checkpoint_dir),
        max_model_len=engine.max_model_len,
        vocab_size=engine.model_config.vocab_size,
        block_size=engine.kv.block_size,
    )


def describe(engine: Engine, worker_id: str, role: str) -> WorkerDescription:
    import os

    import ray

    return WorkerDescription(
        worker_id=worker_id,
        role=role,
        node_ip=ray.util.get_node_ip_address(),
        node_id=ray.get_runtime_context().get_node_id(),
        pid=os.getpid(),
        model=served_model(engine),
    )


def set_threads(num_threads: int | None) -> None:
    if num_threads:
        import torch

        torch.set_num_threads(num_threads)


class IndexUpkeep:
    """A worker's upkeep of its Redis index entries, on its engine thread. Owns the KV events
    not yet written and when the next write is due.

    Each tick takes the pool's new KV events; they are written in order, at most once per
    `publish_interval_s` (0: at every tick that has any), and their write refreshes the worker's
    load and TTL. A heartbeat goes out when nothing was written for `heartbeat_s`. Without
    Redis the events are dropped."""

    def __init__(
        self,
        publisher: KVPublisher | None,
        engine: Engine,
        heartbeat_s: float,
        publish_interval_s: float = 0.0,
    ) -> None:
        self.publisher = publisher
        self.engine = engine
        self.heartbeat_s = heartbeat_s
        self.publish_interval_s = publish_interval_s
        self._pending: list[Any] = []
        self._last_write = float("-inf")

    def tick(self, now: float) -> None:
        events = self.engine.kv.drain_events()
        if self.publisher is None:
            return
        self._pending += events
        if self._pending and now - self._last_write >= self.publish_interval_s:
            self.publisher.publish(self._pending, engine_load(self.engine))
            self._pending, self._last_write = [], now
        elif now - self._last_write >= self.heartbeat_s:
            self.publisher.heartbeat(engine_load(self.engine))
            self._last_write = now


def make_publisher(
    redis_url: str | None,
    worker_id: str,
    engine: Engine,
    actor_name: str,
    role: str,
    agent_name: str,
) -> KVPublisher | None:
    """The worker's Redis publisher, or None when the cluster runs without Redis."""
    if not redis_url:
        return None
    host = engine.kv.host_tier
    return KVPublisher(
        redis_url,
        engine.model_id,
        worker_id,
        role,
        # A worker that records no KV events publishes no blocks, not a snapshot gone stale.
        cached_hashes=engine.kv.pool.cached_hashes if engine.kv.pool.record_events else tuple,
        host_hashes=host.cached_hashes if host is not None and host.record_events else tuple,
        actor_name=actor_name,
        nixl_agent=agent_name,
    )


def shut_down(
    lifecycle: WorkerLifecycle, thread: Any, publisher: KVPublisher | None, transfer: Any
) -> None:
    """Once per worker: stop taking requests, stop its engine thread, withdraw it from the index
    (its HASH, block entries and registration: gone for every router at once), close its NIXL
    agent. A drained worker, which stopped taking requests already, is withdrawn the same."""
    if lifecycle.stopped:
        return
    lifecycle.closed = lifecycle.stopped = True
    thread.stop()
    if publisher is not None:
        publisher.withdraw()
        publisher.close()
    transfer.close()


class WorkerLifecycle:
    """A worker's state as routers see it in Redis (set by the controller), and what it saw of
    user traffic. Invariant: `ready_at` is the worker's own clock at the moment its state went
    ready, so a user request recorded before it (`first_request_at`) shows a placement too early.
    Engine-thread only, except the read-only properties."""

    def __init__(self, worker_id: str, publisher: KVPublisher | None):
        self.worker_id = worker_id
        self.publisher = publisher
        self.state = WorkerState.JOINING
        self.ready_at: float | None = None
        self.first_request_at: float | None = None
        self.num_requests = 0
        self.closed = False  # takes no more requests (retired by a drain, or shut down)
        self.stopped = False  # shut down: engine stopped, withdrawn from the index

    def set_state(self, state: WorkerState, engine: Engine) -> float:
        """Switch state and publish it at once (routers read it on their next placement)."""
        self.state = WorkerState(state)
        now = time.time()
        if self.state == WorkerState.READY and self.ready_at is None:
            self.ready_at = now
        if self.publisher is not None:
            self.publisher.state = self.state.value
            self.publisher.heartbeat(engine_load(engine))
        return now

    def admit(self, req_id: str) -> None:
        """A request arrives: refuse it once closed; count it unless it is a warm-up."""
        if self.closed:
            raise WorkerUnavailable(f"worker {self.worker_id} has stopped taking requests")
        if req_id.startswith(WARMUP_REQ_PREFIX):
            return
        self.num_requests += 1
        if self.first_request_at is None:
            self.first_request_at = time.time()

    def retire(self, num_in_flight: int, leak_check: Callable[[], LeakCheck]) -> LeakCheck | None:
        """Drain's last step: None while work is in flight; else stop taking requests (a late
        one gets WorkerUnavailable, the router places it elsewhere) and return the accounts."""
        if num_in_flight:
            return None
        self.closed = True
        return leak_check()

    def is_user_request(self, req_id: str) -> bool:
        return not req_id.startswith(WARMUP_REQ_PREFIX)
