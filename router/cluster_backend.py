"""ClusterBackend: places each request on a prefill worker (KV-aware, from the Redis index) and a
decode worker, runs each leg of it (prefill, handoff, decode) and migrates it when its decode
worker dies.

Owns the legs' cleanup and the forgetting of dead workers; the streams and long-polls live in
its DecodeStreams, the placement accounting in its WorkerSet, the stopping state in its
ServingGate.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import sys
import time
import uuid
from collections.abc import AsyncIterator, Coroutine
from dataclasses import replace
from typing import Any, cast

from ray.exceptions import RayActorError

from common.cluster_state import WorkerStats, WorkerUnavailable
from common.messages import GenerateRequest, KVHandle, TokenDelta, WorkerInfo
from common.placement_rules import SloTargets
from common.worker_actors import DecodeActor, PrefillActor, WorkerActor
from common.worker_stats import gather_stats
from engine.finish_reason import FinishReason
from engine.kv_cache.hashing import hash_blocks
from router.aggregated import AGGREGATED
from router.backend import Backend
from router.choice_migration import as_choice, continuation, resume_choices
from router.decode_streams import DecodeStreams, Stream
from router.leg import Leg, LegStage
from router.metrics import RouterMetrics
from router.placement import Placer, uncached
from router.policy import (
    LocalPrefill,
    NoWorkerAvailable,
    Placement,
    PrefillPolicy,
    make_prefill_policy,
)
from router.prefix_index import PrefixIndex
from router.readiness import empty_pools
from router.serving_gate import UNAVAILABLE, ClusterUnavailable, ServingGate, StreamsEnded
from router.slo import LocalRoute
from router.worker_set import WorkerSet

logger = logging.getLogger(__name__)
# a decode worker that computes the prompt itself: it, its actor, and the prompt tokens placed
# on it (counted in its load until the first token)
Local = tuple[WorkerInfo, DecodeActor, int]
MAX_PLACEMENTS = 3  # workers tried per request when one has stopped taking work (drained, died)
# A request whose decode worker died waits this long for another to take it over (the last one
# died: the controller's replacement starts, ~10-20 s on a CPU, a model load and warm-up on a GPU)
MIGRATION_WAIT_S = 60.0
MIGRATION_RETRY_S = 0.5
REDIS_CHECK_S = 2.0  # health() asks Redis itself when its last check is older than this
REDIS_CHECK_TIMEOUT_S = 0.5  # and waits this long at most (a probe must answer quickly)


class _DecodeLost(Exception):
    """A leg's decode worker died: the request continues elsewhere (or fails past its budget)."""


