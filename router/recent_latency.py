"""RecentLatencies: the time to first token and time per output token of the requests one router
finished in the last few seconds, and the fraction of them that met the cluster's objectives
(what the controller's autoscaler reads as SLO attainment). Owns that window only.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from common.cluster_state import SloAttainment
from common.placement_rules import SloTargets

WINDOW_S = 10.0


class _Finished(NamedTuple):
    at: float  # time.monotonic() when it finished
    ttft_s: float
    tpot_s: float | None  # None: one output token


class RecentLatencies:
    """Invariant: holds only requests that finished within `window_s` of the newest call."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._finished: deque[_Finished] = deque()

    def record(self, now: float, ttft_s: float, tpot_s: float | None) -> None:
        self._finished.append(_Finished(now, ttft_s, tpot_s))
        self._expire(now)

    def attainment(self, now: float, slo: SloTargets) -> SloAttainment | None:
        """None without objectives; each fraction None when nothing it judges finished."""
        if not slo.enabled:
            return None
        self._expire(now)
        rows = list(self._finished)
        ttft = [r.ttft_s <= slo.ttft_ms / 1000 for r in rows] if slo.ttft_ms > 0 else []
        tpots = [r.tpot_s for r in rows if r.tpot_s is not None]
        tpot = [t <= slo.tpot_ms / 1000 for t in tpots] if slo.tpot_ms > 0 else []
        return SloAttainment(len(ttft), _fraction(ttft), len(tpot), _fraction(tpot))

    def _expire(self, now: float) -> None:
        while self._finished and now - self._finished[0].at > self.window_s:
            self._finished.popleft()


def _fraction(met: list[bool]) -> float | None:
    return sum(met) / len(met) if met else None
