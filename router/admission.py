"""Admission: owns the count of requests one router holds (being parsed, queued or running) and
its bound. Beyond the bound a request is refused at once (Overloaded), never queued without end.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from router.errors import Overloaded
from router.metrics import RouterMetrics

DEFAULT_MAX_QUEUED_REQUESTS = 1024
RETRY_AFTER_S = 1  # what a refused client is told to wait (Retry-After, grpc-retry-pushback-ms)


class Admission:
    """A counting bound on one event loop (no lock needed: every call runs on that loop).

    Invariant: 0 <= num_admitted <= max_requests; every admitted slot is released exactly once,
    whatever way its request ends (finish, error, client gone, cancellation).
    """

    def __init__(self, max_requests: int, metrics: RouterMetrics):
        if max_requests < 1:
            raise ValueError(f"the request bound must be >= 1, got {max_requests}")
        self.max_requests = max_requests
        self.num_admitted = 0
        self._metrics = metrics
        self._drained: asyncio.Event | None = None
        metrics.max_queued.set(max_requests)

    def check_room(self) -> None:
        """Raises Overloaded (counted) when no slot is free now."""
        if self.num_admitted >= self.max_requests:
            self._metrics.overloaded.inc()
            raise Overloaded(self.max_requests, RETRY_AFTER_S)

    @contextlib.contextmanager
    def slot(self) -> Iterator[None]:
        """Hold one slot for the `with` block; raises Overloaded on entry when none is free."""
        self.check_room()
        self._change(+1)
        try:
            yield
        finally:
            self._change(-1)

    async def drained(self) -> None:
        """Return once no request holds a slot (a graceful stop, or a test, waits on this)."""
        while self.num_admitted:
            if self._drained is None:
                self._drained = asyncio.Event()
            await self._drained.wait()

    def _change(self, delta: int) -> None:
        self.num_admitted += delta
        self._metrics.admitted.set(self.num_admitted)
        if self.num_admitted == 0 and self._drained is not None:
            self._drained.set()
            self._drained = None
