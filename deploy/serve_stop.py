"""How `kvrelay serve` and `kvrelay router` come to a stop: StopSignals (owns the two events
Ctrl-C and SIGTERM set: stop, then stop now), the watch on serve's embedded Ray, the drain with
its deadline and the servers' close (holds no state of its own: the backend's gate refuses and
ends requests, the frontend counts them)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from common import tracing

if TYPE_CHECKING:
    from router.admission import Admission
    from router.cluster_backend import ClusterBackend
    from router.serve import RouterServers

logger = logging.getLogger(__name__)
DEFAULT_DRAIN_S = 5.0  # --drain-seconds
SERVERS_STOP_S = 10.0  # the HTTP and gRPC servers close within this, open connections or not
WATCH_S = 0.5  # how often the embedded Ray's raylet and GCS server are looked at
FINAL_WRITE_S = 5.0  # after the streams were ended: time for their last events to be written
SHUTTING_DOWN = "the server is shutting down"
T = TypeVar("T")


class StopSignals:
    """The first SIGINT or SIGTERM sets `stop` (drain, then stop); another sets `now` too (end
    the open requests at once)."""

    def __init__(self) -> None:
        self.stop = asyncio.Event()
        self.now = asyncio.Event()

    def install(self) -> None:
        """Take SIGINT and SIGTERM on the running loop. Call again after ray.init(), which puts
        a SIGTERM handler of its own (sys.exit) in place of this one."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal)

    def _on_signal(self) -> None:
        if self.stop.is_set():
            self.now.set()
        self.stop.set()


INTERRUPTED = 130  # exit status of a start-up stopped by Ctrl-C or SIGTERM (128 + SIGINT)


class StartInterrupted(Exception):
    """Ctrl-C or SIGTERM came while `kvrelay serve` (or `kvrelay router`) was starting."""


async def start_unless_stopped(signals: StopSignals, start: Awaitable[T]) -> T:
    """Await `start` unless a stop signal comes first: then it is cancelled (waited for, so that
    what it was doing unwinds) and StartInterrupted is raised; the caller stops what started."""
    task = asyncio.ensure_future(start)
    stop = asyncio.ensure_future(signals.stop.wait())
    try:
        await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):  # its own end, cancelled or failing
                await task
    if signals.stop.is_set():  # even when it finished as the signal came: stop it all
        if not task.cancelled():
            task.exception()  # retrieved: a failure the signal cut short is not logged as lost
        raise StartInterrupted
    return task.result()


async def until_stop_or_lost(signals: StopSignals, lost: Callable[[], str | None]) -> str | None:
    """Wait for a stop signal (returns None) or for the cluster to be lost (returns why)."""
    while not signals.stop.is_set():
        why = lost()
        if why is not None:
            return why
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(signals.stop.wait(), WATCH_S)
    return None


async def drain(
    backend: ClusterBackend,
    admission: Admission,
    drain_s: float,
    now: asyncio.Event,
    say: Callable[[str], None],
) -> None:
    """New requests get 503 at once; the open ones (those the Frontend's Admission holds) have
    `drain_s` seconds (less if `now` is set) to finish, then each open stream ends with
    finish_reason "abort" and is given FINAL_WRITE_S to send it."""
    backend.stop_taking(SHUTTING_DOWN)
    num_open = admission.num_admitted
    if num_open:
        say(
            f"kvrelay: shutting down: new requests get 503; {num_open} open request(s) may "
            f"finish within {drain_s:g} s (Ctrl-C again to end them now)"
        )
    else:
        say("kvrelay: shutting down")
    if await _first(admission.drained(), now.wait(), timeout_s=drain_s) and not now.is_set():
        return
    num_open = admission.num_admitted
    if not num_open:
        return
    why = f"{SHUTTING_DOWN} (--drain-seconds {drain_s:g} passed)"
    backend.end_streams(why if not now.is_set() else f"{SHUTTING_DOWN} (stopped at once)")
    say(f"kvrelay: ended {num_open} open request(s) with finish_reason abort")
    if not await _first(admission.drained(), timeout_s=FINAL_WRITE_S):
        say(f"kvrelay: {admission.num_admitted} request(s) still open; closing their connections")


async def refuse_while_lost(
    backend: ClusterBackend,
    why: str,
    drain_s: float,
    now: asyncio.Event,
    say: Callable[[str], None],
) -> None:
    """The cluster cannot serve (its Ray is gone, or its controller died and its workers with
    it): one line says so; open streams end with an error, and /ready and new requests answer
    503 naming the cause for `drain_s` seconds (less if `now` is set), so that clients and load
    balancers see why before the port closes."""
    say(f"kvrelay: {why}; stopping with exit status 1")
    backend.lose_cluster(why)
    await _first(now.wait(), timeout_s=drain_s)


async def close_servers(servers: RouterServers) -> None:
    """Close the HTTP and gRPC servers, within SERVERS_STOP_S whatever their connections, then
    send the router's last spans (when tracing)."""
    try:
        await asyncio.wait_for(servers.stop(), SERVERS_STOP_S)
    except TimeoutError:
        logger.warning("the servers did not close in %.0f s", SERVERS_STOP_S)
    await asyncio.to_thread(tracing.shutdown)


async def _first(*waits: Awaitable[Any], timeout_s: float) -> bool:
    """Whether any of `waits` finished within timeout_s (the others are cancelled)."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        done, _ = await asyncio.wait(tasks, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
    return bool(done)
