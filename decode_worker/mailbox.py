"""Mailboxes: per-router queues of TokenDeltas, filled by the engine thread, drained by
long-polling Ray calls (one call per engine step at most, never one per token), and when each
router last polled (a router that stopped polling has died: its requests are orphans). Silence
counts only while this worker runs: a stall of the worker itself is not held against a router.
A silent router's box is kept (with what it has not read) until `forget_silent` drops it, so a
router that was only stalled still reads how its requests ended."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

from common.messages import TokenDelta


@dataclass
class _Box:
    loop: asyncio.AbstractEventLoop
    event: asyncio.Event
    items: list[TokenDelta] = field(default_factory=list)
    last_seen: float = field(default_factory=time.monotonic)  # its router's last poll


class Mailboxes:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._boxes: dict[str, _Box] = {}
        self._early: dict[str, list[TokenDelta]] = {}
        self._early_seen: dict[str, float] = {}  # routers that submitted but have not polled
        self._last_check: float | None = None  # time.monotonic() of the last silent_routers()

    def push(self, router_id: str, deltas: list[TokenDelta]) -> None:
        """Engine thread: queue deltas and wake the router's pending poll."""
        with self._lock:
            box = self._boxes.get(router_id)
            if box is None:
                self._early.setdefault(router_id, []).extend(deltas)
                self._early_seen.setdefault(router_id, time.monotonic())
                return
            box.items.extend(deltas)
        box.loop.call_soon_threadsafe(box.event.set)

    async def take(self, router_id: str, timeout_s: float) -> list[TokenDelta]:
        """Actor loop: wait up to timeout_s for deltas; return all queued ones."""
        with self._lock:
            box = self._boxes.get(router_id)
            if box is None:
                box = _Box(asyncio.get_running_loop(), asyncio.Event())
                box.items.extend(self._early.pop(router_id, []))
                self._early_seen.pop(router_id, None)
                self._boxes[router_id] = box
            box.last_seen = time.monotonic()
            if box.items:
                box.event.set()
        try:
            await asyncio.wait_for(box.event.wait(), timeout_s)
        except TimeoutError:
            return []
        finally:
            box.last_seen = time.monotonic()
        with self._lock:
            items, box.items = box.items, []
            box.event.clear()
        return items

    def expect(self, router_id: str) -> None:
        """A router submitted a request: it has until the timeout to start polling."""
        with self._lock:
            if router_id in self._boxes:
                self._boxes[router_id].last_seen = time.monotonic()
            else:
                self._early_seen[router_id] = time.monotonic()

    def silent_routers(self, timeout_s: float, check_every_s: float) -> list[str]:
        """Routers that have not polled for `timeout_s` (dead or cut off), called about every
        `check_every_s`. A gap of more than twice that since the last call means this worker
        itself was stopped (SIGSTOP, a paused VM) or starved: the gap is added to every
        router's last poll, since no poll could have been answered, and a poll pending across
        the stall may not have been noticed yet."""
        now = time.monotonic()
        with self._lock:
            stall = 0.0 if self._last_check is None else now - self._last_check - check_every_s
            self._last_check = now
            if stall > check_every_s:
                for box in self._boxes.values():
                    box.last_seen = min(now, box.last_seen + stall)
                for router_id, seen in self._early_seen.items():
                    self._early_seen[router_id] = min(now, seen + stall)
            cutoff = now - timeout_s
            boxes = [r for r, box in self._boxes.items() if box.last_seen < cutoff]
            early = [r for r, seen in self._early_seen.items() if seen < cutoff]
        return boxes + early

    def forget_silent(self, older_than_s: float) -> list[str]:
        """Drop the boxes (and undelivered deltas) of routers silent for `older_than_s`: they
        are gone for good. Returns their ids."""
        cutoff = time.monotonic() - older_than_s
        with self._lock:
            gone = [r for r, box in self._boxes.items() if box.last_seen < cutoff]
            gone += [r for r, seen in self._early_seen.items() if seen < cutoff]
            for router_id in gone:
                self._boxes.pop(router_id, None)
                self._early.pop(router_id, None)
                self._early_seen.pop(router_id, None)
        return gone
