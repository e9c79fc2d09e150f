"""Expiries: the retention priorities that hold only for a while (a kv_retention range with
duration_s). It owns, for one tier, which keys (device block ids, host or disk block hashes)
hold their priority until when and what they fall back to, as a heap by deadline; the tier
applies what is due before it evicts, and hands a key's deadline on with the block when the
block moves to a slower tier. Pure Python.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Hashable
from typing import Generic, NamedTuple, TypeVar

K = TypeVar("K", bound=Hashable)


class Held(NamedTuple):
    """A priority held until `until` (on the tiers' clock), then `then`."""

    until: float
    then: int


def lasting(priority: int, held: Held | None) -> int:
    """The priority that outlives a hold (and this process: what a file records)."""
    return priority if held is None else held.then


class Expiries(Generic[K]):
    """Deadlines by key; at most one current a key (a newer hold or a cancel voids the old)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._heap: list[tuple[float, int, K]] = []
        self._current: dict[K, tuple[int, Held]] = {}  # key -> (its heap entry's seq, held)
        self._seqs = itertools.count(1)

    def __len__(self) -> int:
        return len(self._current)

    @property
    def num_entries(self) -> int:
        """Heap entries, voided ones included (bounded by 2 x len + 65)."""
        return len(self._heap)

    def hold(self, key: K, held: Held) -> None:
        seq = next(self._seqs)
        self._current[key] = (seq, held)
        heapq.heappush(self._heap, (held.until, seq, key))
        if len(self._heap) > 2 * len(self._current) + 64:  # voided entries: drop them
            self._heap = [e for e in self._heap if self._is_current(e)]
            heapq.heapify(self._heap)

    def cancel(self, key: K) -> Held | None:
        """Forget key's deadline; returns it (None: it had none)."""
        entry = self._current.pop(key, None)
        return None if entry is None else entry[1]

    def keys(self) -> list[K]:
        return list(self._current)

    def held(self, key: K) -> Held | None:
        entry = self._current.get(key)
        return None if entry is None else entry[1]

    def due(self) -> list[tuple[K, int]]:
        """(key, the priority it falls back to) of every deadline passed, each forgotten."""
        now, out = self.clock(), []
        while self._heap and self._heap[0][0] <= now:
            entry = heapq.heappop(self._heap)
            if self._is_current(entry):
                out.append((entry[2], self._current.pop(entry[2])[1].then))
        return out

    def _is_current(self, entry: tuple[float, int, K]) -> bool:
        current = self._current.get(entry[2])
        return current is not None and current[0] == entry[1]
