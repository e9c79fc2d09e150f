"""WorkerBase: what both worker roles share, once. It owns a worker's parts (its Engine on its
EngineThread, its NIXL agent, its IndexUpkeep over its Redis publisher) and its WorkerLifecycle,
and answers the actor calls both roles answer alike: load, pid, served_model, describe,
set_state, resync_index, stats, retire, check_no_leaks, shutdown."""

from __future__ import annotations

import logging
import os
import sys
import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

from common import tracing
from common.cluster_state import (
    LeakCheck,
    RankPlace,
    WorkerDescription,
    WorkerState,
    WorkerStats,
)
from common.index_upkeep import IndexUpkeep, make_publisher, worker_load
from common.messages import ServedModel, WorkerLoad
from common.worker_lifecycle import WorkerLifecycle

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.step.step_types import EngineSnapshot, RequestOutput


RANK_CHECK_INTERVAL_S = 1.0  # a TP worker asks its follower ranks whether they run this often

log = logging.getLogger(__name__)


class WorkerBase(ABC):
    """A role (PrefillWorker, DecodeWorker) subclasses it: its __init__ calls this one, which
    builds the engine, the transfer and the index upkeep, then the role's own parts (_build_role),
    then starts serving; a failure anywhere in that stops the engine thread and shuts the engine
    down before it is raised. The role adds its own actor calls and fills the hooks below (its
    engine-thread callbacks, what it has in flight, its leak check, its stats). Everything that
    touches the engine runs on the engine thread, which built it; until it serves that thread is
    parked, so the start-up reads it from here."""

    role: ClassVar[str]  # "prefill" or "decode": published, described, in errors
    stats_type: ClassVar[type[WorkerStats]]  # the role's WorkerStats (PrefillStats, ...)

    def __init__(
        self,
        worker_id: str,
        actor_name: str,
        engine_config: EngineConfig,
        redis_url: str | None,
        num_threads: int | None,
        heartbeat_s: float,
        publish_interval_s: float = 0.0,
        otlp_endpoint: str | None = None,
        **transfer_options: Any,
    ) -> None:
        """Runs in the actor's process: imports torch, loads the model, registers the KV pool
        with a new NIXL agent; publishes `publish_interval_s` apart at most (index_upkeep.py);
        traces its requests to `otlp_endpoint` (None: tracing off, common/tracing.py)."""
        from engine.engine import Engine
        from engine.engine_thread import EngineThread
        from kvtransfer.nixl_transfer import NixlTransfer

        set_threads(num_threads)
        tracing.configure(otlp_endpoint, f"kvrelay-{self.role}", {"kvrelay.worker_id": worker_id})
        self.worker_id = worker_id
        self.actor_name = actor_name or worker_id
        start_follower = None
        if engine_config.tensor_parallel_size > 1:  # ranks 1.. in this actor's placement group
            from common.rank_actors import start_ray_follower

            start_follower = start_ray_follower
        # built on the thread that will step it (engine_thread.py); it serves once the role's
        # parts exist
        self.thread = EngineThread(lambda: Engine(engine_config, start_follower=start_follower))
        self.engine = engine = self.thread.engine
        transfer = None
        try:
            agent_name = f"{worker_id}-nixl"
            self.transfer = transfer = NixlTransfer(
                engine.model_id, agent_name=agent_name, **transfer_options
            )
            self.transfer.register(*engine.kv_memory())
            if (kv_scales := getattr(engine.runner.model, "kv_scales", None)) is not None:
                self.transfer.set_kv_scales(kv_scales)  # the handshake compares them
            if engine.followers:
                self._register_ranks(engine)
            publisher = make_publisher(
                redis_url, worker_id, engine, self.actor_name, self.role, self.transfer.agent_name
            )
            self.index_upkeep = IndexUpkeep(
                publisher,
                engine,
                heartbeat_s,
                publish_interval_s,
                lambda: self._load(engine.snapshot()),
            )
            self.lifecycle = WorkerLifecycle(worker_id, self.role)
            self._ranks_checked_at = 0.0  # when _tick last asked the TP followers whether they run
            self._build_role()
        except BaseException:  # the engine, parked before serve(), ends with the failed start
            self.thread.stop()
            if transfer is not None:  # its KV pool registered with its NIXL agent
                transfer.close()
            engine.shutdown()
            raise
        self.thread.serve(self._on_outputs, self._tick, self._on_failed)

    def _register_ranks(self, engine: Engine) -> None:
        """A TP worker's handoff layout: rank 0's heads, and every other rank's NIXL agent
        (each registered its own cache) with the heads it holds: a peer reads each head from
        the rank holding it (kvtransfer/handshake.py head_sources)."""
        import dataclasses

        import ray

        from common.rank_actors import METADATA_TIMEOUT_S, RayFollower
        from engine.parallel.tensor_parallel import rank_kv_heads

        size, heads = engine.config.tensor_parallel_size, engine.model_config.num_kv_heads
        followers = [f for f in engine.followers if isinstance(f, RayFollower)]
        metas = ray.get([f.actor.metadata.remote() for f in followers], timeout=METADATA_TIMEOUT_S)
        ranks = [
            dataclasses.replace(
                meta,
                tp_size=size,
                kv_head_start=rank_kv_heads(heads, f.rank, size).start,
                num_model_kv_heads=heads,
            )
            for f, meta in zip(followers, metas, strict=True)
        ]
        self.transfer.set_layout(size, rank_kv_heads(heads, 0, size).start, heads, ranks)

    # ---- actor API both roles share ----------------------------------------------------------
    async def load(self) -> WorkerLoad:
        return await self.thread.call(lambda engine: self._load(engine.snapshot()))

    def pid(self) -> int:
        """The actor's process id (the embedded cluster makes sure it exits on close)."""
        return os.getpid()

    def served_model(self) -> ServedModel:
        engine = self.engine
        return ServedModel(
            model_id=engine.model_id,
            checkpoint_dir=str(engine.checkpoint_dir),
            max_model_len=engine.max_model_len,
            vocab_size=engine.model_config.vocab_size,
            block_size=engine.block_size,
        )

    def describe(self) -> WorkerDescription:
        """Answered once the model is loaded and the KV pool registered with NIXL."""
        import ray

        return WorkerDescription(
            worker_id=self.worker_id,
            role=self.role,
            node_ip=ray.util.get_node_ip_address(),
            node_id=ray.get_runtime_context().get_node_id(),
            pid=os.getpid(),
            model=self.served_model(),
            ranks=self.rank_places(),
        )

    def rank_places(self) -> tuple[RankPlace, ...]:
        """Where each tensor-parallel rank runs, rank 0 (this actor) first; () at one rank."""
        from common.rank_actors import RayFollower, this_place

        followers = [f for f in self.engine.followers if isinstance(f, RayFollower)]
        if not followers:
            return ()
        return (this_place(0, self.engine.config.device), *(f.place() for f in followers))

    async def set_state(self, state: WorkerState) -> float:
        """The controller moves the worker (joining -> ready -> draining); it is published at
        once. Returns when, on this worker's clock."""

        def run(engine: Engine) -> float:
            at = self.lifecycle.set_state(state)
            self.index_upkeep.publish_state(self.lifecycle.state)
            return at

        return await self.thread.call(run)

    async def resync_index(self) -> bool:
        """A router saw this worker's index entries drift: re-publish its full state (at most
        once per RESYNC_MIN_INTERVAL_S, however many routers ask). True if one was queued."""
        return await self.thread.call(lambda engine: self.index_upkeep.resync(time.monotonic()))

    async def evict_kv(self, prompt: str | None, cache_salt: str | None) -> dict[str, int]:
        """`kvrelay kv evict` here: a prompt's blocks (tokenized by this worker's tokenizer,
        hashed under cache_salt) or every block of cache_salt, from each tier and the shared
        store; blocks dropped per tier (their removal reaches the index as KV events)."""

        def run(engine: Engine) -> dict[str, int]:
            tokens = None if prompt is None else engine.tokenize_prompt(prompt)
            return engine.evict_kv(tokens, cache_salt)

        return await self.thread.call(run)

    async def stats(self) -> WorkerStats:
        return await self.thread.call(self._stats)

    async def retire(self) -> LeakCheck | None:
        """Drain's last step: None while work is in flight; else stop taking requests (a late
        one gets WorkerUnavailable, the router places it elsewhere) and return the accounts."""
        return await self.thread.call(self._retire)

    async def check_no_leaks(self) -> LeakCheck:
        """For tests and operators: the block accounts; raises if integrity is broken."""
        return await self.thread.call(self._check_leaks)

    def shutdown(self) -> None:
        """Once per worker: stop taking requests, stop its engine thread, withdraw it from the
        index, close its NIXL agent. A drained worker (closed already) is withdrawn the same."""
        if not self.lifecycle.stop():
            return
        self.thread.stop()
        stopped = not self.thread.is_alive()  # the engine is ours again (else still its thread's)
        if stopped:  # its disk tier keeps its blocks
            self.engine.flush_disk_tier()
        else:
            log.warning(
                "worker %s: its engine thread did not stop; its KV tiers are not flushed",
                self.worker_id,
            )
        self.index_upkeep.withdraw()
        self.transfer.close()
        self.engine.shutdown(flush=stopped)  # a TP worker's followers leave their loops
        tracing.shutdown()  # its last spans leave

    # ---- the role's hooks (engine thread) ----------------------------------------------------
    def _load(self, snapshot: EngineSnapshot) -> WorkerLoad:
        """The load it reports (load(), stats(), the index): the engine's; a role adds the
        requests it holds outside the engine."""
        return worker_load(snapshot)

    @abstractmethod
    def _build_role(self) -> None:
        """The role's own parts over self.engine and self.transfer, before the engine serves."""

    @abstractmethod
    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        """What the role does with a step's outputs."""

    @abstractmethod
    def _on_failed(self, req_ids: list[str], error: str) -> None:
        """A step raised and ended these requests (their blocks freed): each is answered with
        the error."""

    @abstractmethod
    def _on_tick(self) -> bool:
        """The role's own work each engine-thread iteration; True while it has work in flight
        (the thread then polls quickly). The index upkeep runs after it."""

    @abstractmethod
    def _num_in_flight(self, snapshot: EngineSnapshot) -> int:
        """Requests, leases, pulls and routes still open, the engine's included (0: drained)."""

    @abstractmethod
    def _leak_check(self, engine: Engine, snapshot: EngineSnapshot) -> LeakCheck:
        """The role's block accounts, its handoff's integrity checked (the engine's was)."""

    @abstractmethod
    def _role_stats(self, common: WorkerStats) -> WorkerStats:
        """`common` (of stats_type, the shared figures filled in) with the role's own."""

    # ---- engine thread -----------------------------------------------------------------------
    def _tick(self) -> bool:
        if self.engine.followers and not self.lifecycle.stopped:
            now = time.monotonic()
            probe = now - self._ranks_checked_at > RANK_CHECK_INTERVAL_S
            if probe:
                self._ranks_checked_at = now  # an idle worker notices a lost rank too
            if (lost := self.engine.rank_lost(probe)) is not None:
                exit_on_rank_lost(self.worker_id, lost)
        busy = self._on_tick()
        self.index_upkeep.tick(time.monotonic())
        return busy

    def _stats(self, engine: Engine) -> WorkerStats:
        snapshot, life = engine.snapshot(), self.lifecycle
        common = self.stats_type(
            state=life.state,
            load=self._load(snapshot),
            num_requests=life.num_requests,
            num_in_flight=self._num_in_flight(snapshot),
            first_request_at=life.first_request_at,
            ready_at=life.ready_at,
            num_computed_tokens=snapshot.num_computed_tokens,
            num_preemptions=snapshot.num_preemptions,
            num_priority_preemptions=snapshot.num_priority_preemptions,
            num_partial_reused_tokens=snapshot.num_partial_reused_tokens,
            num_host_offloaded_blocks=snapshot.num_host_offloaded_blocks,
            num_host_hit_blocks=snapshot.num_host_hit_blocks,
            num_disk_stored_blocks=snapshot.num_disk_stored_blocks,
            num_disk_hit_blocks=snapshot.num_disk_hit_blocks,
            num_disk_hit_bytes=snapshot.num_disk_hit_bytes,
            num_disk_bad_files=snapshot.num_disk_bad_files,
            num_disk_write_failures=snapshot.num_disk_write_failures,
            num_disk_cached_blocks=snapshot.num_disk_cached_blocks,
            disk_load_s=snapshot.disk_load_s,
            tiers=snapshot.tiers,
            num_spec_verify_steps=snapshot.num_spec_verify_steps,
            num_spec_drafted_tokens=snapshot.num_spec_drafted_tokens,
            num_spec_accepted_tokens=snapshot.num_spec_accepted_tokens,
        )
        return self._role_stats(common)

    def _retire(self, engine: Engine) -> LeakCheck | None:
        if self._num_in_flight(engine.snapshot()):
            return None
        self.lifecycle.close()
        return self._check_leaks(engine)

    def _check_leaks(self, engine: Engine) -> LeakCheck:
        engine.check_integrity()
        return self._leak_check(engine, engine.snapshot())


def exit_on_rank_lost(worker_id: str, lost: BaseException) -> None:
    """A tensor-parallel rank is gone: this worker cannot step any more. Its process ends now
    (no request gets an answer from it): the router sees the actor dead and migrates its
    requests as for any dead worker, the controller removes its placement group (the other
    ranks with it) and starts a replacement."""
    log.error("worker %s exits: %s", worker_id, lost)
    print(f"kvrelay worker {worker_id} exits: {lost}", file=sys.stderr, flush=True)
    os._exit(1)


def set_threads(num_threads: int | None) -> None:
    if num_threads:
        import torch

        torch.set_num_threads(num_threads)
