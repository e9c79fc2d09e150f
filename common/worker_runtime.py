"""WorkerBase: what both worker roles share, once. It owns a worker's parts (its Engine on its
EngineThread, its NIXL agent, its IndexUpkeep over its Redis publisher) and its WorkerLifecycle,
and answers the actor calls both roles answer alike: load, pid, served_model, describe,
set_state, resync_index, stats, retire, check_no_leaks, shutdown."""

from __future__ import annotations

import os
import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

from common.cluster_state import LeakCheck, WorkerDescription, WorkerState, WorkerStats
from common.index_upkeep import IndexUpkeep, make_publisher, worker_load
from common.messages import ServedModel, WorkerLoad
from common.worker_lifecycle import WorkerLifecycle

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.engine_thread import EngineThread
    from engine.step.step_types import EngineSnapshot, RequestOutput


class WorkerBase(ABC):
    """A role (PrefillWorker, DecodeWorker) subclasses it: its __init__ calls this one, builds
    its own parts on the engine and transfer, then start_engine_thread(); it adds its own actor
    calls and fills the hooks below (its engine-thread callbacks, what it has in flight, its leak
    check, its stats). Everything that touches the engine runs on the engine thread."""

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
        **transfer_options: Any,
    ) -> None:
        """Runs in the actor's process: imports torch, loads the model, registers the KV pool
        with a new NIXL agent; publishes `publish_interval_s` apart at most (index_upkeep.py)."""
        from engine.engine import Engine
        from kvtransfer.nixl_transfer import NixlTransfer

        set_threads(num_threads)
        self.worker_id = worker_id
        self.actor_name = actor_name or worker_id
        self.engine = engine = Engine(engine_config)
        agent_name = f"{worker_id}-nixl"
        self.transfer = NixlTransfer(engine.model_id, agent_name=agent_name, **transfer_options)
        self.transfer.register(*engine.kv_memory())
        publisher = make_publisher(
            redis_url, worker_id, engine, self.actor_name, self.role, self.transfer.agent_name
        )
        self.index_upkeep = IndexUpkeep(publisher, engine, heartbeat_s, publish_interval_s)
        self.lifecycle = WorkerLifecycle(worker_id, self.role)
        self.thread: EngineThread  # start_engine_thread(), once the role's parts exist

    def start_engine_thread(self) -> None:
        from engine.engine_thread import EngineThread

        self.thread = EngineThread(self.engine, self._on_outputs, self._tick)

    # ---- actor API both roles share ----------------------------------------------------------
    async def load(self) -> WorkerLoad:
        return await self.thread.call(lambda engine: worker_load(engine.snapshot()))

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
        )

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
        if not self.thread.is_alive():  # the engine is ours again: its disk tier keeps its blocks
            self.engine.flush_disk_tier()
        self.index_upkeep.withdraw()
        self.transfer.close()

    # ---- the role's hooks (engine thread) ----------------------------------------------------
    @abstractmethod
    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        """What the role does with a step's outputs."""

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
        busy = self._on_tick()
        self.index_upkeep.tick(time.monotonic())
        return busy

    def _stats(self, engine: Engine) -> WorkerStats:
        snapshot, life = engine.snapshot(), self.lifecycle
        common = self.stats_type(
            state=life.state,
            load=worker_load(snapshot),
            num_requests=life.num_requests,
            num_in_flight=self._num_in_flight(snapshot),
            first_request_at=life.first_request_at,
            ready_at=life.ready_at,
            num_computed_tokens=snapshot.num_computed_tokens,
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


def set_threads(num_threads: int | None) -> None:
    if num_threads:
        import torch

        torch.set_num_threads(num_threads)
