"""PrefillWorker (Ray actor, on common/worker_runtime.py's WorkerBase: engine, NIXL agent, index
upkeep, life cycle): owns its KVHolder (kvtransfer/kv_holder.py: the leases over the engine's
kept blocks) and the prefill() calls waiting for their first tokens. The role is how it uses
the engine: each prompt runs with keep_blocks (it ends after its first token, its blocks kept),
and prefill() returns a KVHandle naming a lease on them; the blocks stay kept until the decode
worker's READ completes (its DONE notice releases the lease), release(req_id, epoch) is called,
or the lease expires on this worker's monotonic clock (a BEGIN notice from the reader extends it
while the read may be in flight). An abort that finds nothing is remembered a while
(common/early_aborts.py): Ray may run it before the prefill call it was meant for.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from common import tracing
from common.cluster_state import LeakCheck, PrefillStats, WorkerStats
from common.early_aborts import EarlyAborts
from common.messages import FirstToken, GenerateRequest, KVHandle
from common.worker_runtime import WorkerBase
from engine.config import EngineConfig
from engine.step.request import FinishReason
from kvtransfer.base import AgentMetadata
from kvtransfer.handshake import PROTOCOL_VERSION
from kvtransfer.kv_holder import KVHolder
from kvtransfer.leases import LeaseState
from prefill_worker.traces import PrefillTraces

if TYPE_CHECKING:  # the actor's process imports these; the driver that creates it need not
    from engine.engine import Engine
    from engine.step.step_types import EngineSnapshot, RequestOutput

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillWorkerConfig:
    worker_id: str
    engine: EngineConfig
    redis_url: str | None = None
    lease_s: float = 30.0
    heartbeat_s: float = 1.0
    num_threads: int | None = None
    otlp_endpoint: str | None = None  # traces go there (common/tracing.py); None: off


@dataclass
class _Waiter:
    """A prefill() call waiting for its request's first tokens (n > 1: one output per choice,
    collected until all n are in)."""

    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    num_choices: int
    outputs: list[RequestOutput] = field(default_factory=list)


class PrefillWorker(WorkerBase):
    role = "prefill"
    stats_type = PrefillStats

    def __init__(self, config: PrefillWorkerConfig, actor_name: str = ""):
        self.config = config
        super().__init__(
            config.worker_id,
            actor_name,
            replace(config.engine, record_kv_events=True),
            config.redis_url,
            config.num_threads,
            config.heartbeat_s,
            otlp_endpoint=config.otlp_endpoint,
        )

    def _build_role(self) -> None:
        self.holder = KVHolder(self.engine.release_blocks, self.config.lease_s)
        self.traces = PrefillTraces(self.worker_id) if tracing.enabled() else None
        self._waiters: dict[str, _Waiter] = {}
        self._early_aborts = EarlyAborts(self.config.lease_s)
        self.num_prompt_tokens = 0  # of user prefills handed over (for the prefix-hit rate)
        self.num_cached_tokens = 0

    # ---- actor API -----------------------------------------------------------------------
    async def prefill(self, request: GenerateRequest) -> KVHandle:
        self.lifecycle.check_open()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[KVHandle] = loop.create_future()

        def add(engine: Engine) -> bool:
            if self._early_aborts.take(request.req_id, time.monotonic()):
                return False  # its abort ran first (Ray orders an async actor's calls freely)
            self.lifecycle.admit(request.req_id)
            added = engine.add_request(
                request.req_id,
                request.prompt_token_ids,
                request.sampling,
                request.cache_salt,
                keep_blocks=True,
                num_resumed_tokens=request.num_resumed_tokens,
                kv_retention=request.kv_retention,
                priority=request.priority,
            )
            self._waiters[request.req_id] = _Waiter(loop, future, request.sampling.n)
            if self.traces is not None:
                self.traces.begin(request, added)
            return True

        try:  # cancelled even while add waits its turn: add runs anyway, then the abort
            if await self.thread.call(add):
                return await future
        except asyncio.CancelledError:  # by abort() (it found the request) or by Ray
            await self._abort(request.req_id, remember=False)
            raise
        logger.info("request %s was aborted before its prefill call came", request.req_id)
        raise asyncio.CancelledError(f"request {request.req_id} was aborted")  # as if while it ran

    async def release(self, req_id: str, epoch: int) -> bool:
        """Drop the lease on a request's blocks (the decode side has them, or gave up) if
        `epoch` names it; a stale one (the lease ended, or req_id was leased again since) is
        ignored and counted. True when it freed the blocks."""
        return await self.thread.call(lambda engine: self.holder.release(req_id, epoch))

    async def abort(self, req_id: str) -> None:
        """Stop a prefill, or end its lease unless a read of it is in flight (that read's
        notice or the lease's expiry ends it). One that finds nothing is remembered: its
        prefill call may come after it, and then computes nothing."""
        await self._abort(req_id, remember=True)

    async def _abort(self, req_id: str, remember: bool) -> None:
        def run(engine: Engine) -> None:
            known = engine.abort(req_id) or self.holder.leases.lease(req_id) is not None
            self.holder.abort(req_id)
            if self.traces is not None:
                self.traces.abort(req_id)
            waiter = self._waiters.pop(req_id, None)
            if waiter:
                waiter.loop.call_soon_threadsafe(_cancel, waiter.future)
            elif remember and not known:
                self._early_aborts.add(req_id, time.monotonic())

        await self.thread.call(run)

    def metadata(self) -> AgentMetadata:
        return self.transfer.metadata()

    async def num_leases(self) -> int:
        return await self.thread.call(lambda engine: engine.snapshot().num_kept_requests)

    # ---- WorkerBase's hooks (engine thread) ----------------------------------------------
    def _num_in_flight(self, snapshot: EngineSnapshot) -> int:
        return snapshot.num_requests + len(self._waiters) + self.holder.num_live

    def _leak_check(self, engine: Engine, snapshot: EngineSnapshot) -> LeakCheck:
        kept = engine.kept_block_ids()
        self.holder.check_integrity(kept)
        return LeakCheck(
            num_free_blocks=snapshot.num_free_blocks,
            num_total_blocks=snapshot.num_total_blocks,
            num_held_blocks=len(kept),
            num_requests=snapshot.num_requests,
            num_stranded_blocks=self.holder.num_stranded(kept),
        )

    def _role_stats(self, common: WorkerStats) -> WorkerStats:
        leases = self.holder.leases
        return replace(
            common,
            num_prompt_tokens=self.num_prompt_tokens,
            num_cached_tokens=self.num_cached_tokens,
            num_host_leased_blocks=self.holder.num_host_leased_blocks,
            num_blocks_held=leases.num_blocks(LeaseState.HELD),
            num_blocks_being_read=leases.num_blocks(LeaseState.BEING_READ),
            num_expired_leases=leases.num_expired,
            num_stale_releases=leases.num_stale,
            num_stranded_blocks=leases.num_stranded(self.engine.kept_block_ids()),
            handoff_transitions=tuple((t.name, t.count) for t in leases.transitions()),
        )

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
            if self.traces is not None:
                self.traces.handed(handle)

    def _on_failed(self, req_ids: list[str], error: str) -> None:
        for req_id in req_ids:
            if self.traces is not None:
                self.traces.abort(req_id)
            waiter = self._waiters.pop(req_id, None)
            if waiter is not None:
                waiter.loop.call_soon_threadsafe(_fail, waiter.future, StepFailed(error))

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
        if self.traces is not None:
            self.traces.tick()
        now = time.monotonic()
        for notif in self.transfer.get_notifs():  # before expiry: a BEGIN that came is honoured
            self.holder.on_notification(notif, now)
        self.holder.expire(now)
        return False


def _finish_of(out: RequestOutput) -> FinishReason | None:
    """None when the first token ended nothing (decode goes on), else why the request ended."""
    return None if out.finish_reason is FinishReason.FIRST_TOKEN else out.finish_reason


def _settle(future: asyncio.Future, value: object) -> None:
    if not future.done():
        future.set_result(value)


class StepFailed(RuntimeError):
    """The engine's step that computed the request's prompt raised (its blocks are freed)."""


def _fail(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)


def _cancel(future: asyncio.Future) -> None:
    if not future.done():
        future.cancel()
