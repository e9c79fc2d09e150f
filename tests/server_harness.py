"""ServerHarness: the router's HTTP and gRPC servers over an EngineBackend (optionally behind a
HeldBackend), on 127.0.0.1 free ports, served by an event loop on a background thread (so tests
can use blocking clients); with API keys, per-key limits, a request bound, a body limit, TLS or a
tokenizer of the test's own when asked.
"""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from engine.engine import Engine
from router.access import ApiKeys
from router.admission import DEFAULT_MAX_QUEUED_REQUESTS
from router.frontend import Frontend
from router.metrics import RouterMetrics
from router.rate_limits import RateLimiter
from router.serve import RouterServers
from router.tls import ServerTLS
from router.tokenizer import RouterTokenizer
from tests.engine_backend import EngineBackend
from tests.held_backend import HeldBackend

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
        """http(s)://127.0.0.1:PORT (no /v1)."""
        assert self.servers is not None
        return self.servers.http_url("127.0.0.1").removesuffix("/v1")

    @property
    def grpc_target(self) -> str:
        assert self.servers is not None
        return f"127.0.0.1:{self.servers.grpc.port}"

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


class ServerHarness(LoopThread):
    """self.backend is the EngineBackend; with held=True the front ends call self.held, a
    HeldBackend over it."""

    def __init__(
        self,
        engine: Engine,
        checkpoint: str | Path,
        *,
        held: bool = False,
        max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS,
        api_keys: ApiKeys | None = None,
        tls: ServerTLS | None = None,
        tokenizer: RouterTokenizer | None = None,
        max_body_mib: float | None = None,
        limiter: RateLimiter | None = None,
    ):
        super().__init__()
        self.engine = engine
        self.backend = EngineBackend(engine)
        self.held = HeldBackend(self.backend) if held else None
        self.metrics = RouterMetrics()
        self.frontend = Frontend(
            self.held or self.backend,
            tokenizer or RouterTokenizer(checkpoint),
            self.metrics,
            max_queued_requests=max_queued_requests,
            api_keys=api_keys,
            max_body_mib=max_body_mib,
            limiter=limiter,
        )
        self.run(self._start(tls))

    async def _start(self, tls: ServerTLS | None) -> None:
        await self.backend.start()
        self.servers = RouterServers(self.frontend, tls)
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


@contextmanager
def serving(engine: Engine, checkpoint: str | Path, **options: Any) -> Iterator[ServerHarness]:
    """A ServerHarness over `engine` (options as ServerHarness takes them) for a fixture's
    lifetime: stopped at the end, then the engine checked for leaked requests and blocks."""
    harness = ServerHarness(engine, checkpoint, **options)
    try:
        yield harness
    finally:
        harness.stop()
    engine.assert_no_leaks()


def post_with_headers(
    harness: LoopThread, path: str, body: dict | bytes | None, method: str = "POST"
) -> tuple[int, dict[str, str], dict]:
    """POST a JSON body (or raw bytes; None and a method: a request without a body) to the
    harness's HTTP server: status, headers and the JSON reply, refusals included."""
    data = body if isinstance(body, bytes | None) else json.dumps(body).encode()
    request = urllib.request.Request(
        harness.base_url + path, data, {"Content-Type": "application/json"}, method=method
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def post(harness: LoopThread, path: str, body: dict | bytes) -> tuple[int, dict]:
    """post_with_headers without the headers."""
    status, _, reply = post_with_headers(harness, path, body)
    return status, reply
