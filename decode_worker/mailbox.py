"""Mailboxes: per-router queues of TokenDeltas, filled by the engine thread, drained by
long-polling Ray calls (one call per engine step at most, never one per token)."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

from common.messages import TokenDelta


@dataclass
class _Box:
    loop: asyncio.AbstractEventLoop
    event: asyncio.Event
    items: list[TokenDelta] = field(default_factory=list)


class Mailboxes:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._boxes: dict[str, _Box] = {}
        self._early: dict[str, list[TokenDelta]] = {}

    def push(self, router_id: str, deltas: list[TokenDelta]) -> None:
        """Engine thread: queue deltas and wake the router's pending poll."""
        with self._lock:
            box = self._boxes.get(router_id)
            if box is None:
                self._early.setdefault(router_id, []).extend(deltas)
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
                self._boxes[router_id] = box
            if box.items:
                box.event.set()
        try:
            await asyncio.wait_for(box.event.wait(), timeout_s)
        except TimeoutError:
            return []
        with self._lock:
            items, box.items = box.items, []
            box.event.clear()
        return items
