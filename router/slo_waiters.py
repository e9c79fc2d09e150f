"""SloWaiters: owns the count, by priority, of the requests one Placer holds back for its
objectives (SloTargets.overload "queue"), so that a request of lower priority is not placed
while one of higher priority waits for the same pools (it waits too, and the higher one takes
the room that frees first)."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator


class SloWaiters:
    """Invariant: each priority's count is the number of `waiting` blocks open for it (no
    zero entries)."""

    def __init__(self) -> None:
        self._counts: Counter[int] = Counter()

    @contextlib.contextmanager
    def waiting(self, priority: int) -> Iterator[None]:
        """A request of `priority` waits for the objectives while the block runs."""
        self._counts[priority] += 1
        try:
            yield
        finally:
            self._counts[priority] -= 1
            if not self._counts[priority]:
                del self._counts[priority]

    def num_above(self, priority: int) -> int:
        """Requests waiting whose priority is higher than `priority`."""
        return sum(n for p, n in self._counts.items() if p > priority)
