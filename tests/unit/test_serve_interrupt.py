"""Ctrl-C (SIGINT) or SIGTERM while `kvrelay serve` (or `kvrelay router`) starts: the start is
cancelled at once, what it started is stopped through the cluster's (the backends') close(), and
it exits 130 saying so (not after the whole start-up and its banner)."""

from __future__ import annotations

import asyncio
import os
import signal
from typing import ClassVar

import pytest

from deploy import serve as serve_module
from deploy.local_cluster import ClusterSpec
from deploy.router_flags import RouterOptions
from deploy.serve_stop import StartInterrupted, StopSignals, start_unless_stopped

HANG_GUARD_S = 20.0  # only a serve that ignores the signal waits this long (and fails)


class StartingCluster:
    """A cluster whose start never ends by itself (workers joining); records what happened."""

    instances: ClassVar[list[StartingCluster]] = []

    def __init__(self, spec: ClusterSpec) -> None:
        self.starting = asyncio.Event()
        self.cancelled = self.closed = False
        StartingCluster.instances.append(self)

    async def start(self, progress, on_ray_init=None) -> StartingCluster:
        if on_ray_init is not None:
            on_ray_init()
        self.starting.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        return self

    async def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_start_up_stops_it_and_what_started(
    sig: signal.Signals, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(serve_module, "LocalCluster", StartingCluster)
    StartingCluster.instances.clear()

    async def run() -> int:
        task = asyncio.create_task(
            serve_module._serve(ClusterSpec(), RouterOptions(), "127.0.0.1", 0, 0, None, 0.0)
        )
        while not StartingCluster.instances:
            await asyncio.sleep(0)
        await StartingCluster.instances[0].starting.wait()
        os.kill(os.getpid(), sig)
        return await asyncio.wait_for(task, HANG_GUARD_S)

    assert asyncio.run(run()) == serve_module.INTERRUPTED == 130
    cluster = StartingCluster.instances[0]
    assert cluster.cancelled and cluster.closed
    err = capsys.readouterr().err
    assert "kvrelay: start-up interrupted; stopping what started" in err
    assert "serving" not in err  # no banner


def test_start_unless_stopped_returns_what_a_start_uninterrupted_returns() -> None:
    async def run() -> None:
        signals = StopSignals()
        assert await start_unless_stopped(signals, asyncio.sleep(0, "started")) == "started"
        signals.stop.set()  # set before it finishes: interrupted all the same
        with pytest.raises(StartInterrupted):
            await start_unless_stopped(signals, asyncio.sleep(0, "started"))

    asyncio.run(run())


class BuiltBackend:
    """A model's router backend that was built; records its close()."""

    index = None

    def __init__(self) -> None:
        self.closed = False

    async def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_a_routers_start_up_stops_it(
    sig: signal.Signals,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`kvrelay router` for two models: the first model's backend is built, the second's never
    finishes; the signal cancels it, closes the first, and the router exits 130 with no banner."""
    from deploy import ops_cli, router_launch

    first, hanging = BuiltBackend(), asyncio.Event()

    async def build_backend(controller: str, router_id: str) -> tuple[BuiltBackend, None]:
        if controller == "m1":
            return first, None
        hanging.set()
        await asyncio.Event().wait()  # never built
        raise AssertionError("unreachable")

    monkeypatch.setattr(router_launch, "build_backend", build_backend)

    async def run() -> int:
        task = asyncio.create_task(
            ops_cli._router(["m1", "m2"], RouterOptions(), "127.0.0.1", 0, 0)  # type: ignore[list-item]
        )
        await hanging.wait()
        os.kill(os.getpid(), sig)
        return await asyncio.wait_for(task, HANG_GUARD_S)

    assert asyncio.run(run()) == 130
    assert first.closed
    err = capsys.readouterr().err
    assert "router start-up interrupted" in err and "serving" not in err
