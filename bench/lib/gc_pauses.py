"""Times Python's cyclic garbage collections by generation while it is installed (a
gc.callbacks entry); owns the durations it collected.

    with GcPauses() as pauses:
        ...
    pauses.summary()  # {generation: {"count", "total_ms", "max_ms"}}

GcPauses(counting=False) counts only inside `with pauses.counting():` (say, the engine's
steps, and not the profiling around them).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class GcPauses:
    """Each collection's duration, by generation, between __enter__ and __exit__."""

    def __init__(self, counting: bool = True) -> None:
        self.pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}
        self._counting = counting
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._counting:
            self.pauses[info["generation"]].append(time.perf_counter() - self._start)

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)

    @contextmanager
    def counting(self) -> Iterator[None]:
        """Count the collections that end inside this block."""
        before, self._counting = self._counting, True
        try:
            yield
        finally:
            self._counting = before

    def summary(self) -> dict[int, dict[str, float]]:
        """Per generation: how many collections, their total and longest ms."""
        return {
            g: {"count": len(p), "total_ms": sum(p) * 1e3, "max_ms": max(p, default=0.0) * 1e3}
            for g, p in self.pauses.items()
        }
