"""FaultRun: one fault bench's phases against an embedded cluster. A phase waits for the
cluster to be whole (pools settled, every block free), runs a steady load, injects one fault
in the middle, drains the load with a bound on each request, waits for the controller to
replace what died and for every live worker's blocks to be free, and sums it up. Owns the
loads of the phase running; the cluster, its router and the references are given.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.lib.cluster_watch import (
    joined_since,
    left_since,
    router_knows_all,
    settle,
    wait_all_free,
    worker_pids,
)
from bench.lib.steady_load import BackendClient, LoadClient, RequestRecord, SteadyLoad
from bench.lib.stranded_watch import StrandedWatch

logger = logging.getLogger(__name__)
SETTLE_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Reference:
    """The undisturbed engine's greedy output for one prompt."""

    token_ids: tuple[int, ...]
    text: str


@dataclass(frozen=True)
class Fault:
    key: str
    title: str
    inject: Callable[[FaultRun], Awaitable[dict[str, Any]]]  # returns what it did


@dataclass(frozen=True)
class FaultSettings:
    rate: float  # requests per second of the steady load
    pre_s: float  # steady load before the injection
    post_s: float  # and after it
    hang_bound_s: float  # a request not ended this long after its start has hung
    free_timeout_s: float  # for every block to be free after the load drained


