"""ServingGate: whether one router's cluster backend takes new requests and whether its open
streams must end now; owns that state (open; refusing with a reason and its error code:
shutting down, the Ray cluster lost; streams ended) and the event that open work waits on."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import NamedTuple, TypeVar

from engine.finish_reason import FinishReason
from router.errors import Overloaded

T = TypeVar("T")
RETRY_AFTER_S = 1
# The OpenAI error code of a 503 the cluster answers (the router's own bound and the objectives
# answer "overloaded"): this server is going away, or its cluster cannot serve now.
SHUTTING_DOWN = "shutting_down"
UNAVAILABLE = "unavailable"


class ClusterUnavailable(Overloaded):
    """The cluster cannot take a request now (shutting down, its Ray cluster lost, no live
    worker in a pool): HTTP 503 / gRPC UNAVAILABLE with a message saying why and `code`,
    refused before anything is sent. `retry_after_s` (Retry-After, gRPC retry pushback) only
    where this server may serve again soon: None while it refuses for good."""

    def __init__(
        self, message: str, code: str = UNAVAILABLE, retry_after_s: int | None = RETRY_AFTER_S
    ):
        RuntimeError.__init__(self, message)
        self.max_requests = 0
        self.retry_after_s = retry_after_s
        self.message = message
        self.code = code


class Refusal(NamedTuple):
    """Why a gate refuses every new request, and the error code it answers with."""

    reason: str
    code: str


class StreamsEnd(NamedTuple):
    """Why open streams end now, and the finish_reason each open choice ends with: ABORT
    (the server shut down before it finished) or ERROR (the cluster behind it was lost)."""

    reason: str
    finish_reason: FinishReason


class StreamsEnded(Exception):
    """Raised inside a request's leg once the gate ended the streams (ServingGate.end)."""

    def __init__(self, end: StreamsEnd):
        super().__init__(end.reason)
        self.end = end


class ServingGate:
    """Invariants: once refusing it never opens again (a router that stops, stops); `ended` is
    set only after refusing, so no request starts after its streams were ended."""

    def __init__(self) -> None:
        self.refused: Refusal | None = None  # None: taking new requests
        self.ended: StreamsEnd | None = None
        self._ended_event: asyncio.Event | None = None

    @property
    def refusal(self) -> str | None:
        """Why new requests are refused (None: they are taken)."""
        return None if self.refused is None else self.refused.reason

    def refuse(self, reason: str, code: str = SHUTTING_DOWN) -> None:
        """Refuse every new request from now on (the first reason and code are kept)."""
        self.refused = self.refused or Refusal(reason, code)

    def end(self, reason: str, finish_reason: FinishReason = FinishReason.ABORT) -> StreamsEnd:
        """End the open streams now (refusing new requests too)."""
        self.refuse(reason)
        if self.ended is None:
            self.ended = StreamsEnd(reason, finish_reason)
            if self._ended_event is not None:
                self._ended_event.set()
        return self.ended

    def check(self) -> None:
        """Raises ClusterUnavailable while refusing."""
        if self.refused is not None:
            raise self.unavailable(self.refused.reason)

    def unavailable(self, message: str) -> ClusterUnavailable:
        """The error of a request refused with `message`: while refusing, the refusal's code and
        no Retry-After (this server will not serve again); otherwise (no live worker now)
        "unavailable" with a Retry-After."""
        if self.refused is None:
            return ClusterUnavailable(message)
        return ClusterUnavailable(message, self.refused.code, retry_after_s=None)

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
