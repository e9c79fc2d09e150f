"""Mailboxes' silence clock (decode_worker/mailbox.py): a router that stopped polling is found
silent after the timeout, but a stall of the worker itself (SIGSTOP, a paused VM) is not held
against a router whose poll was pending across it; a silent router's box is kept (with what
it has not read) until it is gone for good."""

from __future__ import annotations

import asyncio

import pytest

from common.messages import TokenDelta
from decode_worker import mailbox
from decode_worker.mailbox import Mailboxes
from tests.manual_clock import ManualClock

TIMEOUT_S = 10.0
CHECK_S = 1.0


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> ManualClock:
    clock = ManualClock(1000.0)
    monkeypatch.setattr(mailbox.time, "monotonic", clock)
    return clock


def checked_every_second(boxes: Mailboxes, clock: ManualClock, seconds: int) -> list[str]:
    """The engine thread's checks over `seconds` of running time; the last check's answer."""
    silent: list[str] = []
    for _ in range(seconds):
        clock.now += CHECK_S
        silent = boxes.silent_routers(TIMEOUT_S, CHECK_S)
    return silent


def test_a_router_that_stops_polling_is_silent_after_the_timeout(clock: ManualClock) -> None:
    boxes = Mailboxes()
    boxes.expect("router-a")
    assert boxes.silent_routers(TIMEOUT_S, CHECK_S) == []
    assert checked_every_second(boxes, clock, 9) == []
    assert checked_every_second(boxes, clock, 2) == ["router-a"]


def test_the_workers_own_stall_is_not_counted_against_a_router(clock: ManualClock) -> None:
    boxes = Mailboxes()
    boxes.expect("router-a")  # it submitted; its first poll is pending when the worker stops
    boxes.silent_routers(TIMEOUT_S, CHECK_S)
    clock.now += 12.0  # the whole process was stopped: no poll could be answered
    assert boxes.silent_routers(TIMEOUT_S, CHECK_S) == [], "the stall is not the router's"
    assert checked_every_second(boxes, clock, 8) == []
    assert checked_every_second(boxes, clock, 3) == ["router-a"], "silence still counts after"


def test_a_silent_routers_box_is_kept_for_its_return_then_forgotten(clock: ManualClock) -> None:
    boxes = Mailboxes()
    boxes.expect("router-a")
    end = TokenDelta("r1", (), True, "error", error="aborted", resumable=True)
    boxes.push("router-a", [TokenDelta("r1", (5,)), end])
    assert checked_every_second(boxes, clock, 11) == ["router-a"]
    assert boxes.forget_silent(300.0) == [], "silent, but not yet gone for good"
    # A router that was only stalled polls again and reads what it missed, the end included.
    assert asyncio.run(boxes.take("router-a", 1.0)) == [TokenDelta("r1", (5,)), end]
    assert checked_every_second(boxes, clock, 301) == ["router-a"]
    assert boxes.forget_silent(300.0) == ["router-a"]
    boxes.push("router-a", [TokenDelta("r2", (1,))])  # a late delta starts a fresh record
    assert boxes.forget_silent(300.0) == []
