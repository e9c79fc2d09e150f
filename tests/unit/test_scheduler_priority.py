"""Scheduler priorities without a model: waiting order, seats and blocks taken from lower
priorities by preemption (their cached blocks reused on readmission), FCFS within a priority."""

from __future__ import annotations

import pytest

from engine.finish_reason import FinishReason
from engine.priority import check_priority
from engine.sampling.validation import InvalidField
from tests.unit.test_scheduler import make_request, make_scheduler, run_step


def with_priority(req_id: str, num_prompt: int, priority: int, **kw):
    req = make_request(req_id, num_prompt, first=sum(map(ord, req_id)) * 7, **kw)
    req.priority = priority
    return req


def test_waiting_requests_are_admitted_by_priority_then_arrival() -> None:
    sched = make_scheduler(max_seqs=1)
    for req_id, priority in [("low", -5), ("mid-1", 0), ("high", 7), ("mid-2", 0)]:
        sched.add(with_priority(req_id, 4, priority, max_tokens=1))
    order = []
    while sched.has_unfinished:
        order += [c.req.req_id for c in run_step(sched).chunks]
    assert order == ["high", "mid-1", "mid-2", "low"]
    sched.kv.assert_all_free()


def test_a_higher_priority_request_takes_a_seat_from_a_lower_one() -> None:
    sched = make_scheduler(max_seqs=2)
    sched.add(with_priority("batch-1", 4, -1, max_tokens=20))
    sched.add(with_priority("batch-2", 4, -1, max_tokens=20))
    run_step(sched)
    sched.add(with_priority("chat", 4, 0, max_tokens=3))
    out = run_step(sched)
    assert out.preempted_req_ids == ["batch-2"]  # the lowest, most recently admitted
    assert {c.req.req_id for c in out.chunks} == {"batch-1", "chat"}
    assert sched.num_priority_preemptions == 1
    while sched.has_unfinished:
        run_step(sched)
    sched.kv.assert_all_free()


def test_a_higher_priority_request_takes_blocks_and_the_preempted_one_reuses_its_cache() -> None:
    # 12 blocks of 4 tokens: the batch request holds 10 (40 tokens), chat needs 4.
    sched = make_scheduler(num_blocks=12, block_size=4, budget=64)
    batch = with_priority("batch", 36, -1, max_tokens=8)
    sched.add(batch)
    for _ in range(3):
        run_step(sched)
    sched.add(with_priority("chat", 14, 0, max_tokens=2))
    out = run_step(sched)
    assert out.preempted_req_ids == ["batch"] and [c.req.req_id for c in out.chunks] == ["chat"]
    while sched.requests.get("chat") is not None:
        run_step(sched)
    out = run_step(sched)  # the batch request again: its full blocks come from the cache
    (chunk,) = out.chunks
    assert chunk.req is batch and chunk.start >= 32  # 8 full blocks were kept, not recomputed
    while sched.has_unfinished:
        run_step(sched)
    assert batch.num_output_tokens == 8
    sched.kv.assert_all_free()


def test_equal_priorities_never_preempt_for_a_waiting_request() -> None:
    sched = make_scheduler(max_seqs=1)
    sched.add(with_priority("first", 4, 3, max_tokens=5))
    run_step(sched)
    sched.add(with_priority("second", 4, 3, max_tokens=1))
    for _ in range(4):
        out = run_step(sched)
        assert not out.preempted_req_ids and [c.req.req_id for c in out.chunks] == ["first"]


@pytest.mark.parametrize("value", [101, -101, 1.5, "1", True])
def test_priority_out_of_range_or_not_an_int_is_refused_naming_it(value: object) -> None:
    with pytest.raises(InvalidField) as info:
        check_priority(value)
    assert info.value.field == "priority" and "priority" in info.value.message


def test_no_request_is_preempted_for_one_that_would_not_fit_anyway() -> None:
    # 12 blocks of 4 tokens: the batch request holds 10; chat needs 14 blocks, more than all 12.
    sched = make_scheduler(num_blocks=12, block_size=4, budget=64)
    sched.add(with_priority("batch", 36, -1, max_tokens=8))
    for _ in range(3):
        run_step(sched)
    chat = with_priority("chat", 54, 0, max_tokens=2)
    sched.add(chat)
    out = run_step(sched)
    assert out.preempted_req_ids == [] and [c.req.req_id for c in out.chunks] == ["batch"]
    assert sched.num_priority_preemptions == 0
    sched.finish(chat, FinishReason.ABORT)
    while sched.has_unfinished:
        run_step(sched)
    sched.kv.assert_all_free()
