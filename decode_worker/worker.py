"""DecodeWorker (Ray actor, on common/worker_runtime.py's WorkerBase: engine, NIXL agent, index
upkeep, life cycle): owns its KVPuller, the per-router mailboxes and each request's Route (which
router it answers to).

submit() hands a prefilled request to the KVPuller (admission, NIXL read, recompute fallback);
the engine thread steps the puller and the engine and pushes one batch of deltas per step to
each router's mailbox. This class only wires Ray to those parts.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import ray

from common import tracing
from common.cluster_state import DecodeStats, LeakCheck, WorkerStats
from common.early_aborts import EarlyAborts
from common.index_upkeep import worker_load
from common.messages import GenerateRequest, KVHandle, TokenDelta, TransferStats, WorkerLoad
from common.worker_runtime import WorkerBase
from decode_worker.kv_puller import KVPuller
from decode_worker.mailbox import Mailboxes
from decode_worker.traces import DecodeTraces
from engine.config import EngineConfig
from engine.finish_reason import FinishReason
from kvtransfer.pulls import PullState

if TYPE_CHECKING:  # the actor's process imports these; the driver that creates it need not
    from engine.engine import Engine
    from engine.step.step_types import EngineSnapshot, RequestOutput

logger = logging.getLogger(__name__)
ORPHAN_CHECK_S = 1.0  # how often the engine thread looks for routers that stopped polling
CACHE_PUBLISH_S = 0.1  # its prefix cache's KV events go to Redis at most this often
# An abort that found nothing waits this long for its submit (a later one's KV lease is gone).
EARLY_ABORT_S = 60.0
ROUTER_RETENTION_S = 300.0  # a router silent this long is gone: its unread deltas are dropped


@dataclass(frozen=True)
class DecodeWorkerConfig:
    worker_id: str
    engine: EngineConfig
    redis_url: str | None = None
    transfer_timeout_s: float = 10.0
    heartbeat_s: float = 1.0
    num_threads: int | None = None
    router_timeout_s: float = 10.0  # a router silent this long is dead: abort its requests
    publish_cache: bool = (
        False  # its prefix cache to the index (the cluster runs conditional prefill)
    )
    otlp_endpoint: str | None = None  # traces go there (common/tracing.py); None: off


@dataclass
class Route:
    """Where one request's tokens go: its router; whether its prompt was computed here
    (conditional prefill: its cached part is then this worker's to report); how its KV arrived,
    until its first delta carries that."""

    router_id: str
    prefilled_here: bool = False
    transfer: TransferStats | None = None
    counted: bool = False  # prefilled here: its prompt is in the local prompt counts


class DecodeWorker(WorkerBase):
    role = "decode"
    stats_type = DecodeStats

    def __init__(self, config: DecodeWorkerConfig, actor_name: str = ""):
        self.config = config
        super().__init__(
            config.worker_id,
            actor_name,
            # Its prefix cache goes to the index when conditional prefill reads it.
            replace(
                config.engine, record_kv_events=bool(config.redis_url and config.publish_cache)
            ),
            config.redis_url,
            config.num_threads,
            config.heartbeat_s,
            # Its prefix cache, when published, goes in batches: a Redis round trip per decode
            # step would cost the decodes their pace.
            publish_interval_s=CACHE_PUBLISH_S,
            otlp_endpoint=config.otlp_endpoint,
            timeout_s=config.transfer_timeout_s,
        )

    def _build_role(self) -> None:
        self.traces = DecodeTraces(self.worker_id) if tracing.enabled() else None
        self.puller = KVPuller(self.engine, self.transfer, _release_lease)
        self.mailboxes = Mailboxes()
        self._routes: dict[str, Route] = {}  # req_id -> where its tokens go
        self._next_orphan_check = 0.0
        self.num_orphans_aborted = 0  # requests of routers that stopped polling
        self._early_aborts = EarlyAborts(EARLY_ABORT_S)
        self.num_local_prefills = 0  # prompts computed here (conditional prefill, aggregated)
        self.num_local_prompt_tokens = 0  # their prompt tokens, and those of them cached
        self.num_local_cached_tokens = 0

    # ---- actor API -----------------------------------------------------------------------
    async def submit(self, request: GenerateRequest, handle: KVHandle, router_id: str) -> None:
        """Queue a prefilled request; its tokens arrive through next_deltas(router_id)."""
        received_at = time.monotonic()  # the pull's deadline counts from here, on our clock
        self.lifecycle.check_open()
        meta = None
        if not self.puller.knows_peer(handle.actor_name):
            try:
                meta = await ray.get_actor(handle.actor_name).metadata.remote()
            except Exception as e:  # the prefill worker is gone: the puller recomputes
                logger.warning("no metadata from %s (%s); will recompute", handle.actor_name, e)

        def run(engine: Engine) -> None:
            if meta is not None:
                self.puller.add_peer_metadata(handle.actor_name, meta)
            if self._early_aborts.take(request.req_id, time.monotonic()):
                logger.info("request %s was aborted before it was submitted", request.req_id)
                self.puller.release_lease(handle)  # its router has ended its stream: no delta
                return
            if request.req_id in self._routes:  # another stream owns that id here: keep it
                error = f"request id {request.req_id!r} is already in use on {self.worker_id}"
                delta = TokenDelta(request.req_id, (), True, FinishReason.ERROR, error=error)
                self.mailboxes.push(router_id, [delta])
                _release_lease(handle)
                return
            self.lifecycle.admit(request.req_id)
            self.mailboxes.expect(router_id)
            self._routes[request.req_id] = Route(router_id)
            self.puller.submit(request, handle, received_at)
            if self.traces is not None:
                self.traces.submitted(request, handle, received_at)

        await self.thread.call(run)

    async def prefill_here(self, request: GenerateRequest, router_id: str) -> None:
        """Conditional prefill: compute the prompt here instead of pulling its KV, then decode
        it; its tokens arrive through next_deltas(router_id). The scheduler runs decodes first
        and spends only what is left of its token budget on the prompt, chunk by chunk, so the
        running decodes keep their pace. Raises InvalidField for a request it cannot take."""
        self.lifecycle.check_open()

        def run(engine: Engine) -> None:
            if self._early_aborts.take(request.req_id, time.monotonic()):
                logger.info("request %s was aborted before its prompt came", request.req_id)
                return  # its router cancelled this call and ended its stream
            if request.req_id in self._routes:
                raise ValueError(f"request id {request.req_id!r} is already in use here")
            self.lifecycle.admit(request.req_id)
            engine.add_request(
                request.req_id,
                request.prompt_token_ids,
                request.sampling,
                request.cache_salt,
                num_resumed_tokens=request.num_resumed_tokens,
                kv_retention=request.kv_retention,
                priority=request.priority,
            )
            self.mailboxes.expect(router_id)
            self._routes[request.req_id] = Route(router_id, prefilled_here=True)
            self.num_local_prefills += 1
            if self.traces is not None:
                self.traces.prefilled_here(request)

        await self.thread.call(run)

    async def next_deltas(self, router_id: str, timeout_s: float = 1.0) -> list[TokenDelta]:
        return await self.mailboxes.take(router_id, timeout_s)

    async def abort(self, req_id: str) -> None:
        """End a request here. One this worker does not know is remembered a while
        (common/early_aborts.py): Ray may run it before the submit it was meant for."""

        def run(engine: Engine) -> None:
            if req_id not in self._routes:
                self._early_aborts.add(req_id, time.monotonic())
            self._abort(engine, req_id)

        await self.thread.call(run)

    async def check_peer(self, prefill_actor_name: str) -> None:
        """Handshake with a prefill worker now (protocol version, model, dtype, block layout):
        raises IncompatiblePeerError on a mismatch instead of failing its first pull later."""
        meta = await ray.get_actor(prefill_actor_name).metadata.remote()
        await self.thread.call(lambda engine: self.puller.connect(prefill_actor_name, meta))

    # ---- WorkerBase's hooks (engine thread) ----------------------------------------------
    def _load(self, snapshot: EngineSnapshot) -> WorkerLoad:
        """The engine's load, its waiting with the prefilled requests queued for KV room here
        (in the puller, not yet in the engine; once reserved the engine counts them)."""
        load = worker_load(snapshot)
        return replace(load, waiting=load.waiting + self.puller.num_queued)

    def _num_in_flight(self, snapshot: EngineSnapshot) -> int:
        puller = self.puller
        return len(self._routes) + snapshot.num_requests + puller.num_pulls + int(puller.busy)

    def _leak_check(self, engine: Engine, snapshot: EngineSnapshot) -> LeakCheck:
        self.puller.check_integrity()
        in_flight = snapshot.num_requests + self.puller.num_pulls + self.transfer.num_open_handles
        return LeakCheck(
            num_free_blocks=snapshot.num_free_blocks,
            num_total_blocks=snapshot.num_total_blocks,
            num_requests=in_flight,
            num_stranded_blocks=self.puller.num_stranded_blocks(),
        )

    def _role_stats(self, common: WorkerStats) -> WorkerStats:
        puller = self.puller
        return replace(
            common,
            num_transferred_blocks=puller.num_transferred_blocks,
            num_host_read_blocks=puller.num_host_read_blocks,
            num_transferred_bytes=puller.num_transferred_blocks * puller.block_bytes,
            transfer_seconds=puller.transfer_seconds,
            num_recomputed=puller.num_recomputed,
            num_orphans_aborted=self.num_orphans_aborted,
            num_local_prefills=self.num_local_prefills,
            num_local_prompt_tokens=self.num_local_prompt_tokens,
            num_local_cached_tokens=self.num_local_cached_tokens,
            num_blocks_reserved=puller.ledger.num_blocks(PullState.RESERVED),
            num_blocks_reading=puller.ledger.num_blocks(PullState.READING),
            num_refused_handshakes=puller.num_refused_handshakes,
            num_stranded_blocks=puller.num_stranded_blocks(),
            handoff_transitions=tuple((t.name, t.count) for t in puller.ledger.transitions()),
        )

    # ---- engine thread -------------------------------------------------------------------
    def _abort(self, engine: Engine, req_id: str) -> None:
        self.puller.abort(req_id)
        engine.abort(req_id)
        self._routes.pop(req_id, None)
        if self.traces is not None:
            self.traces.abort(req_id)

    def _end_with_error(self, req_ids: list[str], error: str, resumable: bool = False) -> None:
        """Abort these requests here (blocks freed) and end each router's streams of them with
        the error (resumable: the router may resume them elsewhere)."""
        by_router: dict[str, list[TokenDelta]] = {}
        for req_id in req_ids:
            route = self._routes.get(req_id)
            self._abort(self.engine, req_id)
            if route is not None:
                delta = TokenDelta(
                    req_id, (), True, FinishReason.ERROR, error=error, resumable=resumable
                )
                by_router.setdefault(route.router_id, []).append(delta)
        for router_id, deltas in by_router.items():
            self.mailboxes.push(router_id, deltas)

    def _on_failed(self, req_ids: list[str], error: str) -> None:
        self._end_with_error(req_ids, error)

    def _on_tick(self) -> bool:
        ended = self.puller.step()
        if self.traces is not None:
            self.traces.puller_step(ended)
        for refused in ended.refused:
            route = self._routes.pop(refused.req_id, None)
            if route is not None:
                delta = TokenDelta(
                    refused.req_id, (), True, FinishReason.ERROR, error=refused.error
                )
                self.mailboxes.push(route.router_id, [delta])
        for arrival in ended.arrived:
            route = self._routes.get(arrival.req_id)
            if route is not None:
                route.transfer = arrival.transfer
        now = time.time()
        if now >= self._next_orphan_check:
            self._abort_orphans()
            self._next_orphan_check = now + ORPHAN_CHECK_S
        return self.puller.busy

    def _abort_orphans(self) -> None:
        """The requests of a router that stopped long-polling (dead, or stalled) are aborted and
        their blocks freed. Each ends with a resumable error in the router's box: a router that
        was only stalled reads it, with the tokens before it, and resumes the request elsewhere."""
        silent = self.mailboxes.silent_routers(self.config.router_timeout_s, ORPHAN_CHECK_S)
        timeout_s = self.config.router_timeout_s
        for router_id in silent:
            orphans = [req_id for req_id, r in self._routes.items() if r.router_id == router_id]
            error = f"decode worker {self.config.worker_id} aborted it: its router did not poll"
            error += f" for {timeout_s:.0f} s"
            self._end_with_error(orphans, error, resumable=True)
            self.num_orphans_aborted += len(orphans)
            if orphans:
                logger.warning(
                    "router %s stopped polling for %.0f s: aborted its %d requests",
                    router_id,
                    self.config.router_timeout_s,
                    len(orphans),
                )
        self.mailboxes.forget_silent(ROUTER_RETENTION_S)

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        if self.traces is not None:  # first: the first_step event marks the step's end
            step_s = self.engine.stats.last_step_s
            self.traces.on_outputs(outputs, self.engine.is_unfinished, step_s)
        by_router: dict[str, list[TokenDelta]] = {}
        for out in outputs:
            route = self._routes.get(out.req_id)
            if route is None:
                continue
            transfer, route.transfer = route.transfer, None  # once: with its first delta
            # The prompt's cached part is the prefill worker's to report, unless it ran here.
            here = route.prefilled_here
            if here and not route.counted:  # its prompt, once (n > 1: one for every choice)
                route.counted = True
                self.num_local_prompt_tokens += out.num_prompt_tokens
                self.num_local_cached_tokens += out.num_cached_tokens
            by_router.setdefault(route.router_id, []).append(
                TokenDelta(
                    out.req_id,
                    tuple(out.new_token_ids),
                    finished=out.finished,
                    finish_reason=out.finish_reason,
                    num_prompt_tokens=out.num_prompt_tokens,
                    num_cached_tokens=out.num_cached_tokens if here else 0,
                    logprobs=tuple(out.new_logprobs or ()),
                    top_logprobs=tuple(out.new_top_logprobs or ()),
                    transfer=transfer,
                    index=out.index,
                    num_accepted_tokens=out.num_accepted_tokens,
                )
            )
        # A request ends with its last choice (n > 1: its other choices may end in this step).
        for req_id in {out.req_id for out in outputs if out.finished}:
            if not self.engine.is_unfinished(req_id):
                self._routes.pop(req_id, None)
        for router_id, deltas in by_router.items():
            self.mailboxes.push(router_id, deltas)


def _release_lease(handle: KVHandle) -> None:
    """Tell the prefill worker to drop this grant of its lease (fire and forget; expiry is the
    backstop; the epoch keeps a late call from freeing a later grant)."""
    try:
        ray.get_actor(handle.actor_name).release.remote(handle.req_id, handle.epoch)
    except Exception as e:
        logger.info("could not reach %s to release %s: %s", handle.actor_name, handle.req_id, e)
