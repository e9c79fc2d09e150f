"""The router's FairQueue alone: priority order, deficit round robin between tenants by queued
tokens and weights, no starvation of a lower priority, the bound, cancellation and deadlines."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable

import pytest
from prometheus_client import CollectorRegistry

from engine.priority import MAX_LEVEL
from router.errors import Overloaded
from router.fair_queue import FairQueue, QueueDeadline, Ticket
from router.traffic_class import KeyClass, TrafficClass

BATCH = KeyClass(TrafficClass.BATCH)


def ticket(req_id: str, flow: str = "", priority: int = 0, cost: int = 100, **kw) -> Ticket:
    key_class = kw.pop("key_class", KeyClass())
    return Ticket(req_id, flow, key_class, priority, cost, kw.pop("deadline_s", None))


async def grant_order(queue: FairQueue, tickets: list[Ticket]) -> list[str]:
    """The order the queue sends `tickets` on in, all queued behind one running request of the
    top priority (one of a lower priority would not hold a higher one back)."""
    order: list[str] = []
    release = asyncio.Event()

    async def hold() -> None:
        async with queue.turn(ticket("holder", priority=MAX_LEVEL)):
            await release.wait()

    async def one(t: Ticket) -> None:
        async with queue.turn(t):
            order.append(t.req_id)

    holder = asyncio.create_task(hold())
    await asyncio.sleep(0)
    tasks = [asyncio.create_task(one(t)) for t in tickets]
    while queue.num_queued < len(tickets):
        await asyncio.sleep(0)
    release.set()
    await asyncio.gather(holder, *tasks)
    assert queue.num_running == 0 and queue.num_queued == 0
    return order


def queued_gauge(registry: CollectorRegistry, kind: str) -> float | None:
    return registry.get_sample_value("kvrelay_router_queued_requests", {"class": kind})


def test_higher_priority_first_then_arrival() -> None:
    queue = FairQueue(max_running=1)
    tickets = [ticket("a", priority=-1), ticket("b"), ticket("c", priority=5), ticket("d")]
    assert asyncio.run(grant_order(queue, tickets)) == ["c", "b", "d", "a"]


def test_tenants_share_by_queued_tokens_not_by_request_count() -> None:
    queue = FairQueue(max_running=1, quantum_tokens=100)
    big = [ticket(f"big-{i}", "big", cost=400) for i in range(10)]
    small = [ticket(f"small-{i}", "small", cost=100) for i in range(40)]
    order = asyncio.run(grant_order(queue, big + small))
    first = Counter(req_id.split("-")[0] for req_id in order[:25])
    assert first == {"small": 20, "big": 5}  # 2,000 tokens each


def test_weights_set_the_shares() -> None:
    queue = FairQueue(max_running=1, quantum_tokens=100)
    heavy = KeyClass(weight=3)
    a = [ticket(f"a-{i}", "a", cost=100) for i in range(30)]
    b = [ticket(f"b-{i}", "b", cost=100, key_class=heavy) for i in range(30)]
    order = asyncio.run(grant_order(queue, a + b))
    assert Counter(req_id[0] for req_id in order[:20]) == {"b": 15, "a": 5}


def test_a_flood_does_not_starve_a_later_tenant() -> None:
    queue = FairQueue(max_running=1, quantum_tokens=100)
    flood = [ticket(f"flood-{i}", "flood") for i in range(50)]
    late = [ticket(f"late-{i}", "late") for i in range(3)]
    order = asyncio.run(grant_order(queue, flood + late))
    # a flow just active goes before the flood's backlog, and before the flood itself while
    # that is still a new flow being served its first quantum
    assert order.index("late-0") == 0
    assert max(order.index(f"late-{i}") for i in range(3)) < 8


def test_a_lower_priority_gets_one_turn_after_max_bypass() -> None:
    queue = FairQueue(max_running=1, max_bypass=4)
    high = [ticket(f"hi-{i}", "chat", priority=0) for i in range(12)]
    low = [ticket(f"lo-{i}", "batch", priority=-1, key_class=BATCH) for i in range(3)]
    order = asyncio.run(grant_order(queue, low + high))
    assert [i for i, req_id in enumerate(order) if req_id.startswith("lo")] == [
        4,
        9,
        14,
    ]  # then the last one when the top is empty
    assert queue.num_sent_by_class[TrafficClass.BATCH] == 3


def holds_until(queue: FairQueue, release: asyncio.Event) -> Callable[[Ticket], Awaitable[None]]:
    """A request's life that holds its turn until `release` is set."""

    async def hold(t: Ticket) -> None:
        async with queue.turn(t):
            await release.wait()

    return hold


