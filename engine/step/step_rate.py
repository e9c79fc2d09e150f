"""StepRate: how fast an engine's recent steps ran (wall time per step, tokens computed per
second), as decayed sums over its busy steps; owns only those sums. Pure, no torch.

Routers predict a request's time to first token from a prefill worker's queued tokens and its
token rate, and its time per output token from a decode worker's step time (router/slo.py).
Idle time is not a step, so an idle worker keeps the figures of its last busy steps.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_DECAY = 0.9  # per step: the figures follow roughly the last ten steps


@dataclass
class StepRate:
    """Invariants: the sums are >= 0; both are 0 until the first step is recorded."""

    decay: float = DEFAULT_DECAY
    _seconds: float = 0.0
    _tokens: float = 0.0
    _steps: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {self.decay}")

    def record(self, seconds: float, num_tokens: int) -> None:
        """One step that took `seconds` of wall time and ran `num_tokens` through the model."""
        if seconds < 0 or num_tokens < 0:
            raise ValueError(f"a step cannot take {seconds} s for {num_tokens} tokens")
        self._seconds = self._seconds * self.decay + seconds
        self._tokens = self._tokens * self.decay + num_tokens
        self._steps = self._steps * self.decay + 1.0

    @property
    def tokens_per_s(self) -> float:
        """Tokens computed per second of stepping (0: nothing measured yet)."""
        return self._tokens / self._seconds if self._seconds > 0 else 0.0

    @property
    def step_s(self) -> float:
        """Mean wall time of a recent step (0: nothing measured yet)."""
        return self._seconds / self._steps if self._steps > 0 else 0.0
