"""ServerHarness: the router's HTTP and gRPC servers over an EngineBackend, on 127.0.0.1 free
ports, served by an event loop on a background thread (so tests can use blocking clients).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

from engine.engine import Engine
from router.frontend import Frontend
from router.metrics import RouterMetrics
from router.serve import RouterServers
from router.tokenizer import RouterTokenizer
from tests.engine_backend import EngineBackend

T = TypeVar("T")


class LoopThread:
    """An asyncio loop on a background thread; run() executes a coroutine on it, blocking.
    Subclasses that start RouterServers set self.servers (for base_url / grpc_target)."""

    servers: RouterServers | None = None

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="router-loop")
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 60.0) -> T:
        """Run a coroutine on the server loop; block until it returns."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    @property
    def base_url(self) -> str:
        assert self.servers is not None
        return f"http://127.0.0.1:{self.servers.http.port}"

    @property
    def grpc_target(self) -> str:
        assert self.servers is not None
        return f"127.0.0.1:{self.servers.grpc.port}"

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


class ServerHarness(LoopThread):
    def __init__(self, engine: Engine, checkpoint: str | Path):
        super().__init__()
        self.engine = engine
        self.backend = EngineBackend(engine)
        self.metrics = RouterMetrics()
        self.frontend = Frontend(self.backend, RouterTokenizer(checkpoint), self.metrics)
        self.run(self._start())

    async def _start(self) -> None:
        await self.backend.start()
        self.servers = RouterServers(self.frontend)
        await self.servers.start("127.0.0.1", 0, 0)

    def assert_no_leaks(self) -> None:
        """Wait for every request's cleanup, then check the engine holds no request or block."""
        self.backend.wait_until_idle()
        self.run(self.backend.call(lambda engine: engine.assert_no_leaks()))

    def stop(self) -> None:
        try:
            if self.servers is not None:
                self.run(self.servers.stop(0))
        finally:
            self.backend.stop()
            self.close()
