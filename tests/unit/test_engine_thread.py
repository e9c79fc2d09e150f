"""EngineThread alone (a stand-in engine): the thread that steps an engine is the one that built
it, a failed build raises in the caller, commands wait for serve(), a stop before serve() fails
them, a loop iteration that keeps failing backs off and is logged once a minute."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine.engine_thread import EngineThread, LoopFailures


class StandIn:
    """What EngineThread uses of an Engine: whether it has work, a step, its step counter."""

    def __init__(self) -> None:
        self.built_on = threading.get_ident()
        self.stepped_on: set[int] = set()
        self.pending = 2  # steps before it has no unfinished request
        self.stats = type("Stats", (), {"num_steps": 0})()

    @property
    def has_unfinished_requests(self) -> bool:
        return self.pending > 0

    def step(self) -> list[str]:
        self.stepped_on.add(threading.get_ident())
        self.pending -= 1
        self.stats.num_steps += 1
        return [f"out{self.pending}"]


def test_the_engine_is_built_and_stepped_on_the_same_thread_not_the_callers() -> None:
    outputs: list[list[str]] = []
    thread = EngineThread(StandIn)  # type: ignore[arg-type]
    engine: StandIn = thread.engine  # type: ignore[assignment]
    assert engine.built_on != threading.get_ident()
    assert engine.stepped_on == set()  # nothing steps before serve()

    async def run() -> int:
        thread.serve(outputs.append)
        await thread.call(lambda e: None)  # runs after the queued steps' iteration
        while engine.pending > 0:
            await asyncio.sleep(0.01)
        return await thread.call(lambda e: threading.get_ident())

    command_thread = asyncio.run(run())
    thread.stop()
    assert engine.stepped_on == {engine.built_on} == {command_thread}
    assert outputs == [["out1"], ["out0"]]


def test_a_failed_build_raises_in_the_caller_and_leaves_no_thread() -> None:
    def build() -> StandIn:
        raise RuntimeError("no GPU memory for the KV pool")

    before = threading.active_count()
    with pytest.raises(RuntimeError, match="no GPU memory"):
        EngineThread(build)  # type: ignore[arg-type]
    assert threading.active_count() == before


def test_commands_wait_for_serve_and_a_stop_before_it_fails_them() -> None:
    thread = EngineThread(StandIn)  # type: ignore[arg-type]
    results: list[tuple[object, BaseException | None]] = []
    thread.submit(lambda e: "ran", lambda result, error: results.append((result, error)))
    assert thread.is_alive() and results == []  # queued: the thread waits for serve()
    thread.stop()
    assert not thread.is_alive()
    assert len(results) == 1 and results[0][0] is None
    assert "stopped" in str(results[0][1])


class FailingOnce(StandIn):
    """Its first step raises with two requests running; fail_running ends them."""

    def __init__(self) -> None:
        super().__init__()
        self.failed = False
        self.running = ["a", "b"]

    def step(self) -> list[str]:
        if not self.failed:
            self.failed = True
            raise RuntimeError("a bug in the step")
        return super().step()

    def fail_running(self) -> list[str]:
        ended, self.running = self.running, []
        return ended


def test_a_step_that_raises_ends_its_requests_and_the_thread_steps_on() -> None:
    outputs: list[list[str]] = []
    failures: list[tuple[list[str], str]] = []
    thread = EngineThread(FailingOnce)  # type: ignore[arg-type]
    engine: FailingOnce = thread.engine  # type: ignore[assignment]

    async def run() -> None:
        thread.serve(outputs.append, on_failed=lambda ids, error: failures.append((ids, error)))
        while engine.pending > 0:
            await asyncio.sleep(0.01)

    asyncio.run(run())
    thread.stop()
    assert failures == [(["a", "b"], "the engine's step failed: RuntimeError('a bug in the step')")]
    assert outputs == [["out1"], ["out0"]]  # the steps after it ran


def test_a_loop_that_fails_every_iteration_backs_off_and_logs_once_a_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    failures = LoopFailures(clock=lambda: now[0])
    with caplog.at_level("ERROR", logger="engine.engine_thread"):
        waits = [failures.failed(ValueError(f"bad {i}")) for i in range(10)]
        assert len(caplog.records) == 1 and caplog.records[0].exc_info is not None  # traceback
        now[0] = 61.0
        failures.failed(ValueError("bad 10"))
        assert "failed 10 more times, 11 in a row (latest: ValueError('bad 10'))" in caplog.text
        # Failures apart (a success between them): each a run of its own, counted till the next
        # minute, whose line says how many came since the last one.
        for i in range(6):
            failures.ok()
            now[0] += 10.0
            failures.failed(ValueError(f"apart {i}"))
        assert len(caplog.records) == 3
        assert caplog.records[-1].getMessage().endswith("(5 more since the last line)")
    assert waits[:3] == [0.01, 0.02, 0.04] and waits[-1] == LoopFailures.BACKOFF_MAX_S
    failures.ok()  # an iteration that succeeds: the next failure backs off from the start
    assert failures.failed(ValueError("again")) == 0.01


def test_a_tick_that_always_raises_is_backed_off_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    three = threading.Event()
    ticks = []

    def tick() -> bool:
        ticks.append(1)
        if len(ticks) >= 3:
            three.set()
        raise RuntimeError("an id Redis cannot encode")

    with caplog.at_level("ERROR", logger="engine.engine_thread"):
        thread = EngineThread(StandIn)  # type: ignore[arg-type,return-value]
        thread.serve(lambda outputs: None, tick)
        assert three.wait(30)
        thread.stop()
    failures = thread._loop_failures
    assert failures.num_failures >= 3  # in a row, each backed off (no success between)
    assert len([r for r in caplog.records if r.exc_info]) == 1  # one traceback, not one each
