"""PrefillWorker (Ray actor): owns an Engine in prefill role, its NIXL agent, its KVHolder
(kvtransfer/kv_holder.py: the leases over the engine's kept blocks) and its KV publisher. The
role is how it uses the engine: each prompt runs with keep_blocks (it ends after its first
token, its blocks kept), and prefill() returns a KVHandle naming a lease on them; the blocks stay
kept until the decode worker's READ completes (its DONE notice releases the lease),
release(req_id, epoch) is called, or the lease expires on this worker's monotonic clock (a BEGIN
notice from the reader extends it while the read may be in flight).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from common.cluster_state import (
    LeakCheck,
    WorkerDescription,
    WorkerState,
    WorkerStats,
    WorkerUnavailable,
)
from common.messages import FirstToken, GenerateRequest, KVHandle, ServedModel, WorkerLoad
from common.worker_runtime import (
    IndexUpkeep,
    WorkerLifecycle,
    build_worker_parts,
    cache_counters,
    describe,
    engine_load,
    served_model,
    shut_down,
)
from engine.config import EngineConfig
from engine.request import FinishReason
from kvtransfer.base import AgentMetadata
from kvtransfer.handshake import PROTOCOL_VERSION
from kvtransfer.kv_holder import KVHolder
from kvtransfer.leases import LeaseState

if TYPE_CHECKING:  # the actor's process imports these; the driver that creates it need not
    from engine.engine import Engine
    from engine.step_types import RequestOutput

logger = logging.getLogger(__name__)
FIRST_TOKEN = FinishReason.FIRST_TOKEN.value  # the first token ended nothing: decode goes on
RESYNC_MIN_INTERVAL_S = 5.0


@dataclass(frozen=True)
class PrefillWorkerConfig:
    worker_id: str
    engine: EngineConfig
    redis_url: str | None = None
    lease_s: float = 30.0
    heartbeat_s: float = 1.0
    num_threads: int | None = None


@dataclass
class _Waiter:
    """A prefill() call waiting for its request's first tokens (n > 1: one output per choice,
    collected until all n are in)."""

    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    num_choices: int
    outputs: list[RequestOutput] = field(default_factory=list)


class PrefillWorker:
    def __init__(self, config: PrefillWorkerConfig, actor_name: str = ""):
        from engine.engine_thread import EngineThread

        self.config = config
        self.worker_id = config.worker_id
        self.actor_name = actor_name or config.worker_id
        self.engine, self.transfer, self.publisher = build_worker_parts(
            "prefill",
            self.worker_id,
            self.actor_name,
            replace(config.engine, record_kv_events=True),
            config.redis_url,
            config.num_threads,
        )
        self.holder = KVHolder(self.engine.release_blocks, config.lease_s)
        self._waiters: dict[str, _Waiter] = {}
        self.index_upkeep = IndexUpkeep(self.publisher, self.engine, config.heartbeat_s)
        self._next_resync = 0.0  # time.monotonic() before which a drift resync is skipped
        self.num_prompt_tokens = 0  # of user prefills handed over (for the prefix-hit rate)
        self.num_cached_tokens = 0
        self.lifecycle = WorkerLifecycle(self.worker_id, self.publisher)
        self.thread = EngineThread(self.engine, self._on_outputs, self._on_tick)

    # ---- actor API -----------------------------------------------------------------------
    async def prefill(self, request: GenerateRequest) -> KVHandle:
        if self.lifecycle.closed:
            raise WorkerUnavailable(f"prefill worker {self.worker_id} has shut down")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[KVHandle] = loop.create_future()

        def add(engine: Engine) -> None:
            self.lifecycle.admit(request.req_id)
            engine.add_request(
                request.req_id,
                request.prompt_token_ids,
                request.sampling,
                request.cache_salt,
                keep_blocks=True,
                num_resumed_tokens=request.num_resumed_tokens,
                kv_retention=request.kv_retention,
            )
            self._waiters[request.req_id] = _Waiter(loop, future, request.sampling.n)

        await self.thread.call(add)
        try:
            return await future
        except asyncio.CancelledError:
            await self.abort(request.req_id)
            raise

    async def release(self, req_id: str, epoch: int) -> bool:
        """Drop the lease on a request's blocks (the decode side has them, or gave up) if
        `epoch` names it; a stale one (the lease ended, or req_id was leased again since) is
        ignored and counted. True when it freed the blocks."""
        return await self.thread.call(lambda engine: self.holder.release(req_id, epoch))

    async def abort(self, req_id: str) -> None:
        """Stop a prefill, or end its lease unless a read of it is in flight (that read's
        notice or the lease's expiry ends it)."""

        def run(engine: Engine) -> None:
            engine.abort(req_id)
            self.holder.abort(req_id)
            waiter = self._waiters.pop(req_id, None)
            if waiter:
                waiter.loop.call_soon_threadsafe(_cancel, waiter.future)

        await self.thread.call(run)

    def metadata(self) -> AgentMetadata:
        return self.transfer.metadata()

    async def load(self) -> WorkerLoad:
        return await self.thread.call(engine_load)

    def pid(self) -> int:
        """The actor's process id (the embedded cluster makes sure it exits on close)."""
        return os.getpid()

    def served_model(self) -> ServedModel:
        return served_model(self.engine)

    def describe(self) -> WorkerDescription:
        """Answered once the model is loaded and the KV pool registered with NIXL."""
        return describe(self.engine, self.worker_id, "prefill")

    async def num_leases(self) -> int:
        return await self.thread.call(lambda engine: len(engine.kv.kept))

    async def resync_index(self) -> bool:
        """A router saw this worker's index entries drift: re-publish the full state (at most
        once per RESYNC_MIN_INTERVAL_S, however many routers ask). True if one was queued."""

        def run(engine: Engine) -> bool:
            now = time.monotonic()
            if self.publisher is None or now < self._next_resync:
                return False
            self._next_resync = now + RESYNC_MIN_INTERVAL_S
            self.publisher.mark_dirty()
            self.publisher.heartbeat(engine_load(engine))
            return True

        return await self.thread.call(run)

    async def set_state(self, state: WorkerState) -> float:
        """The controller moves the worker (joining -> ready -> draining); returns when."""
        return await self.thread.call(lambda engine: self.lifecycle.set_state(state, engine))

    async def stats(self) -> WorkerStats:
        def run(engine: Engine) -> WorkerStats:
            life, leases = self.lifecycle, self.holder.leases
            return WorkerStats(
                state=life.state,
                load=engine_load(engine),
                num_requests=life.num_requests,
                num_prompt_tokens=self.num_prompt_tokens,
                num_host_leased_blocks=self.holder.num_host_leased_blocks,
                num_cached_tokens=self.num_cached_tokens,
                num_computed_tokens=engine.stats.num_computed_tokens,
                num_in_flight=self._num_in_flight(engine),
                first_request_at=life.first_request_at,
                ready_at=life.ready_at,
                num_blocks_held=leases.num_blocks(LeaseState.HELD),
                num_blocks_being_read=leases.num_blocks(LeaseState.BEING_READ),
                num_expired_leases=leases.num_expired,
                num_stale_releases=leases.num_stale,
                num_stranded_blocks=leases.num_stranded(engine.kv.kept.block_ids()),
                handoff_transitions=tuple((t.name, t.count) for t in leases.transitions()),
                **cache_counters(engine),
            )

        return await self.thread.call(run)

    async def retire(self) -> LeakCheck | None:
        """Drain's last step (WorkerLifecycle.retire) on the engine thread."""

        def run(engine: Engine) -> LeakCheck | None:
            check = functools.partial(self._leak_check, engine)
            return self.lifecycle.retire(self._num_in_flight(engine), check)

        return await self.thread.call(run)

    async def check_no_leaks(self) -> LeakCheck:
        """For tests and operators: free vs total blocks; raises if integrity is broken."""
        return await self.thread.call(self._leak_check)

    def _num_in_flight(self, engine: Engine) -> int:
        return len(engine.scheduler.requests) + len(self._waiters) + self.holder.num_live

    def _leak_check(self, engine: Engine) -> LeakCheck:
        engine.check_integrity()
        kept = engine.kv.kept.block_ids()
        self.holder.check_integrity(kept)
        return LeakCheck(
            num_free_blocks=engine.kv.num_free_blocks,
            num_total_blocks=engine.kv.num_blocks,
            num_held_blocks=len(kept),
            num_requests=len(engine.scheduler.requests),
            num_stranded_blocks=self.holder.num_stranded(kept),
        )

    def shutdown(self) -> None:
        shut_down(self.lifecycle, self.thread, self.publisher, self.transfer)

    # ---- engine thread -------------------------------------------------------------------
    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        for out in outputs:
            waiter = self._waiters.get(out.req_id)
            if waiter is None:  # aborted meanwhile: nobody reads its blocks
                self.holder.drop(out.req_id)
                continue
            waiter.outputs.append(out)
            if len(waiter.outputs) < waiter.num_choices:
                continue  # n > 1: the other choices' first tokens come in the same step
            del self._waiters[out.req_id]
            handle = self._handle(sorted(waiter.outputs, key=lambda o: o.index), now)
            waiter.loop.call_soon_threadsafe(_settle, waiter.future, handle)

    def _handle(self, outputs: list[RequestOutput], now: float) -> KVHandle:
        """The KVHandle of a request's first tokens (one per choice, in index order). The
        engine decided: "first_token" keeps the blocks for a decode worker; any other reason
        (eos, a stop token, the length) means that token ended its choice. The one lease (on
        choice 0's blocks, shared by all) is kept while any choice goes on."""
        first = outputs[0]
        choices = tuple(
            FirstToken(
                token_id=out.new_token_ids[0],
                logprob=out.new_logprobs[0] if out.new_logprobs else None,
                top_logprobs=out.new_top_logprobs[0] if out.new_top_logprobs else (),
                finish_reason=_finish_of(out),
            )
            for out in outputs
        )
        handle = KVHandle(
            req_id=first.req_id,
            worker_id=self.worker_id,
            actor_name=self.actor_name,
            agent_name=self.transfer.agent_name,
            block_ids=(),
            num_tokens=first.num_prompt_tokens,
            first_token_id=choices[0].token_id,
            protocol_version=PROTOCOL_VERSION,
            epoch=None,
            lease_s=self.config.lease_s,
            num_cached_tokens=first.num_cached_tokens,
            first_logprob=choices[0].logprob,
            finish_reason=choices[0].finish_reason,
            first_top_logprobs=choices[0].top_logprobs,
            other_choices=choices[1:],
        )
        if self.lifecycle.is_user_request(first.req_id):
            self.num_prompt_tokens += first.num_prompt_tokens
            self.num_cached_tokens += first.num_cached_tokens
        if not handle.needs_decode:
            self.holder.drop(first.req_id)
            return handle
        block_ids, num_host = first.kept_block_ids, first.num_kept_host_blocks
        epoch = self.holder.grant(first.req_id, block_ids, num_host, now).epoch
        return replace(handle, block_ids=block_ids, epoch=epoch, num_host_blocks=num_host)

    def _on_tick(self) -> bool:
        now = time.monotonic()
        for notif in self.transfer.get_notifs():  # before expiry: a BEGIN that came is honoured
            self.holder.on_notification(notif, now)
        self.holder.expire(now)
        self.index_upkeep.tick(now)
        return False


def _finish_of(out: RequestOutput) -> str | None:
    return None if out.finish_reason == FIRST_TOKEN else out.finish_reason


def _settle(future: asyncio.Future, value: object) -> None:
    if not future.done():
        future.set_result(value)


def _cancel(future: asyncio.Future) -> None:
    if not future.done():
        future.cancel()