async def settle() -> None:
    """Let every task the last grant woke run up to its next wait."""
    for _ in range(10):
        await asyncio.sleep(0)


def test_lower_priorities_running_never_hold_a_higher_one_back() -> None:
    """The bound is per priority: with two batch requests filling a bound of 2, an interactive
    one goes on at once (the workers put it ahead of them), a third batch one waits; two
    interactive ones running then hold back a third interactive one and every batch one."""

    async def scenario() -> None:
        queue = FairQueue(max_running=2)
        releases = {name: asyncio.Event() for name in ("b0", "b1", "b2", "i0", "i1", "i2")}
        sent: list[str] = []

        async def run(t: Ticket) -> None:
            async with queue.turn(t):
                sent.append(t.req_id)
                await releases[t.req_id].wait()

        def batch(name: str) -> asyncio.Task[None]:
            return asyncio.create_task(run(ticket(name, "jobs", -1, key_class=BATCH)))

        def chat(name: str) -> asyncio.Task[None]:
            return asyncio.create_task(run(ticket(name, "chat")))

        tasks = [batch("b0"), batch("b1"), batch("b2")]
        await asyncio.sleep(0)
        assert sent == ["b0", "b1"] and queue.num_queued == 1
        tasks += [chat("i0"), chat("i1"), chat("i2")]
        await asyncio.sleep(0)
        assert sent == ["b0", "b1", "i0", "i1"] and queue.num_running == 4
        assert queue.num_queued == 2  # i2 (two interactive run) and b2
        releases["b0"].set()
        await settle()
        assert sent == ["b0", "b1", "i0", "i1"]  # three still run at -1 or above: b2 waits
        releases["i0"].set()
        await settle()
        assert sent[4:] == ["i2"]
        for event in releases.values():
            event.set()
        await asyncio.gather(*tasks)
        assert sent[5:] == ["b2"] and queue.num_running == 0 and queue.num_queued == 0

    asyncio.run(scenario())


def test_the_starvation_guard_sends_a_lower_one_on_the_top_bands_room() -> None:
    """After max_bypass sends from the top band while a batch request waited (its own room
    full of batch requests), the next send is the batch one, in the top band's room: the next
    top one waits for it, so the guard never adds to what runs."""

    async def scenario() -> None:
        queue = FairQueue(max_running=1, max_bypass=2)
        release = asyncio.Event()
        sent: list[str] = []

        async def run(t: Ticket, hold: bool) -> None:
            async with queue.turn(t):
                sent.append(t.req_id)
                if hold:
                    await release.wait()

        holder = asyncio.create_task(run(ticket("b0", "jobs", -1, key_class=BATCH), True))
        waiting = asyncio.create_task(run(ticket("b1", "jobs", -1, key_class=BATCH), False))
        await asyncio.sleep(0)
        for i in range(2):  # each interactive one runs alone at priority 0 and ends
            await run(ticket(f"i{i}", "chat"), False)
        assert sent == ["b0", "i0", "i1"] and queue.num_queued == 1
        # the guard sends b1 in i2's room (charged to priority 0): i2 waits for it to end
        await run(ticket("i2", "chat"), False)
        assert sent == ["b0", "i0", "i1", "b1", "i2"]
        assert queue.num_sent_by_class[TrafficClass.BATCH] == 2
        release.set()
        await asyncio.gather(holder, waiting)
        assert queue.num_running == 0 and queue.num_queued == 0

    asyncio.run(scenario())


def test_climbing_priorities_run_at_most_twice_the_bound() -> None:
    """Each priority has max_running of its own and above, but at most 2 x max_running run in
    all: a client raising its priority a level at a time gets no more."""

    async def scenario() -> None:
        queue = FairQueue(max_running=2, max_queued=8)
        release = asyncio.Event()
        hold = holds_until(queue, release)

        tasks = [
            asyncio.create_task(hold(ticket(f"p{level}-{i}", "x", level)))
            for level in (-1, 0, 1, 2)
            for i in range(2)
        ]
        await settle()
        assert queue.num_running == 4 and queue.num_queued == 4
        release.set()
        await asyncio.gather(*tasks)
        assert queue.num_running == 0 and queue.num_queued == 0

    asyncio.run(scenario())


