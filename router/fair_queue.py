"""FairQueue: owns the requests one router holds back while its running bound is full (by
priority, then deficit round robin between tenants over queued tokens) and the count of its
requests running in the cluster; a request leaves it when sent on, cancelled or past its deadline.

Order: a higher priority first (GenerateRequest.priority; the key class caps it,
router/traffic_class.py). Within one priority each flow (a tenant; every caller when API keys
are off) has a deficit: a flow at the front of the round is served its next request when its
deficit covers that request's cost (prompt tokens + max_tokens * n), else it is credited its
quantum (quantum_tokens * the key's weight) and goes to the back. So two flows that both keep
the queue full are served tokens in the proportion of their weights, whatever their request
counts, and one flow's flood cannot starve another. A flow that becomes active is served before
the flows already in the round (with one quantum), as in FQ-CoDel, and before new flows already
being served (a flood that started a moment earlier is a new flow too, with a quantum of many
short requests), so a sparse tenant's request waits for no backlog. Within a flow: earliest
deadline, then arrival. So that a lower priority is never starved by a higher one's flood, after
`max_bypass` requests in a row sent from the top priority while a lower one waited, the next one
sent is the highest lower priority's (it takes the slot the top one would have had, and counts
as one of the top priority's while it runs).

The running bound is per priority: a request waits only while max_running requests of its
priority or higher run, and while 2 x max_running run in all. Lower ones never hold it back
before that: had a batch flood's long requests filled the bound, an interactive request would
wait for one of them to end (on an H100, 600 batch requests of 200 tokens behind a bound of 64
held interactive TTFT p50 at ~1.1 s with priorities or without); sent on, the workers put it
ahead of them and preempt them when they need the room (engine/step/scheduler.py). The overall
cap keeps clients that climb the priorities one level at a time from multiplying the bound.

Bounded: at most max_queued requests wait (one more: Overloaded, as the router's own bound).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import math
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge

from common.cluster_state import ClassQueue
from common.messages import GenerateRequest
from router.errors import Overloaded
from router.traffic_class import DEFAULT_CLASS, KeyClass, TrafficClass

DEFAULT_QUANTUM_TOKENS = 512
DEFAULT_MAX_BYPASS = 32
DEADLINE_EXCEEDED = "deadline_exceeded"


class QueueDeadline(Overloaded):
    """Still queued at its deadline (deadline_s): HTTP 503 with code "deadline_exceeded", gRPC
    DEADLINE_EXCEEDED; no Retry-After (the deadline was the client's)."""

    code = DEADLINE_EXCEEDED

    def __init__(self, req_id: str, deadline_s: float):
        RuntimeError.__init__(self)
        self.max_requests = 0
        self.retry_after_s = None
        self.message = (
            f"request {req_id} was still queued at its deadline_s={deadline_s:g} s "
            "(the requests ahead of it in the router's queue held the cluster that long)"
        )
        self.args = (self.message,)


class Ticket(NamedTuple):
    """What the queue needs of one request."""

    req_id: str
    flow: str  # the tenant ("" when API keys are off)
    key_class: KeyClass
    priority: int
    cost: int  # queued tokens: prompt + max_tokens * n
    deadline_s: float | None
    arrival: float | None = None  # time.monotonic() at the router (None: when queued)

    @classmethod
    def of(
        cls,
        request: GenerateRequest,
        tenant: str | None,
        key_class: KeyClass = DEFAULT_CLASS,
        arrival: float | None = None,
    ) -> Ticket:
        """arrival: when the request reached the router (its deadline_s counts from there:
        reading its body, the limits and tokenizing included)."""
        return cls(
            request.req_id,
            tenant or "",
            key_class,
            request.priority,
            request.max_total_tokens,
            request.deadline_s,
            arrival,
        )


@dataclass(eq=False)
class _Entry:
    ticket: Ticket
    deadline: float  # time.monotonic(); inf: none
    seq: int
    granted: asyncio.Future[None]
    removed: bool = False
    charged: int = 0  # the priority whose room it runs in (set when granted)

    def __lt__(self, other: _Entry) -> bool:  # within a flow: earliest deadline, then arrival
        return (self.deadline, self.seq) < (other.deadline, other.seq)


@dataclass
class _Band:
    """One priority's flows, each with its waiting entries (a heap), deficit and weight, in two
    rounds (as FQ-CoDel's): flows that just became active (`new`, served first, so a sparse
    tenant's request is not queued behind a flood's backlog of credit) and the others (`old`).
    A new flow starts with one quantum and joins the old round once it needs more."""

    quantum_tokens: int
    new: OrderedDict[str, list[_Entry]] = field(default_factory=OrderedDict)
    old: OrderedDict[str, list[_Entry]] = field(default_factory=OrderedDict)
    deficit: dict[str, int] = field(default_factory=dict)
    weight: dict[str, int] = field(default_factory=dict)
    live: int = 0  # entries waiting here, not removed

    def push(self, entry: _Entry) -> None:
        self.live += 1
        flow = entry.ticket.flow
        self.weight[flow] = entry.ticket.key_class.weight
        heap = self.new.get(flow)
        if heap is None:
            heap = self.old.get(flow)
        if heap is None:  # a flow just active goes first, before new flows being served
            heap = self.new[flow] = []
            self.new.move_to_end(flow, last=False)
            self.deficit[flow] = self._quantum(flow)
        heapq.heappush(heap, entry)

    def pop(self) -> _Entry:
        """The next live entry by deficit round robin (there is one: live > 0)."""
        while True:
            flows = self.new or self.old
            flow, heap = next(iter(flows.items()))
            while heap and heap[0].removed:
                heapq.heappop(heap)
            if not heap:
                self._drop(flows, flow)
                continue
            if self.deficit[flow] >= heap[0].ticket.cost:
                entry = heapq.heappop(heap)
                self.deficit[flow] -= entry.ticket.cost
                if not heap:
                    self._drop(flows, flow)
                self.live -= 1
                return entry
            self.deficit[flow] += self._quantum(flow)
            del flows[flow]
            self.old[flow] = heap  # to the back of the old round

    def _quantum(self, flow: str) -> int:
        return self.quantum_tokens * self.weight[flow]

    def _drop(self, flows: OrderedDict[str, list[_Entry]], flow: str) -> None:
        """A flow with nothing waiting leaves the round and loses its deficit (standard DRR)."""
        del flows[flow], self.deficit[flow], self.weight[flow]


class QueueMetrics:
    def __init__(self, registry: CollectorRegistry | None):
        r = registry or CollectorRegistry()
        self.queued = Gauge(
            "kvrelay_router_queued_requests",
            "Requests this router holds back while its running bound is full, by key class.",
            ["class"],
            registry=r,
        )
        self.sent = Counter(
            "kvrelay_router_queue_sent_requests",
            "Requests the router's queue sent on to the cluster, by key class.",
            ["class"],
            registry=r,
        )
        self.expired = Counter(
            "kvrelay_router_queue_deadline_refusals",
            "Requests refused because they were still queued at their deadline_s.",
            registry=r,
        )
        self.running = Gauge(
            "kvrelay_router_queue_running_requests",
            "Requests this router's queue has sent on that have not ended, by key class.",
            ["class"],
            registry=r,
        )
        for kind in TrafficClass:
            self.queued.labels(kind.value).set(0)
            self.running.labels(kind.value).set(0)
            self.sent.labels(kind.value)


def queue_by_class(registry: CollectorRegistry) -> tuple[ClassQueue, ...]:
    """The queue's figures by key class as its gauges in `registry` say (a FairQueue built on
    it; () when none is)."""
    classes = []
    for kind in TrafficClass:
        labels = {"class": kind.value}
        queued = registry.get_sample_value("kvrelay_router_queued_requests", labels)
        running = registry.get_sample_value("kvrelay_router_queue_running_requests", labels)
        if queued is None or running is None:
            return ()
        classes.append(ClassQueue(kind.value, int(queued), int(running)))
    return tuple(classes)


class FairQueue:
    """One event loop's queue (no lock: every call runs on that loop).

    Invariants: a request waits only while max_running requests of its priority or higher
    (charged to it or higher: a starvation-guard pick is charged to the top priority) run, or
    2 x max_running in all (max_running 0: no bound, nothing ever waits); every granted turn is
    given back exactly once (turn's exit), and every entry leaves the queue exactly once (sent,
    cancelled, expired)."""

    def __init__(
        self,
        max_running: int = 0,
        max_queued: int = 1024,
        registry: CollectorRegistry | None = None,
        quantum_tokens: int = DEFAULT_QUANTUM_TOKENS,
        max_bypass: int = DEFAULT_MAX_BYPASS,
    ):
        if max_running < 0 or max_queued < 1 or quantum_tokens < 1 or max_bypass < 1:
            raise ValueError(
                "max_running must be >= 0, max_queued, quantum_tokens and max_bypass >= 1"
            )
        self.max_running = max_running
        self.max_queued = max_queued
        self.quantum_tokens = quantum_tokens
        self.max_bypass = max_bypass
        self.metrics = QueueMetrics(registry)
        self.num_running = 0
        self.num_queued = 0
        self.num_sent_by_class = dict.fromkeys(TrafficClass, 0)  # for tests and the stats line
        self._running_at: dict[int, int] = {}  # running requests by priority
        self._bands: dict[int, _Band] = {}  # only bands with live entries
        self._seq = itertools.count()
        self._streak = 0  # sent in a row from the top priority while a lower one waited

    @contextlib.asynccontextmanager
    async def turn(self, ticket: Ticket) -> AsyncIterator[None]:
        """Wait for the request's turn and hold its running slot for the `async with` block.
        Raises Overloaded when max_queued already wait, QueueDeadline past its deadline; a
        cancelled wait leaves the queue."""
        charged = await self._wait(ticket)
        try:
            yield
        finally:
            self._release(ticket, charged)

    def has_room(self, priority: int) -> bool:
        """Whether a request of `priority` may run now: fewer than max_running run at it or
        above, and fewer than 2 x max_running in all."""
        if self.max_running == 0:
            return True
        if self.num_running >= 2 * self.max_running:
            return False
        above = sum(n for p, n in self._running_at.items() if p >= priority)
        return above < self.max_running

    async def _wait(self, ticket: Ticket) -> int:
        """Wait for the request's turn; the priority its slot is charged to."""
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        start = now if ticket.arrival is None else ticket.arrival
        deadline = math.inf if ticket.deadline_s is None else start + ticket.deadline_s
        entry = _Entry(ticket, deadline, next(self._seq), loop.create_future())
        band = self._bands.get(ticket.priority)
        if band is None:
            band = self._bands[ticket.priority] = _Band(self.quantum_tokens)
        band.push(entry)
        self._count_queued(ticket, +1)
        self._send_next()
        if entry.granted.done():  # room now: no wait at all
            return entry.charged
        if self.num_queued > self.max_queued:  # it would be one too many waiting
            self._remove(entry)
            raise Overloaded(self.max_queued, 1)
        timeout = None if ticket.deadline_s is None else max(0.0, deadline - now)
        try:
            await asyncio.wait_for(asyncio.shield(entry.granted), timeout)
        except (asyncio.CancelledError, TimeoutError) as e:
            if entry.granted.done():  # sent on as the wait ended: give the slot back
                self._release(ticket, entry.charged)
            else:
                self._remove(entry)
            if isinstance(e, TimeoutError):
                self.metrics.expired.inc()
                raise QueueDeadline(ticket.req_id, ticket.deadline_s or 0.0) from None
            raise
        return entry.charged

    def _start(self, ticket: Ticket, charged: int) -> None:
        self.num_running += 1
        self._running_at[charged] = self._running_at.get(charged, 0) + 1
        self.metrics.running.labels(ticket.key_class.kind.value).inc()
        self.num_sent_by_class[ticket.key_class.kind] += 1
        self.metrics.sent.labels(ticket.key_class.kind.value).inc()

    def _release(self, ticket: Ticket, charged: int) -> None:
        self.num_running -= 1
        self._running_at[charged] -= 1
        if not self._running_at[charged]:
            del self._running_at[charged]
        self.metrics.running.labels(ticket.key_class.kind.value).dec()
        self._send_next()

    def _remove(self, entry: _Entry) -> None:
        entry.removed = True  # its band drops it when it reaches the front of its flow
        priority = entry.ticket.priority
        band = self._bands[priority]
        band.live -= 1
        if not band.live:
            del self._bands[priority]
        self._count_queued(entry.ticket, -1)

    def _count_queued(self, ticket: Ticket, delta: int) -> None:
        self.num_queued += delta
        self.metrics.queued.labels(ticket.key_class.kind.value).inc(delta)

    def _send_next(self) -> None:
        while self._bands and self.has_room(top := max(self._bands)):
            entry = self._next_entry()
            entry.charged = top  # a starvation-guard pick runs in the top priority's room
            self._count_queued(entry.ticket, -1)
            self._start(entry.ticket, top)
            entry.granted.set_result(None)

    def _next_entry(self) -> _Entry:
        """The next entry to send: the top band's, or after max_bypass of those in a row while
        a lower band waited, the highest lower band's."""
        priorities = sorted(self._bands, reverse=True)
        chosen = priorities[0]
        if len(priorities) > 1 and self._streak >= self.max_bypass:
            chosen = priorities[1]
        band = self._bands[chosen]
        entry = band.pop()
        if not band.live:
            del self._bands[chosen]
        self._streak = self._streak + 1 if len(priorities) > 1 and chosen == priorities[0] else 0
        return entry
