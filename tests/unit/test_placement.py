"""Placer (router/placement.py) against a scripted stand-in for the Redis index: a request no
worker is predicted to serve in time waits (queue), is refused (shed, or past its deadline), or,
once migrated, is placed anyway; what it places is counted in the WorkerSet."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from common.messages import GenerateRequest, WorkerInfo, WorkerLoad
from common.placement_rules import SloTargets
from engine.sampling.sampling_params import SamplingParams
from router.errors import SloUnmet
from router.metrics import RouterMetrics
from router.placement import Placer
from router.policy import KVAwarePolicy
from router.prefix_index import IndexView
from router.slo import RemoteRoute
from router.worker_set import WorkerSet

BUSY = WorkerLoad(queued_tokens=100_000, prefill_tok_s=10_000)  # 10 s of queue
IDLE = WorkerLoad(prefill_tok_s=10_000)


class ScriptedIndex:
    """Stands in for PrefixIndex.view: the prefill worker's load is BUSY for the first
    `num_busy_views` views, then IDLE."""

    def __init__(self, num_busy_views: int, delay_s: float = 0.0):
        self.num_busy_views = num_busy_views
        self.num_views = 0
        self.delay_s = delay_s  # each lookup's time (a busy Redis)

    async def view(self, role: str, hashes: list[int]) -> IndexView:
        await asyncio.sleep(self.delay_s)
        self.num_views += 1
        load = BUSY if self.num_views <= self.num_busy_views else IDLE
        return IndexView([WorkerInfo("p0", "prefill", "p0", load=load)], {"p0": 0})


def placer(index: ScriptedIndex, slo: SloTargets) -> Placer:
    workers = WorkerSet()
    workers.add("p0", "prefill", actor=object())
    return Placer(16, workers, index, KVAwarePolicy(), slo=slo)  # type: ignore[arg-type]


REQUEST = GenerateRequest("r1", tuple(range(1000)), SamplingParams(max_tokens=8))


def test_queue_waits_until_a_worker_is_predicted_to_meet_the_objective() -> None:
    p = placer(ScriptedIndex(num_busy_views=3), SloTargets(ttft_ms=5000, overload="queue"))
    routed = asyncio.run(p.route(REQUEST, []))
    assert isinstance(routed, tuple) and isinstance(routed[0], RemoteRoute)
    assert routed[1] == 1000 and p.workers.num_placed("p0") == 1
    assert (p.num_slo_queued, p.num_slo_refused) == (1, 0)


def test_shed_refuses_at_once_and_places_nothing() -> None:
    index = ScriptedIndex(num_busy_views=10**6)
    p = placer(index, SloTargets(ttft_ms=5000, overload="shed"))
    with pytest.raises(SloUnmet, match="over the TTFT objective of 5000 ms; retry later"):
        asyncio.run(p.route(REQUEST, []))
    assert index.num_views == 1 and p.workers.num_placed("p0") == 0
    assert (p.num_slo_queued, p.num_slo_refused) == (0, 1)


def test_shed_holds_the_prediction_to_the_whole_objective_after_a_slow_lookup() -> None:
    """A shed request never waits: a slow index lookup is not spent of its objective (its
    refusal said "the 1950 ms left of the TTFT objective of 2000 ms")."""
    index = ScriptedIndex(num_busy_views=10**6, delay_s=0.05)
    p = placer(index, SloTargets(ttft_ms=2000, overload="shed"))
    with pytest.raises(SloUnmet, match="over the TTFT objective of 2000 ms; retry later"):
        asyncio.run(p.route(REQUEST, []))


def test_queue_refuses_once_its_deadline_passes() -> None:
    index = ScriptedIndex(num_busy_views=10**6)
    p = placer(index, SloTargets(ttft_ms=100, overload="queue"))
    with pytest.raises(SloUnmet):
        asyncio.run(p.route(REQUEST, []))
    assert index.num_views >= 2 and p.workers.num_placed("p0") == 0
    assert (p.num_slo_queued, p.num_slo_refused) == (1, 1)


def test_an_admitted_leg_is_placed_whatever_the_objectives_say() -> None:
    p = placer(ScriptedIndex(num_busy_views=10**6), SloTargets(ttft_ms=100, overload="shed"))
    routed = asyncio.run(p.route(REQUEST, [], admitted=True))
    assert isinstance(routed, tuple) and not routed[0].meets
    assert p.workers.num_placed("p0") == 1 and p.num_slo_refused == 0


def test_a_request_with_a_deadline_is_placed_whatever_the_ttft_objective_says() -> None:
    p = placer(ScriptedIndex(num_busy_views=10**6), SloTargets(ttft_ms=100, overload="shed"))
    batch = replace(REQUEST, priority=-1, deadline_s=600.0)
    routed = asyncio.run(p.route(batch, []))
    assert isinstance(routed, tuple) and not routed[0].meets
    assert p.workers.num_placed("p0") == 1 and p.num_slo_refused == 0
    with pytest.raises(SloUnmet):  # the same request without one is refused
        asyncio.run(p.route(replace(batch, deadline_s=None), []))


def test_a_lower_priority_request_queued_first_is_placed_after_a_higher_one() -> None:
    """Both wait for the objectives; when room frees, the earlier (lower) one looks first but
    leaves it to the higher one, which is placed first."""
    index = ScriptedIndex(num_busy_views=8)
    p = placer(index, SloTargets(ttft_ms=5000, overload="queue"))
    p.metrics = RouterMetrics()
    order: list[str] = []

    async def place(request: GenerateRequest) -> None:
        await p.route(request, [])
        order.append(request.req_id)

    async def scenario() -> None:
        low = asyncio.create_task(place(replace(REQUEST, req_id="low", priority=-1)))
        while p.waiters.num_above(-2) == 0:  # low is queued
            await asyncio.sleep(0)
        assert p.waiters.num_above(-1) == 0
        high = asyncio.create_task(place(replace(REQUEST, req_id="high", priority=3)))
        await asyncio.gather(low, high)

    asyncio.run(scenario())
    assert order == ["high", "low"]
    assert p.num_slo_queued == 2 and p.num_slo_deferred >= 1
    exported = {  # /metrics says what the placer counted
        name: p.metrics.registry.get_sample_value(f"kvrelay_slo_{name}_total")
        for name in ("queued", "deferred")
    }
    assert exported == {"queued": 2, "deferred": p.num_slo_deferred}
    text = p.metrics.render().decode()
    assert f"kvrelay_slo_deferred_total {float(p.num_slo_deferred)}" in text
    assert p.waiters.num_above(-100) == 0  # both left the count
    assert p.workers.num_placed("p0") == 2


def test_a_queued_request_that_is_refused_leaves_the_count() -> None:
    p = placer(ScriptedIndex(num_busy_views=10**6), SloTargets(ttft_ms=60, overload="queue"))
    with pytest.raises(SloUnmet):
        asyncio.run(p.route(replace(REQUEST, priority=5), []))
    assert p.waiters.num_above(-100) == 0
    routed = asyncio.run(p.route(replace(REQUEST, priority=-5, deadline_s=60.0), []))
    assert isinstance(routed, tuple)  # a deadline request is placed at once, as before