def test_a_request_with_room_is_sent_even_with_the_queue_full() -> None:
    """max_queued bounds the requests that wait; one that need not wait is never refused."""

    async def scenario() -> None:
        queue = FairQueue(max_running=1, max_queued=1)
        release = asyncio.Event()
        hold = holds_until(queue, release)

        holder = asyncio.create_task(hold(ticket("holder")))
        waiting = asyncio.create_task(hold(ticket("w", "jobs", -1, key_class=BATCH)))
        await settle()
        assert queue.num_queued == 1
        with pytest.raises(Overloaded):  # it would wait too: one too many
            async with queue.turn(ticket("one-too-many")):
                pass
        async with queue.turn(ticket("urgent", priority=5)):  # room at 5: no wait, no refusal
            assert queue.num_running == 2
        release.set()
        await asyncio.gather(holder, waiting)
        assert queue.num_running == 0 and queue.num_queued == 0

    asyncio.run(scenario())


def test_the_queue_is_bounded_and_a_cancelled_wait_leaves_it() -> None:
    registry = CollectorRegistry()
    queue = FairQueue(max_running=1, max_queued=2, registry=registry)

    async def scenario() -> None:
        release = asyncio.Event()

        async def hold(t: Ticket) -> None:
            async with queue.turn(t):
                await release.wait()

        holder = asyncio.create_task(hold(ticket("holder")))
        await asyncio.sleep(0)
        waiting = [asyncio.create_task(hold(ticket(f"w{i}", key_class=BATCH))) for i in range(2)]
        await asyncio.sleep(0)
        assert queue.num_queued == 2 and queued_gauge(registry, "batch") == 2
        with pytest.raises(Overloaded):
            async with queue.turn(ticket("one-too-many")):
                pass
        waiting[0].cancel()
        await asyncio.gather(waiting[0], return_exceptions=True)
        assert queue.num_queued == 1 and queued_gauge(registry, "batch") == 1
        release.set()
        await asyncio.gather(holder, waiting[1])
        assert queue.num_running == 0 and queue.num_queued == 0
        assert queued_gauge(registry, "batch") == 0
        sent = registry.get_sample_value(
            "kvrelay_router_queue_sent_requests_total", {"class": "batch"}
        )
        assert sent == 1  # the cancelled one never went on

    asyncio.run(scenario())


async def holding(queue: FairQueue) -> tuple[asyncio.Event, asyncio.Task[None]]:
    """A request that holds the queue's one running slot until the event is set."""
    release = asyncio.Event()

    async def hold() -> None:
        async with queue.turn(ticket("holder")):
            await release.wait()

    holder = asyncio.create_task(hold())
    await asyncio.sleep(0)
    return release, holder


def test_a_request_still_queued_at_its_deadline_is_refused() -> None:
    registry = CollectorRegistry()
    queue = FairQueue(max_running=1, registry=registry)

    async def scenario() -> None:
        release, holder = await holding(queue)
        with pytest.raises(QueueDeadline) as info:
            async with queue.turn(ticket("late", deadline_s=0.01, key_class=BATCH)):
                pass
        assert "deadline_s" in info.value.message and info.value.code == "deadline_exceeded"
        assert queue.num_queued == 0
        release.set()
        await holder
        async with queue.turn(ticket("in-time", deadline_s=0.01)):  # room: no wait at all
            assert queue.num_running == 1

    asyncio.run(scenario())
    assert registry.get_sample_value("kvrelay_router_queue_deadline_refusals_total") == 1


def test_a_deadline_counts_from_the_requests_arrival_not_from_its_queueing() -> None:
    """deadline_s is "seconds after arrival": the time its body took to read and tokenize
    counts (it counted from the moment it was queued)."""
    queue = FairQueue(max_running=1)

    async def scenario() -> None:
        release, holder = await holding(queue)
        arrived = time.monotonic() - 5.0  # arrived 5 s ago
        late = Ticket("late", "", BATCH, -1, 100, 4.0, arrived)  # past its deadline already
        on_time = Ticket("on-time", "", BATCH, -1, 100, 60.0, arrived)

        async def run(t: Ticket) -> str:
            try:
                async with queue.turn(t):
                    return "sent"
            except QueueDeadline:
                return "refused"

        tasks = [asyncio.create_task(run(late)), asyncio.create_task(run(on_time))]
        await asyncio.sleep(0.05)
        release.set()  # the slot frees within 4 s of queueing: only a deadline counted from
        await holder  # the arrival refuses the late one
        assert await asyncio.gather(*tasks) == ["refused", "sent"]

    asyncio.run(scenario())


def test_without_a_bound_nothing_waits() -> None:
    queue = FairQueue(max_running=0)

    async def scenario() -> None:
        async with queue.turn(ticket("a")), queue.turn(ticket("b")):
            assert queue.num_running == 2 and queue.num_queued == 0

    asyncio.run(scenario())
