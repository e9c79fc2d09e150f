"""CostGuard: whether speculative decoding pays on this engine, measured. It owns the running
means of wall seconds per generated token of decode steps in each mode and the current mode.

It measures speculating for a window of steps, then not speculating (plain decode steps, run
ahead of the host), keeps the cheaper mode for `hold` steps (measuring it meanwhile), then
measures the other mode for a window again. Steps that are mostly prefill are not counted
(callers pass only decode-dominated steps).
"""

from __future__ import annotations


class CostGuard:
    def __init__(self, window: int = 16, hold: int = 256):
        self.window, self.hold = window, hold
        self.speculating = True  # the mode now
        self.cost: dict[bool, float | None] = {True: None, False: None}  # s per token, by mode
        self._measuring = True  # a window (the mode's first measure) rather than a hold
        self._left = window
        self._seconds, self._tokens = 0.0, 0
        self.num_switches = 0

    def observe(self, seconds: float, num_tokens: int) -> None:
        """One decode step of the current mode: its wall time and the tokens it generated."""
        if num_tokens <= 0:
            return
        self._seconds += seconds
        self._tokens += num_tokens
        self._left -= 1
        if self._left > 0:
            return
        self.cost[self.speculating] = self._seconds / self._tokens
        self._seconds, self._tokens = 0.0, 0
        other = self.cost[not self.speculating]
        if self._measuring and other is not None:  # both measured: keep the cheaper
            spec, plain = self.cost[True], self.cost[False]
            assert spec is not None and plain is not None
            self._switch_to(spec <= plain, measuring=False, steps=self.hold)
        else:  # the first window, or a hold ended: measure the other mode
            self._switch_to(not self.speculating, measuring=True, steps=self.window)

    def _switch_to(self, speculating: bool, measuring: bool, steps: int) -> None:
        self.num_switches += speculating != self.speculating
        self.speculating, self._measuring, self._left = speculating, measuring, steps
