"""ServingGate: whether one router's cluster backend takes new requests and whether its open
streams must end now; owns that state (open; refusing with a reason: shutting down, the Ray
cluster lost; streams ended) and the event that open work waits on."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import NamedTuple, TypeVar

from router.errors import Overloaded

T = TypeVar("T")
RETRY_AFTER_S = 1


class ClusterUnavailable(Overloaded):
    """The cluster cannot take a request now (shutting down, its Ray cluster lost, no live
    worker in a pool): HTTP 503 + Retry-After / gRPC UNAVAILABLE, refused before anything is
    sent, with a message saying why."""

    def __init__(self, message: str, retry_after_s: int = RETRY_AFTER_S):
        RuntimeError.__init__(self, message)
        self.max_requests = 0
        self.retry_after_s = retry_after_s
        self.message = message


class StreamsEnd(NamedTuple):
    """Why open streams end now, and the finish_reason each open choice ends with: "abort"
    (the server shut down before it finished) or "error" (the cluster behind it was lost)."""

    reason: str
    finish_reason: str


class StreamsEnded(Exception):
    """Raised inside a request's leg once the gate ended the streams (ServingGate.end)."""

    def __init__(self, end: StreamsEnd):
        super().__init__(end.reason)
        self.end = end


class ServingGate:
    """Invariants: once refusing it never opens again (a router that stops, stops); `ended` is
    set only after refusing, so no request starts after its streams were ended."""

    def __init__(self) -> None:
        self.refusal: str | None = None  # why new requests are refused; None: taking them
        self.ended: StreamsEnd | None = None
        self._ended_event: asyncio.Event | None = None

    def refuse(self, reason: str) -> None:
        """Refuse every new request from now on (the first reason is kept)."""
        self.refusal = self.refusal or reason

    def end(self, reason: str, finish_reason: str = "abort") -> StreamsEnd:
        """End the open streams now (refusing new requests too)."""
        self.refuse(reason)
        if self.ended is None:
            self.ended = StreamsEnd(reason, finish_reason)
            if self._ended_event is not None:
                self._ended_event.set()
        return self.ended

    def check(self) -> None:
        """Raises ClusterUnavailable while refusing."""
        if self.refusal is not None:
            raise ClusterUnavailable(self.refusal)

    async def unless_ended(self, work: Awaitable[T]) -> T:
        """`work`'s result, or StreamsEnded as soon as the streams are ended (`work` is then
        cancelled; the caller's cleanup tells the worker)."""
        if self.ended is not None:
            raise StreamsEnded(self.ended)
        if self._ended_event is None:
            self._ended_event = asyncio.Event()
        task = asyncio.ensure_future(work)
        ended = asyncio.ensure_future(self._ended_event.wait())
        try:
            await asyncio.wait({task, ended}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ended.cancel()
            if not task.done():
                task.cancel()
        if task.done() and not task.cancelled():
            return task.result()
        assert self.ended is not None
        raise StreamsEnded(self.ended)
