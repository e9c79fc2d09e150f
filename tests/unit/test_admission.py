"""Admission: the bound on requests one router holds, its refusal and its metrics."""

from __future__ import annotations

import asyncio

import pytest

from router.admission import RETRY_AFTER_S, Admission
from router.errors import Overloaded
from router.metrics import RouterMetrics


def value(metrics: RouterMetrics, name: str) -> float:
    sample = metrics.registry.get_sample_value(name)
    assert sample is not None, name
    return sample


def test_the_bound_refuses_the_next_request_and_counts_it() -> None:
    metrics = RouterMetrics()
    admission = Admission(2, metrics)
    assert value(metrics, "kvrelay_max_queued_requests") == 2
    with admission.slot(), admission.slot():
        assert admission.num_admitted == 2
        assert value(metrics, "kvrelay_admitted_requests") == 2
        for _ in range(3):
            with pytest.raises(Overloaded) as info, admission.slot():
                pass
        assert info.value.retry_after_s == RETRY_AFTER_S
        assert "limit of 2 requests" in info.value.message
        assert admission.num_admitted == 2  # a refusal takes no slot
    assert admission.num_admitted == 0
    assert value(metrics, "kvrelay_overloaded_requests_total") == 3
    assert value(metrics, "kvrelay_admitted_requests") == 0


def test_a_slot_is_given_back_however_its_request_ends() -> None:
    admission = Admission(1, RouterMetrics())
    with pytest.raises(RuntimeError), admission.slot():
        raise RuntimeError("the request failed")
    with admission.slot():
        assert admission.num_admitted == 1


def test_drained_waits_for_the_last_slot() -> None:
    async def scenario() -> None:
        admission = Admission(4, RouterMetrics())
        await admission.drained()  # nothing admitted: at once
        first, second = admission.slot(), admission.slot()
        first.__enter__()
        second.__enter__()
        waiter = asyncio.create_task(admission.drained())
        await asyncio.sleep(0)  # one loop turn (no time): the waiter is now waiting
        first.__exit__(None, None, None)
        await asyncio.sleep(0)
        assert not waiter.done()  # one slot is still held
        second.__exit__(None, None, None)
        await waiter
        assert admission.num_admitted == 0

    asyncio.run(scenario())


def test_a_bound_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match=">= 1"):
        Admission(0, RouterMetrics())
