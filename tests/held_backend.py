"""HeldBackend: a test-support Backend over another one that can hold every new request at its
door until released, and whose health can be set; owns the gate and the count of held requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable

from common.messages import GenerateRequest, TokenDelta
from router.backend import Backend


class HeldBackend(Backend):
    """hold() / release() run on the serving loop (through LoopThread.run); the counters and
    wait_until() may be read from any thread."""

    def __init__(self, inner: Backend):
        self.inner = inner
        self.model_id = inner.model_id
        self.max_model_len = inner.max_model_len
        self.vocab_size = inner.vocab_size
        self.num_calls = 0  # generate() calls that reached this backend
        self.num_held = 0  # of them, waiting at the gate now
        self.requests: list[GenerateRequest] = []  # every request that reached it, in order
        self.health_override: dict[str, object] | None = None  # None: the inner backend's
        self._open: asyncio.Event | None = None
        self._changed = threading.Condition()

    async def hold(self) -> None:
        """From now on each new request waits at the gate until release()."""
        self._open = asyncio.Event()

    async def release(self) -> None:
        if self._open is not None:
            self._open.set()
            self._open = None

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        gate = self._open
        self.requests.append(request)
        self._count(calls=1, held=1 if gate is not None else 0)
        if gate is not None:
            try:
                await gate.wait()
            finally:
                self._count(held=-1)
        stream = self.inner.generate(request)
        async with contextlib.aclosing(stream):
            async for delta in stream:
                yield delta

    async def abort(self, req_id: str) -> None:
        await self.inner.abort(req_id)

    async def health(self) -> dict[str, object]:
        if self.health_override is not None:
            return dict(self.health_override)
        return await self.inner.health()

    def _count(self, calls: int = 0, held: int = 0) -> None:
        with self._changed:
            self.num_calls += calls
            self.num_held += held
            self._changed.notify_all()

    def wait_until(self, predicate: Callable[[HeldBackend], bool], timeout_s: float = 30.0) -> None:
        """Block until predicate(self) holds; checked whenever a request arrives or leaves."""
        with self._changed:
            if not self._changed.wait_for(lambda: predicate(self), timeout_s):
                raise TimeoutError(f"timed out: {self.num_calls} calls, {self.num_held} held")
