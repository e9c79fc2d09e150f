"""BlockReads: one tier's block-file reads running behind the step. It owns a reader thread (with
a files object of its own: its own NIXL agent and staging row, never the one spill writes use),
the reads in flight and the questions in flight (whether the tier has a block: the shared
store's lookups, one round trip each on an object store); a read's result (the checked payload,
or the error of a file that must not be loaded) and a question's answer wait here until the
engine thread collects them. Torch-free: a payload is opaque.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import NamedTuple


class Landed(NamedTuple):
    """A read that finished: its payload, or the error that keeps the file from being loaded."""

    block_hash: int
    payload: object
    error: BaseException | None
    seconds: float  # spent reading and checking it (the tier's load cost)


class Answer(NamedTuple):
    """Whether the tier has a block, as the reader thread found (False when it could not ask)."""

    block_hash: int
    present: bool
    seconds: float  # the question's round trip


def _timed(read: Callable[[int], object], block_hash: int) -> tuple[object, float]:
    start = time.perf_counter()
    return read(block_hash), time.perf_counter() - start


def _take_done(
    pending: dict[int, Future[tuple[object, float]]],
) -> list[tuple[int, tuple[object, float], BaseException | None]]:
    """The done futures of pending, taken out in the order they were issued: (hash, its
    (result, seconds) or (None, 0.0), its error or None)."""
    done = []
    for block_hash, future in list(pending.items()):
        if future.done():
            del pending[block_hash]
            error = future.exception()
            done.append((block_hash, future.result() if error is None else (None, 0.0), error))
    return done


class BlockReads:
    """Reads issued by the engine thread (start), done by one reader thread in order, collected
    by the engine thread (collect) between steps; only collect changes what a tier holds."""

    def __init__(
        self,
        read: Callable[[int], object],
        name: str,
        exists: Callable[[int], bool] | None = None,
    ):
        """read: the reader's own files' read (raises for a bad or missing file); exists: its
        files' question whether a block is there (None: ask() is not offered)."""
        self._read = read
        self._exists = exists
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._in_flight: dict[int, Future[tuple[object, float]]] = {}
        self._asked: dict[int, Future[tuple[object, float]]] = {}
        self.num_issued = 0
        self.num_asked = 0

    @property
    def can_ask(self) -> bool:
        return self._exists is not None

    def ask(self, block_hash: int) -> None:
        """Ask behind the step whether the tier has block_hash (once while unanswered)."""
        assert self._exists is not None, "ask() needs an exists callable"
        if block_hash not in self._asked:
            self._asked[block_hash] = self._pool.submit(_timed, self._exists, block_hash)
            self.num_asked += 1

    def answers(self) -> list[Answer]:
        """The questions answered since the last call (one that raised: not there)."""
        return [
            Answer(block_hash, False, 0.0)
            if error is not None
            else Answer(block_hash, bool(result[0]), result[1])
            for block_hash, result, error in _take_done(self._asked)
        ]

    def start(self, block_hash: int) -> None:
        """Read block_hash's file behind the step (once: a read in flight is not issued again)."""
        if block_hash not in self._in_flight:
            self._in_flight[block_hash] = self._pool.submit(_timed, self._read, block_hash)
            self.num_issued += 1

    def in_flight(self, block_hash: int) -> bool:
        """Its read, or the question whether the tier has it, is not collected yet."""
        return block_hash in self._in_flight or block_hash in self._asked

    def reading(self, block_hash: int) -> bool:
        return block_hash in self._in_flight

    @property
    def num_in_flight(self) -> int:
        """Reads and questions not collected yet."""
        return len(self._in_flight) + len(self._asked)

    def collect(self) -> list[Landed]:
        """The reads done since the last call, in the order they were issued."""
        return [
            Landed(block_hash, None, error, 0.0)
            if error is not None
            else Landed(block_hash, result[0], None, result[1])
            for block_hash, result, error in _take_done(self._in_flight)
        ]

    def wait_any(self, timeout_s: float) -> None:
        """Block until a read or question in flight is done (or timeout_s): when no step has
        work."""
        pending = [*self._in_flight.values(), *self._asked.values()]
        if pending:
            wait(pending, timeout_s, FIRST_COMPLETED)

    def close(self) -> None:
        """Stop the reader: the read running finishes, those not started are dropped (as are
        the results not collected)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._in_flight.clear()
        self._asked.clear()
