"""Times Python's cyclic garbage collections by generation while it is installed (a
gc.callbacks entry); owns the durations it collected.

    with GcPauses() as pauses:
        ...
    pauses.summary()  # {generation: {"count", "total_ms", "max_ms"}}
"""

from __future__ import annotations

import gc
import time
from typing import Any


class GcPauses:
    """Each collection's duration, by generation, between __enter__ and __exit__."""

    def __init__(self) -> None:
        self.pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.pauses[info["generation"]].append(time.perf_counter() - self._start)

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)

    def summary(self) -> dict[int, dict[str, float]]:
        """Per generation: how many collections, their total and longest ms."""
        return {
            g: {"count": len(p), "total_ms": sum(p) * 1e3, "max_ms": max(p, default=0.0) * 1e3}
            for g, p in self.pauses.items()
        }