class FaultRun:
    def __init__(
        self,
        cluster: Any,
        http_base: str,
        prompts: Sequence[Sequence[int]],
        references: Sequence[Reference],
        params: Any,
        settings: FaultSettings,
        log_dir: Path,
    ):
        self.cluster = cluster
        self.http_base = http_base  # the in-process router's HTTP server
        self.prompts = [tuple(p) for p in prompts]
        self.references = list(references)
        self.params = params
        self.settings = settings
        self.log_dir = log_dir
        self.loads: list[SteadyLoad] = []
        self._runners: list[asyncio.Task[None]] = []
        self._at_end: list[Callable[[], Awaitable[None]]] = []
        self._prefix = ""

    @property
    def backend(self) -> Any:
        return self.cluster.backend

    @property
    def model(self) -> str:
        return self.cluster.model.model_id

    # ---- what injections use ---------------------------------------------------------------
    def add_load(self, client: LoadClient, rate: float, tag: str) -> SteadyLoad:
        load = SteadyLoad(client, len(self.prompts), rate, f"{self._prefix}{tag}-")
        self.loads.append(load)
        self._runners.append(asyncio.create_task(load.run()))
        return load

    def on_end(self, cleanup: Callable[[], Awaitable[None]]) -> None:
        """Run `cleanup()` once the phase's load has drained (before the checks)."""
        self._at_end.append(cleanup)

    def in_flight(self) -> list[RequestRecord]:
        return [r for load in self.loads for r in load.in_flight()]

    async def pids(self, role: str) -> dict[str, int]:
        pids = await worker_pids(self.cluster.controller)
        known = self.cluster.prefill_actors if role == "prefill" else self.cluster.decode_actors
        return {w: pid for w, pid in pids.items() if w in known}

    async def until(self, condition: Callable[[], Any], what: str, bound_s: float = 60.0) -> Any:
        """Poll `condition` until it returns something true (returned); raises after bound_s."""
        deadline = time.monotonic() + bound_s
        while not (found := condition()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"never happened: {what}")
            await asyncio.sleep(0.01)
        return found

    # ---- one phase -------------------------------------------------------------------------
    async def whole(self) -> None:
        await settle(self.cluster.controller, SETTLE_TIMEOUT_S)
        await router_knows_all(self.cluster, 30.0)
        await wait_all_free(self.cluster, self.settings.free_timeout_s)

    async def phase(self, fault: Fault) -> dict[str, Any]:
        settings = self.settings
        await self.whole()
        self._prefix = f"{fault.key}-"
        started = time.time()
        migrations = self.backend.num_migrations
        counters = await self._decode_counters()
        stranded = StrandedWatch(self.cluster)
        stranded.start()
        self.add_load(BackendClient(self.backend, self.prompts, self.params), settings.rate, "b")
        try:
            await asyncio.sleep(settings.pre_s)
            try:
                detail = await fault.inject(self)
            except Exception as e:  # recorded: the phase still drains and is checked
                logger.exception("injection %s failed", fault.key)
                detail = {"injection_error": f"{type(e).__name__}: {e}"}
            await asyncio.sleep(settings.post_s)
            records, num_hung = await self._drain()
        finally:
            for cleanup in self._at_end:
                await cleanup()
        summary = self._summary(fault, records, num_hung)
        summary["migrated"] = self.backend.num_migrations - migrations
        summary["migrated"] += detail.get("migrated_by_router_process", 0)
        watched = [r for r in records if r.req_id in set(detail.get("watched", ()))]
        detail["watched_completed_exact"] = sum(r.completed and self._exact(r) for r in watched)
        detail["watched_failed"] = sum(r.failed for r in watched)
        await settle(self.cluster.controller, SETTLE_TIMEOUT_S)
        await router_knows_all(self.cluster, 30.0)
        accounts, seconds = await wait_all_free(self.cluster, settings.free_timeout_s)
        await stranded.stop()
        status = await self.cluster.controller.status.remote(with_stats=False)
        after = await self._decode_counters()
        summary.update(
            injection=detail,
            duration_s=round(time.time() - started, 1),
            workers_checked=len(accounts),
            blocks_in_use=sum(a.num_total_blocks - a.num_free_blocks for a in accounts.values()),
            blocks_held=sum(a.num_held_blocks for a in accounts.values()),
            stranded_max=max(
                [stranded.max_stranded, *(a.num_stranded_blocks for a in accounts.values())]
            ),
            stranded_samples=stranded.num_samples,
            requests_left_on_workers=sum(a.num_requests for a in accounts.values()),
            all_free_after_s=round(seconds, 1),
            workers_left=left_since(status, started),
            workers_joined=joined_since(status, started),
            **_counted(counters, after),
        )
        self.loads, self._runners, self._at_end = [], [], []
        return summary

    async def _drain(self) -> tuple[list[RequestRecord], int]:
        for load in self.loads:
            load.stop()
        await asyncio.gather(*self._runners)
        hung = await asyncio.gather(
            *(load.drain(self.settings.hang_bound_s) for load in self.loads)
        )
        return [r for load in self.loads for r in load.records], sum(len(h) for h in hung)

    async def _decode_counters(self) -> dict[str, tuple[int, int]]:
        """Decode worker id -> (prompts recomputed, orphans aborted), for the live ones."""
        actors = self.cluster.decode_actors
        stats = await asyncio.gather(
            *(a.stats.remote() for a in actors.values()), return_exceptions=True
        )
        return {
            worker_id: (s.num_recomputed, s.num_orphans_aborted)
            for worker_id, s in zip(actors, stats, strict=True)
            if not isinstance(s, BaseException)
        }

    def _summary(self, fault: Fault, records: list[RequestRecord], num_hung: int) -> dict:
        completed = [r for r in records if r.completed]
        failed = [r for r in records if r.failed]
        exact = [r for r in completed if self._exact(r)]
        return {
            "fault": fault.key,
            "title": fault.title,
            "requests": len(records),
            "completed": len(completed),
            "exact": len(exact),
            "not_exact": [r.req_id for r in completed if not self._exact(r)],
            "failed": len(failed),
            "failed_with_a_wrong_token": [r.req_id for r in failed if not self._prefix_ok(r)],
            "errors": dict(Counter(_short(r.error or r.finish_reason or "?") for r in failed)),
            "hung": num_hung,
        }

    def _exact(self, record: RequestRecord) -> bool:
        reference = self.references[record.index]
        if record.token_ids:
            return tuple(record.token_ids) == reference.token_ids
        return record.text == reference.text

    def _prefix_ok(self, record: RequestRecord) -> bool:
        """What a failed request did output is the start of the reference (no wrong token)."""
        reference = self.references[record.index]
        n = len(record.token_ids)
        return tuple(record.token_ids) == reference.token_ids[:n] and reference.text.startswith(
            record.text
        )


def _counted(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> dict:
    """What the decode workers alive at the end counted during the phase (a worker killed in
    it took its counts along)."""
    deltas = [
        (now[0] - before.get(w, (0, 0))[0], now[1] - before.get(w, (0, 0))[1])
        for w, now in after.items()
    ]
    return {
        "recomputed": sum(d[0] for d in deltas),
        "orphans_aborted": sum(d[1] for d in deltas),
    }


def _short(error: str, limit: int = 160) -> str:
    return error if len(error) <= limit else error[: limit - 3] + "..."