class ClusterBackend(Backend):
    def __init__(
        self,
        model_id: str,
        max_model_len: int,
        vocab_size: int,
        block_size: int,
        workers: WorkerSet,
        index: PrefixIndex | None = None,
        policy: PrefillPolicy | None = None,
        router_id: str | None = None,
        max_migrations: int = 2,
        local_prefill: LocalPrefill | None = None,
        slo: SloTargets | None = None,
    ):
        self.model_id = model_id
        self.max_migrations = max_migrations
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.workers = workers
        self.index = index
        self.placer = Placer(
            block_size,
            workers,
            index,
            policy or make_prefill_policy("kv_aware"),
            local_prefill,
            slo,
        )
        self.router_id = router_id or f"router-{uuid.uuid4().hex[:8]}"
        self.streams = DecodeStreams(self.router_id, self.lost_worker, workers.state_of)
        self._forgetting: dict[str, asyncio.Task[None]] = {}
        self.last_placements: dict[str, str] = {}  # req_id -> prefill worker (for tests/logs)
        self.num_migrations = 0  # decode legs resumed on another worker (for tests/metrics)
        self.num_index_drifts = 0  # prefills that reused less than the index promised
        self.num_local_prefills = 0  # legs whose prompt a decode worker computed itself
        self._background: set[asyncio.Task[None]] = set()
        self._redis_checked = 0.0  # time.monotonic() of health()'s last question to Redis
        self._metrics: RouterMetrics | None = None
        self.membership: Any = None  # router.membership.MembershipSync, closed with the backend
        self.gate = ServingGate()  # refuses new requests / ends open ones when the router stops

    @property
    def metrics(self) -> RouterMetrics | None:
        """Set by the server that owns the registry (the placer records into it too)."""
        return self._metrics

    @metrics.setter
    def metrics(self, metrics: RouterMetrics | None) -> None:
        self._metrics = self.placer.metrics = metrics

    def objectives(self, model: str) -> SloTargets:
        return self.placer.slo

    @property
    def policy(self) -> PrefillPolicy:
        return self.placer.policy

    @policy.setter
    def policy(self, policy: PrefillPolicy) -> None:
        self.placer.policy = policy

    @property
    def num_index_unavailable(self) -> int:
        return self.placer.num_index_unavailable

    # ---- streaming -----------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        """The request's deltas. When its decode worker dies, the request is migrated: its
        prompt plus every token already sent is prefilled again (mostly a prefix-cache hit) and
        decoded on another worker, and the stream goes on with the next token. An n > 1 request
        resumes each unfinished choice as a request of its own (router/choice_migration.py).

        Refused with ClusterUnavailable (a 503) while the gate refuses, or when no worker can
        take it before anything was sent; once the gate ends the streams, each open choice ends
        at once with the gate's finish_reason."""
        self.gate.check()
        async with contextlib.aclosing(self._migrating(request, request.req_id)) as deltas:
            async for delta in deltas:
                yield delta

    async def _migrating(
        self, request: GenerateRequest, first_req_id: str
    ) -> AsyncIterator[TokenDelta]:
        """generate's stream of `request`: the client's own, or one choice of an n > 1 request
        resumed after its decode worker died (first_req_id is then the request's id as the
        router took it: the leg was admitted already). A leg whose decode worker died is
        resumed on another; when no worker can take it (the last one died), it waits up to
        MIGRATION_WAIT_S for one (the controller's replacement) unless the cluster is refusing,
        then ends with an error delta marked unavailable (the client may retry: HTTP 503 /
        UNAVAILABLE)."""
        resumed = request.req_id != first_req_id
        sent: dict[int, list[int]] = {i: [] for i in range(request.sampling.n)}  # by choice
        done: set[int] = set()
        leg = request
        num_yielded = 0
        num_migrations = 0
        lost: _DecodeLost | None = None  # the last leg's worker death, until the next leg runs
        waiting_since: float | None = None  # for a worker to take the migrated leg
        while True:
            try:
                async with contextlib.aclosing(self._leg(leg, first_req_id)) as deltas:
                    async for delta in deltas:
                        if lost is not None:  # the migrated leg runs: it counts now
                            self._observe_migration()
                            lost = None
                        sent[delta.index].extend(delta.token_ids)
                        if delta.finished:
                            done.add(delta.index)
                        if num_migrations:  # prompt counts are the first leg's
                            delta = as_choice(delta, request.req_id, delta.index)
                        num_yielded += 1
                        yield delta
                return
            except StreamsEnded as ended:
                end = ended.end
                for index in sorted(set(sent) - done):
                    yield TokenDelta(
                        request.req_id, (), True, end.finish_reason, error=end.reason, index=index
                    )
                    if end.finish_reason == FinishReason.ERROR:  # it ends the whole request
                        return
                return
            except (NoWorkerAvailable, WorkerUnavailable, RayActorError) as e:
                migrated = lost is not None or resumed
                if migrated and not isinstance(e, RayActorError) and self.gate.refusal is None:
                    waiting_since = waiting_since or time.monotonic()
                    if time.monotonic() - waiting_since < MIGRATION_WAIT_S:
                        await asyncio.sleep(MIGRATION_RETRY_S)  # a worker may join meanwhile
                        continue
                if num_yielded or resumed:  # the stream is open: it ends with an error
                    why = f"{e}" if lost is None else f"{lost}; no decode worker took it over"
                    if waiting_since is not None:
                        why += f" within {MIGRATION_WAIT_S:g} s"
                    yield TokenDelta(
                        request.req_id, (), True, FinishReason.ERROR, error=why, unavailable=True
                    )
                    return
                raise self._unavailable(request.req_id, e) from None
            except _DecodeLost as died:
                if request.sampling.n > 1:
                    open_choices = {i: t for i, t in sent.items() if i not in done}
                    self._log_migration(request, died, f"{len(open_choices)} open choices")
                    self._observe_migration()
                    resume = functools.partial(self._migrating, first_req_id=first_req_id)
                    async for delta in resume_choices(resume, request, open_choices):
                        yield delta
                    return
                if num_migrations == self.max_migrations:
                    error = f"{died}; not migrated again ({self.max_migrations} migrations)"
                    yield TokenDelta(
                        request.req_id, (), True, FinishReason.ERROR, error=error, unavailable=True
                    )
                    return
                if len(sent[0]) >= request.sampling.max_tokens:  # every token was out already
                    yield TokenDelta(request.req_id, (), True, FinishReason.LENGTH)
                    return
                num_migrations += 1
                leg = _continuation(request, sent[0], num_migrations)
                lost, waiting_since = died, None
                self._log_migration(request, died, f"{len(sent[0])} tokens sent")

    def _log_migration(self, request: GenerateRequest, lost: Exception, what: str) -> None:
        logger.warning("request %s: %s; migrating it with %s", request.req_id, lost, what)

    def _observe_migration(self) -> None:
        """A request resumed on another decode worker (counted once its new leg runs)."""
        self.num_migrations += 1
        if self.metrics is not None:
            self.metrics.observe_migration()

    async def _leg(self, request: GenerateRequest, first_req_id: str) -> AsyncIterator[TokenDelta]:
        """One prefill and one decode of `request` (both on one decode worker when the
        LocalPrefill rule picks one); raises _DecodeLost when the decode worker dies (after its
        cleanup: the prefill lease released, nothing left on either side). It ends after one
        finished delta per choice (n > 1), or an error or abort delta. Where it stands, and
        what its workers are owed when it ends, is its Leg (router/leg.py)."""
        req_id = request.req_id
        leg = Leg(req_id)
        queue: asyncio.Queue[TokenDelta] = asyncio.Queue()
        num_open = request.sampling.n  # choices not finished yet
        try:
            # The prompt's block hashes, once per leg: both placements look them up.
            hashes = hash_blocks(
                request.prompt_token_ids, self.block_size, self.model_id, request.cache_salt
            )
            # A migrated leg was admitted already: it is placed whatever the objectives say.
            routed = await self.placer.route(request, hashes, admitted=req_id != first_req_id)
            here = None
            if isinstance(routed, LocalRoute):
                here = await self._prefill_on_decode(request, routed, queue, first_req_id)
                if here is None and routed.placement.reason == AGGREGATED:  # another one
                    tried = frozenset({routed.placement.worker.worker_id})
                    here = await self._aggregated(request, hashes, queue, first_req_id, tried)
            if here is not None:
                leg.decoding(*here)
            else:
                excluded: frozenset[str] = frozenset()
                remote = None if isinstance(routed, LocalRoute) else routed
                while True:  # a worker that stopped taking work (drained, died) is left out
                    if remote is not None:  # the routed placement, then others if it fails
                        placement, num_uncached = remote[0].placement, remote[1]
                        remote = None
                    else:
                        try:
                            placement, num_uncached = await self.placer.place_prefill(
                                request, hashes, excluded
                            )
                        except NoWorkerAvailable:  # the prefill pool emptied: aggregated
                            here = await self._aggregated(request, hashes, queue, first_req_id)
                            break
                    prefill = placement.worker
                    self.last_placements[req_id] = prefill.worker_id
                    try:
                        # found by the placer; set first: a cancelled prefill is aborted there
                        leg.prefill_actor = cast(PrefillActor, self._actor_of(prefill))
                        call = leg.prefill_actor.prefill.remote(request)
                        handle = await self.gate.unless_ended(call)
                        received = time.monotonic()
                        break
                    except (RayActorError, WorkerUnavailable) as e:
                        leg.prefill_actor = None
                        if isinstance(e, RayActorError):
                            self.lost_worker(prefill.worker_id)
                        excluded |= {prefill.worker_id}
                        if len(excluded) >= MAX_PLACEMENTS:
                            raise
                        logger.info("request %s: %s; placing it again", req_id, e)
                    finally:
                        self.workers.done(prefill.worker_id, num_uncached)
                if here is not None:  # computed on a decode worker after all
                    leg.decoding(*here)
                else:
                    leg.prefilled(handle)
                    self._check_index(request, placement, handle, leg.prefill_actor)
                    self._observe_prefill("remote")
                    firsts = handle.first_deltas()
                    num_open -= sum(delta.finished for delta in firsts)
                    if leg.stage is LegStage.DONE:  # every choice ended on its first token
                        for delta in firsts:
                            yield delta
                        return
                    leg.decoding(
                        *await self._hand_over(request, handle, queue, first_req_id, received)
                    )
                    for delta in firsts:
                        yield delta
            while True:
                delta = await queue.get()
                if leg.prompt_tokens and leg.decode is not None:  # its first token: computed
                    self.workers.computed(leg.decode.worker_id, leg.take_prompt_tokens())
                if delta.finish_reason == FinishReason.ABORT and self.gate.ended is not None:
                    raise StreamsEnded(self.gate.ended)  # end_streams() put it there
                if delta.transfer is not None and self.metrics is not None:
                    self.metrics.observe_transfer(delta.transfer)
                if delta.finish_reason == FinishReason.ERROR:
                    leg.decode_failed()  # a prefill lease may be unread: it is released
                    stream = self.streams.get(req_id)
                    if (stream is not None and stream.lost) or delta.resumable:
                        error = f"decode worker {leg.decode.worker_id} died"
                        raise _DecodeLost(delta.error or error)
                elif delta.finished and num_open == 1 and delta.finish_reason != FinishReason.ABORT:
                    leg.move(LegStage.DONE)  # an abort delta is local: the decode side needs it
                yield delta
                num_open -= delta.finished
                if num_open == 0 or delta.finish_reason in (FinishReason.ABORT, FinishReason.ERROR):
                    return
        finally:
            self.streams.close(req_id)
            self.last_placements.pop(req_id, None)
            if leg.decode is not None:
                self.workers.done(leg.decode.worker_id, leg.take_prompt_tokens())
            cleanup = leg.cleanup_call()
            left = isinstance(sys.exc_info()[1], asyncio.CancelledError | GeneratorExit)
            if cleanup is not None and left:  # the client left: the call goes on behind, so
                self._behind(_quietly(cleanup))  # the stream unwinds at once (its id is free)
            elif cleanup is not None:
                await _quietly(cleanup)

    async def _prefill_on_decode(
        self,
        request: GenerateRequest,
        routed: LocalRoute,
        queue: asyncio.Queue[TokenDelta],
        first_req_id: str,
    ) -> Local | None:
        """Conditional prefill: submit the whole request to the decode worker the placer chose
        (placed there until the stream ends, its prompt tokens until its first token) and return
        it; None: the prefill pool takes the prompt after all (that worker is gone or stopped
        taking work)."""
        decode = routed.placement.worker
        num_uncached = uncached(request, routed.placement)
        try:
            actor = cast(DecodeActor, self._actor_of(decode))
            self._open_stream(request.req_id, Stream(queue, decode.worker_id, first_req_id))
            self.streams.ensure_poller(decode.worker_id, actor)
            await actor.prefill_here.remote(request, self.router_id)
        except BaseException as e:
            self.streams.close(request.req_id)
            self.workers.done(decode.worker_id, num_uncached)
            _drain(queue)
            if isinstance(e, asyncio.CancelledError):  # the worker may have taken it already
                self._behind(_quietly(actor.abort.remote(request.req_id)))
            if not isinstance(e, RayActorError | WorkerUnavailable):
                raise
            if isinstance(e, RayActorError):
                self.lost_worker(decode.worker_id)
            logger.info("request %s: %s; placing its prompt again", request.req_id, e)
            return None
        self.num_local_prefills += 1
        self._observe_prefill(f"local_{routed.placement.reason}")
        return decode, actor, num_uncached

    async def _aggregated(
        self,
        request: GenerateRequest,
        hashes: list[int],
        queue: asyncio.Queue[TokenDelta],
        first_req_id: str,
        excluded: frozenset[str] = frozenset(),
    ) -> Local:
        """No prefill worker takes the prompt: a decode worker computes it (router/aggregated.py),
        one that stopped taking work left out for another; NoWorkerAvailable when none is left."""
        while len(excluded) < MAX_PLACEMENTS:
            routed = await self.placer.place_aggregated(request, hashes, excluded)
            here = await self._prefill_on_decode(request, routed, queue, first_req_id)
            if here is not None:
                return here
            excluded |= {routed.placement.worker.worker_id}
        raise NoWorkerAvailable(f"{len(excluded)} decode workers stopped taking work")

    def _observe_prefill(self, where: str) -> None:
        if self.metrics is not None:
            self.metrics.observe_prefill(where)

    def _check_index(
        self,
        request: GenerateRequest,
        placement: Placement,
        handle: KVHandle,
        actor: PrefillActor,
    ) -> None:
        """The index promised `placement.num_cached_tokens`; the worker reused fewer: its index
        entries have drifted (a lost event, a write that never landed). Count it and have the
        worker re-publish its full state."""
        num_prompt = len(request.prompt_token_ids)
        reusable = (num_prompt - 1) // self.block_size * self.block_size  # the engine's cap
        missing = min(placement.num_cached_tokens, reusable) - handle.num_cached_tokens
        if missing <= 0:
            return
        self.num_index_drifts += 1
        if self.metrics is not None:
            self.metrics.observe_index_drift(missing)
        logger.warning(
            "index drift: %s holds %d fewer prompt tokens than the index said; it re-publishes",
            placement.worker.worker_id,
            missing,
        )
        self._behind(_quietly(actor.resync_index.remote()))

    def _behind(self, call: Coroutine[Any, Any, None]) -> None:
        """Run a cleanup or upkeep call behind the request (kept until it ends)."""
        task = asyncio.create_task(call)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _hand_over(
        self,
        request: GenerateRequest,
        handle: KVHandle,
        queue: asyncio.Queue[TokenDelta],
        first_req_id: str,
        received: float,
    ) -> tuple[WorkerInfo, DecodeActor]:
        """Place the prefilled request on a decode worker and submit it (counted as placed
        there until the stream ends); a worker that stopped taking work is left for another."""
        excluded: frozenset[str] = frozenset()
        while True:
            decode = await self.placer.place_decode(request, excluded)
            try:
                actor = cast(DecodeActor, self._actor_of(decode))
                self._open_stream(request.req_id, Stream(queue, decode.worker_id, first_req_id))
                self.streams.ensure_poller(decode.worker_id, actor)
                # What is left of the lease: the decode worker reckons its deadline from when
                # it gets the handle, so the time spent here must not count twice.
                left = max(0.0, handle.lease_s - (time.monotonic() - received))
                await actor.submit.remote(request, replace(handle, lease_s=left), self.router_id)
                return decode, actor
            except (RayActorError, WorkerUnavailable) as e:
                self.streams.close(request.req_id)
                self.workers.done(decode.worker_id)
                if isinstance(e, RayActorError):
                    self.lost_worker(decode.worker_id)
                _drain(queue)  # the dead worker's notice (its poller may see it first) is stale
                excluded |= {decode.worker_id}
                if len(excluded) >= MAX_PLACEMENTS:
                    raise
                logger.info(
                    "request %s: %s; handing it to another decode worker", request.req_id, e
                )

    def _open_stream(self, req_id: str, stream: Stream) -> None:
        """Register a leg's stream; one opened after the streams were ended ends at once."""
        self.streams.open(req_id, stream)
        if self.gate.ended is not None:
            stream.queue.put_nowait(TokenDelta(req_id, (), True, FinishReason.ABORT))

    def _actor_of(self, worker: WorkerInfo) -> WorkerActor:
        try:
            return self.workers.actor(worker)
        except ValueError as e:  # died since the view was read
            raise WorkerUnavailable(str(e)) from e

    def decode_worker_of(self, req_id: str) -> str | None:
        """The decode worker streaming a request (None before its handoff or after its end)."""
        stream = self.streams.of_request(req_id)
        return None if stream is None else stream.decode_worker_id

    def lost_worker(self, worker_id: str) -> None:
        """A worker's actor died: it leaves placement and the index at once, and only the
        streams it was serving end, each with an error naming it."""
        self.workers.mark_dead(worker_id)
        self.streams.lost(worker_id)
        if self.index is not None and worker_id not in self._forgetting:
            task = asyncio.create_task(self._forget(worker_id))
            self._forgetting[worker_id] = task

    async def _forget(self, worker_id: str) -> None:
        try:
            await self.index.forget_worker(worker_id, force=True)  # type: ignore[union-attr]
        except Exception as e:  # Redis down: its TTL removes it later
            logger.info("could not remove dead worker %s from the index: %s", worker_id, e)
        finally:
            self._forgetting.pop(worker_id, None)

    async def abort(self, req_id: str) -> None:
        stream = self.streams.of_request(req_id)
        if stream is not None:
            stream.queue.put_nowait(TokenDelta(req_id, (), True, FinishReason.ABORT))

    # ---- stopping ------------------------------------------------------------------------
    def stop_taking(self, reason: str) -> None:
        """Refuse new requests from now on (503 naming `reason`); open ones go on."""
        self.gate.refuse(reason)

    def end_streams(self, reason: str, finish_reason: FinishReason = FinishReason.ABORT) -> int:
        """End every open request now: each open choice gets a last delta with
        `finish_reason` (ABORT: shut down; ERROR: the cluster was lost) and the workers are
        told to drop it. Returns how many streams were open."""
        self.gate.end(reason, finish_reason)
        return self.streams.abort_all()

    def lose_cluster(self, reason: str) -> None:
        """The Ray cluster behind this router is gone: no worker counts as ready any more, new
        requests get 503 naming `reason`, open ones end with an error."""
        for role in ("prefill", "decode"):
            for worker_id in self.workers.actors(role):
                self.workers.mark_dead(worker_id)
        self.gate.refuse(reason, UNAVAILABLE)
        self.end_streams(reason, FinishReason.ERROR)

    def _unavailable(self, req_id: str, error: Exception) -> ClusterUnavailable:
        """A request no worker could take, before anything was sent: a 503 saying why, logged
        in one line (it is the cluster's state, not a fault of this request)."""
        why = self.gate.refusal or empty_pools(self._health_details())
        message = f"no worker can take the request now: {why or error}"
        logger.info("request %s refused: %s", req_id, message)
        return self.gate.unavailable(message)

    async def health(self) -> dict[str, object]:
        """Whether a request can be served now, with each pool's ready workers and Redis's
        state: asked of Redis itself when the last check is older than REDIS_CHECK_S (the
        routing calls' outcome alone said "ok" for a while after Redis died)."""
        await self.check_redis()
        details = self._health_details()
        if self.gate.refusal is not None:
            return {"ok": False, "reason": self.gate.refusal, **details}
        # No prefill worker: the decode workers compute every prompt (router/aggregated.py).
        return {"ok": bool(details["decode_workers"]), **details}

    async def check_redis(self) -> None:
        """Ask Redis itself when the last check is older than REDIS_CHECK_S, and set
        kvrelay_prefix_index_available from the answer (placements alone set it: an idle router
        showed 1 through an outage, and 0 after it)."""
        if self.index is None:
            return
        if time.monotonic() - self._redis_checked > REDIS_CHECK_S:
            self._redis_checked = time.monotonic()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.index.probe(), REDIS_CHECK_TIMEOUT_S)
        if self.metrics is not None:
            self.metrics.set_index_available(self.index.available)

    def _health_details(self) -> dict[str, object]:
        index_ok = self.index is None or self.index.available
        return {
            "prefill_workers": len(self.workers.known("prefill")),
            "decode_workers": len(self.workers.known("decode")),
            "redis": "absent" if self.index is None else ("ok" if index_ok else "unavailable"),
        }

    async def refresh_metrics(self) -> None:
        """Ask every known worker for its stats (2 s each, in parallel) for the handoff series;
        a worker that does not answer has none this scrape; Redis's state asked (check_redis)."""
        if self.metrics is None:
            return
        await self.check_redis()
        answered = await self.worker_stats()
        for worker_id, (role, stats) in answered.items():
            self.metrics.worker_stats.update(worker_id, role, stats)
        self.metrics.worker_stats.keep_only(set(answered))

    async def worker_stats(self) -> dict[str, tuple[str, WorkerStats]]:
        """Worker id -> (role, stats) of the known workers that answered (2 s each)."""
        role_of, actors = {}, {}
        for role in ("prefill", "decode"):
            for worker_id, actor in self.workers.actors(role).items():
                role_of[worker_id], actors[worker_id] = role, actor
        answered = await gather_stats(actors)
        return {worker_id: (role_of[worker_id], stats) for worker_id, stats in answered.items()}

    async def close(self) -> None:
        if self.membership is not None:
            await self.membership.close()
        self.streams.stop()


def _continuation(request: GenerateRequest, sent: list[int], num: int) -> GenerateRequest:
    """The leg that resumes an n = 1 `request` after `sent` tokens, its `num`-th migration."""
    return continuation(request, sent, f"{request.req_id}@m{num}")


def _drain(queue: asyncio.Queue[TokenDelta]) -> None:
    while not queue.empty():
        queue.get_nowait()


async def _quietly(ref: Any) -> None:
    try:
        await ref
    except Exception as e:
        logger.info("cleanup call failed: %s", e)
