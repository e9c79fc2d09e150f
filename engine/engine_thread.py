"""EngineThread: builds one Engine on its own thread, steps it there and lets asyncio code talk
to it safely.

It owns the thread and a command queue. Commands (callables taking the engine) run between
steps on the engine's thread, so the engine is never touched from two threads. After each
step `on_outputs` gets the step's outputs; `on_tick` runs every iteration (poll transfers,
publish events); a step that raises ends the requests it ran (Engine.fail_running) and
`on_failed` gets their ids, so they are answered with an error instead of waiting for good
(each later step met the same failure). No Ray, gRPC or Redis here: workers supply those
through the callbacks.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from engine.engine import Engine
from engine.parallel.leader import RankLost
from engine.step.step_types import RequestOutput

logger = logging.getLogger(__name__)
T = TypeVar("T")

Command = Callable[[Engine], Any]
Done = Callable[[Any, BaseException | None], None]
Failed = Callable[[list[str], str], None]  # the requests a failed step ended, and why


class LoopFailures:
    """An engine loop iteration that raised (a tick's publish to Redis, a command's callback):
    the first traceback is logged, then one line a minute with how many more there were, and
    the loop backs off (BACKOFF_S, doubling to BACKOFF_MAX_S) until an iteration succeeds,
    instead of spinning and logging each (a failure that recurs every iteration filled a log
    with a gigabyte of tracebacks in minutes). Owns the counts and the backoff."""

    BACKOFF_S = 0.01
    BACKOFF_MAX_S = 1.0
    LOG_EVERY_S = 60.0

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self.num_failures = 0  # in a row
        self.num_unlogged = 0
        self._logged_at = float("-inf")

    def failed(self, error: Exception) -> float:
        """Log (or count) the failure; returns how long to back off."""
        self.num_failures += 1
        now = self._clock()
        if now - self._logged_at < self.LOG_EVERY_S:
            self.num_unlogged += 1
        elif self.num_failures == 1:  # a new run of failures: its traceback
            since = f" ({self.num_unlogged} more since the last line)" if self.num_unlogged else ""
            logger.error("engine loop iteration failed%s", since, exc_info=error)
            self._logged_at, self.num_unlogged = now, 0
        else:
            logger.error(
                "engine loop iteration failed %d more times, %d in a row (latest: %r)",
                self.num_unlogged + 1,
                self.num_failures,
                error,
            )
            self._logged_at, self.num_unlogged = now, 0
        return min(self.BACKOFF_MAX_S, self.BACKOFF_S * 2 ** (self.num_failures - 1))

    def ok(self) -> None:
        self.num_failures = 0


class EngineThread:
    engine: Engine

    def __init__(self, build: Callable[[], Engine], idle_wait_s: float = 0.05):
        """Start the thread and build the engine on it, then return (raising what the build
        raised). The thread that steps an engine builds it: on CUDA, what a thread meets the
        first time (per-thread library handles and workspaces) is met in the engine's start-up
        warm-up, not in its first served steps (~200 ms each on an H100 for the first prompt-
        only and first mixed step when built on another thread, bench/RESULTS.md). Commands
        queue until serve()."""
        self._idle_wait_s = idle_wait_s
        self._commands: queue.SimpleQueue[
            tuple[Command, Callable[[Any, BaseException | None], None]]
        ]
        self._commands = queue.SimpleQueue()
        self._stop = threading.Event()
        self._serving = threading.Event()  # set by serve() or stop()
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self._on_outputs: Callable[[list[RequestOutput]], None] = lambda outputs: None
        self._on_tick: Callable[[], bool] = lambda: False
        self._on_failed: Failed = lambda req_ids, error: None
        self._loop_failures = LoopFailures()
        self._thread = threading.Thread(
            target=self._run, args=(build,), name="kvrelay-engine", daemon=True
        )
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            self._thread.join()
            raise self._build_error

    def serve(
        self,
        on_outputs: Callable[[list[RequestOutput]], None],
        on_tick: Callable[[], bool] | None = None,
        on_failed: Failed | None = None,
    ) -> None:
        """Start stepping. After each step on_outputs gets its outputs; on_tick runs every
        iteration and returns True while it has work in flight (the thread then polls
        quickly); on_failed gets the ids of the requests a step that raised ended, and the
        error."""
        self._on_outputs = on_outputs
        self._on_tick = on_tick or (lambda: False)
        self._on_failed = on_failed or (lambda req_ids, error: None)
        self._serving.set()

    def submit(self, command: Command, done: Done) -> None:
        """Queue a command; once the thread has stopped, `done` gets a RuntimeError instead."""
        self._commands.put((command, done))
        if self._stop.is_set() and not self._thread.is_alive():
            self._fail_queued()

    async def call(self, command: Callable[[Engine], T]) -> T:
        """Run command(engine) on the engine thread and return its result here."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def done(result: Any, error: BaseException | None) -> None:
            def settle() -> None:
                if future.done():
                    return
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(result)

            loop.call_soon_threadsafe(settle)

        self.submit(command, done)
        return await future

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._serving.set()
        self._commands.put((lambda engine: None, lambda result, error: None))
        self._thread.join(timeout_s)

    def _run_commands(self, block_s: float) -> None:
        try:
            item = (
                self._commands.get(timeout=block_s) if block_s > 0 else self._commands.get_nowait()
            )
        except queue.Empty:
            return
        while True:
            command, done = item
            try:
                result, error = command(self.engine), None
            except Exception as e:  # the caller gets it; the engine keeps serving
                result, error = None, e
            done(result, error)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _run(self, build: Callable[[], Engine]) -> None:
        try:
            self.engine = build()
        except BaseException as e:  # __init__ raises it in the caller's thread
            self._build_error = e
            return
        finally:
            self._built.set()
        self._serving.wait()
        busy = False
        while not self._stop.is_set():
            try:
                idle = not busy and not self.engine.has_unfinished_requests
                self._run_commands(self._idle_wait_s if idle else 0)
                busy = self._on_tick()
                steps_before = self.engine.stats.num_steps
                if self.engine.has_unfinished_requests:
                    outputs = self._step()
                    if outputs:
                        self._on_outputs(outputs)
                if busy and self.engine.stats.num_steps == steps_before:
                    self._stop.wait(0.0005)  # only transfers in flight: poll them gently
            except Exception as e:
                self._stop.wait(self._loop_failures.failed(e))  # no spinning on a failure
            else:
                self._loop_failures.ok()
        self._fail_queued()

    def _step(self) -> list[RequestOutput]:
        """engine.step(); one that raises ends the requests it ran (a tensor-parallel rank's
        loss has ended them all already and is raised on)."""
        try:
            return self.engine.step()
        except RankLost:
            raise
        except Exception as e:
            logger.exception("an engine step failed; the requests it ran end with an error")
            failed = self.engine.fail_running()
            if failed:
                self._on_failed(failed, f"the engine's step failed: {e!r}")
            return []

    def _fail_queued(self) -> None:
        """Commands that arrived too late to run get an error rather than waiting forever."""
        while True:
            try:
                _, done = self._commands.get_nowait()
            except queue.Empty:
                return
            done(None, RuntimeError("the engine thread has stopped"))
