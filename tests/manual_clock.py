"""ManualClock: a clock (a callable returning seconds) that moves only when a test sets `now`;
it owns that one time."""

from __future__ import annotations


class ManualClock:
    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now
