"""Placer: where each leg of a request goes: candidates from the Redis index (or the router's own
WorkerSet while the index is down), the route under the conditional-prefill rule and the
objectives (router/slo.py), waiting or refusing under overload, and the accounting of what it
placed (in the WorkerSet). Owns the index-health state and the counts of SLO refusals.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from common.messages import GenerateRequest, WorkerInfo
from common.placement_rules import LocalPrefill, SloTargets
from router import traces
from router.aggregated import route_aggregated
from router.errors import SloUnmet
from router.policy import (
    LocalPlacement,
    Placement,
    PrefillPolicy,
    choose_decode,
    route_by_load,
)
from router.prefix_index import IndexUnavailable, PrefixIndex
from router.slo import LocalRoute, RemoteRoute, RouteInputs, Unmet, route, within_tpot
from router.slo_waiters import SloWaiters
from router.worker_set import WorkerSet

if TYPE_CHECKING:
    from router.metrics import RouterMetrics

logger = logging.getLogger(__name__)
SLO_POLL_S = 0.02  # a request queued for the objectives looks again this often
QUEUE_WITHOUT_TTFT_S = 1.0  # how long "queue" waits when only a TPOT objective is set


def uncached(request: GenerateRequest, placement: Placement | LocalPlacement) -> int:
    """The prompt tokens a placement leaves its worker to compute (counted as placed there until
    they are: a prefill worker's answer, a decode worker's first token)."""
    return len(request.prompt_token_ids) - placement.num_cached_tokens


class Placer:
    def __init__(
        self,
        block_size: int,
        workers: WorkerSet,
        index: PrefixIndex | None,
        policy: PrefillPolicy,
        local_prefill: LocalPrefill | None = None,
        slo: SloTargets | None = None,
    ):
        self.block_size = block_size
        self.workers = workers
        self.index = index
        self.policy = policy
        self.local_prefill = local_prefill or LocalPrefill()  # off unless configured
        self.slo = slo or SloTargets()  # no objectives unless configured
        self.metrics: RouterMetrics | None = None
        self.num_index_unavailable = 0
        self.num_slo_refused = 0
        self.num_slo_queued = 0
        self.num_slo_deferred = 0  # looks that found room but left it to a higher priority
        self.waiters = SloWaiters()  # the requests queued for the objectives, by priority
        self._index_down_logged = False

    # ---- candidates ----------------------------------------------------------------------
    async def candidates(
        self, role: str, hashes: list[int], excluded: frozenset[str] = frozenset()
    ) -> tuple[list[WorkerInfo], dict[str, int] | None]:
        """Ready workers of a role and their prefix overlap; overlap None: index unavailable."""
        if self.index is not None:
            try:
                view = await self.index.view(role, hashes)
                self._record_index(True)
                if self._index_down_logged:
                    logger.warning("Redis index is back: routing by KV overlap again")
                    self._index_down_logged = False
                ready = [
                    w for w in view.workers if w.state == "ready" and w.worker_id not in excluded
                ]
                workers = self.workers.filter_known(ready)
                if workers:
                    return workers, view.overlap
            except IndexUnavailable as e:
                self._record_index(False)
                self.num_index_unavailable += 1
                if not self._index_down_logged:
                    logger.warning("Redis index unavailable (%s): routing by load alone", e)
                    self._index_down_logged = True
        return [w for w in self.workers.known(role) if w.worker_id not in excluded], None

    def _record_index(self, available: bool) -> None:
        if self.metrics is not None:
            self.metrics.set_index_available(available)

    # ---- the first placement of a leg ------------------------------------------------------
    async def route(
        self, request: GenerateRequest, hashes: list[int], admitted: bool = False
    ) -> tuple[RemoteRoute, int] | LocalRoute:
        """The leg's route, already counted as placed: (RemoteRoute, uncached tokens placed on
        the prefill worker), or a LocalRoute (placed on the decode worker). Under overload it
        waits (SloTargets.overload "queue") or raises SloUnmet; an `admitted` leg (a migrated
        request) is placed at once, whatever the objectives say; so is one with a deadline (a
        batch request: the deadline is its objective, router/traffic_class.py). Traced as
        router.route."""
        admitted = admitted or request.deadline_s is not None
        slo = replace(self.slo, overload="place") if admitted else self.slo
        started = time.monotonic()
        deadline_s = slo.ttft_ms / 1000 if slo.ttft_ms > 0 else QUEUE_WITHOUT_TTFT_S
        if slo.overload != "queue":
            deadline_s = 0.0
        queued = False
        with (
            traces.placement_span(request, "router.route") as span,
            contextlib.ExitStack() as waiting,  # while it waits: counted in self.waiters
        ):
            while True:
                inputs = await self._route_inputs(request, hashes)
                # No await from here to place(): concurrent placements see the ones before them.
                waited_s = time.monotonic() - started
                # what is left of the objective once it has waited ("shed" and "place" never
                # wait: their lookups' time is not spent of it)
                budget_s = None
                if slo.ttft_ms > 0 and slo.overload == "queue":
                    budget_s = slo.ttft_ms / 1000 - waited_s
                if inputs.prefill:
                    chosen = route(inputs, self.policy, self.local_prefill, slo, budget_s)
                else:  # no prefill worker: a decode worker computes the prompt (aggregated)
                    chosen = route_aggregated(
                        inputs, self.policy, self.local_prefill, slo, budget_s
                    )
                num_above = 0 if admitted else self.waiters.num_above(request.priority)
                if num_above and not isinstance(chosen, Unmet):  # they take the room first
                    self.num_slo_deferred += 1
                    if self.metrics is not None:
                        self.metrics.slo_deferred.inc()
                    chosen = Unmet(f"{num_above} request(s) of higher priority wait to be placed")
                if isinstance(chosen, LocalRoute):
                    placement = chosen.placement
                    self.workers.place(placement.worker.worker_id, uncached(request, placement))
                    traces.end_placement(span, chosen.placement)
                    return chosen
                if isinstance(chosen, RemoteRoute):
                    num_uncached = uncached(request, chosen.placement)
                    self.workers.place(chosen.placement.worker.worker_id, num_uncached)
                    traces.end_placement(span, chosen.placement)
                    return chosen, num_uncached
                if waited_s + SLO_POLL_S > deadline_s:
                    raise self._refuse(request, chosen, waited_s)
                if not queued:
                    queued = True
                    waiting.enter_context(self.waiters.waiting(request.priority))
                    self.num_slo_queued += 1
                    if self.metrics is not None:
                        self.metrics.slo_queued.inc()
                await asyncio.sleep(SLO_POLL_S)

    async def _route_inputs(self, request: GenerateRequest, hashes: list[int]) -> RouteInputs:
        decode: list[WorkerInfo] = []
        decode_overlap: dict[str, int] | None = {}
        both = self.local_prefill.enabled or self.slo.tpot_ms > 0
        if both or not self.workers.known("prefill"):  # both views, one round trip
            (prefill, overlap), (decode, decode_overlap) = await asyncio.gather(
                self.candidates("prefill", hashes), self.candidates("decode", hashes)
            )
            if prefill and not both:  # a prefill worker after all: decided as below
                decode, decode_overlap = [], {}
        else:
            prefill, overlap = await self.candidates("prefill", hashes)
            if not prefill:  # aggregated: the decode workers' caches decide
                decode, decode_overlap = await self.candidates("decode", hashes)
        return RouteInputs(
            self.workers.with_placed(prefill),
            overlap,
            self.workers.with_placed(decode),
            decode_overlap or {},
            self.block_size,
            len(request.prompt_token_ids),
            self.blocks_needed(request),
        )

    def _refuse(self, request: GenerateRequest, unmet: Unmet, waited_s: float) -> SloUnmet:
        self.num_slo_refused += 1
        if self.metrics is not None:
            self.metrics.slo_refused.inc()
        waited = f" after waiting {waited_s * 1000:.0f} ms" if waited_s >= SLO_POLL_S else ""
        logger.info("request %s refused%s: %s", request.req_id, waited, unmet.reason)
        return SloUnmet(f"the cluster is overloaded: {unmet.reason}; retry later")

    # ---- retries and the decode side -------------------------------------------------------
    async def place_prefill(
        self, request: GenerateRequest, hashes: list[int], excluded: frozenset[str]
    ) -> tuple[Placement, int]:
        """A prefill placement after the routed one failed (no objectives: the request is
        already admitted) and the prompt tokens it leaves to compute (placed on it)."""
        with traces.placement_span(request, "router.place_prefill", excluded) as span:
            workers, overlap = await self.candidates("prefill", hashes, excluded)
            # No await from here to place(): concurrent placements each see the ones before.
            workers = self.workers.with_placed(workers)
            if overlap is None:
                placement = route_by_load(workers)
            else:
                placement = self.policy.choose(workers, overlap, self.block_size)
            num_uncached = uncached(request, placement)
            self.workers.place(placement.worker.worker_id, num_uncached)
            traces.end_placement(span, placement)
            return placement, num_uncached

    async def place_aggregated(
        self, request: GenerateRequest, hashes: list[int], excluded: frozenset[str]
    ) -> LocalRoute:
        """A decode worker to compute the prompt itself (counted as placed there) after the
        prefill pool emptied or an aggregated placement failed: no objectives (the request is
        already admitted); raises NoWorkerAvailable when no decode worker is left."""
        with traces.placement_span(request, "router.place_aggregated", excluded) as span:
            workers, overlap = await self.candidates("decode", hashes, excluded)
            # No await from here to place(): concurrent placements each see the ones before.
            inputs = RouteInputs(
                [],
                None,
                self.workers.with_placed(workers),
                overlap or {},
                self.block_size,
                len(request.prompt_token_ids),
                self.blocks_needed(request),
            )
            chosen = route_aggregated(inputs, self.policy, self.local_prefill, SloTargets())
            assert isinstance(chosen, LocalRoute)  # no objectives: never Unmet
            placement = chosen.placement
            self.workers.place(placement.worker.worker_id, uncached(request, placement))
            traces.end_placement(span, chosen.placement)
            return chosen

    async def place_decode(self, request: GenerateRequest, excluded: frozenset[str]) -> WorkerInfo:
        """The decode worker for a prefilled request (counted as placed there): among those
        predicted within the TPOT objective when any is."""
        with traces.placement_span(request, "router.place_decode", excluded) as span:
            workers, _ = await self.candidates("decode", [], excluded)
            workers = self.workers.with_placed(workers)
            if self.slo.tpot_ms > 0:
                workers = within_tpot(workers, self.slo.tpot_ms) or workers
            decode = choose_decode(workers, self.blocks_needed(request))
            self.workers.place(decode.worker_id)
            traces.end_placement(span, decode=decode)
            return decode

    def blocks_needed(self, request: GenerateRequest) -> int:
        """KV blocks the whole request takes on a decode worker (prompt and every output)."""
        num_tokens = len(request.prompt_token_ids) + request.sampling.max_tokens
        return -(-num_tokens // self.block_size)
