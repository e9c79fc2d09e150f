"""Autoscaler: decides each pool's size from samples of its load (pure: no Ray, no clock of its
own; the controller feeds it samples and applies what it decides). Owns the recent samples of
each pool and when each pool last changed size.

A pool's *pressure* is how full it is against its targets (1.0: at target):
- prefill: prompt tokens queued per ready worker against `target_queued_tokens`;
- decode: the larger of KV blocks in use against `target_kv_fraction`, requests per ready
  worker against `target_batch`, and the handoff backlog (blocks prefilled and leased, not yet
  being read) per ready decode worker against `target_backlog_blocks`.

A pool's *SLO attainment* (optional, None when unknown) is the fraction of its recently
finished requests that met the pool's objective: TTFT for prefill, TPOT for decode.

Rules, for each pool on its own:
- grow by one when every sample of the last `window_s` is above `grow_above`, or when every
  sample of it has an SLO attainment below `target_attainment` and a pressure of at least
  `shrink_below` (a pool busier than that could not shrink back at this load, so this grow is
  not undone; a pool idler than that is not missing its objective for want of workers);
- shrink by one when every sample of the last `window_s` would stay below `shrink_below` with
  one worker fewer (pressure * n / (n - 1)): a shrink that would push the pool back over the
  grow line is never made, so sizes do not flip 2 <-> 1;
- never shrink while a sample of the window has an SLO attainment below `target_attainment`;
- a pool not in `autoscaled` is never resized, nor one of no worker (prefill 0..0: aggregated
  workers); a pool is never
  shrunk to 0 (one worker fewer than one has no pressure to judge);
- never within `cooldown_s` of the pool's last change, never on samples taken within
  `warmup_s` of a worker turning ready (a cold worker's first seconds say nothing), never on a
  window that is not full, never outside [min, max].
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class AutoscaleConfig:
    min_size: dict[str, int] = field(default_factory=lambda: {"prefill": 1, "decode": 1})
    max_size: dict[str, int] = field(default_factory=lambda: {"prefill": 4, "decode": 4})
    window_s: float = 20.0
    cooldown_s: float = 30.0
    warmup_s: float = 10.0
    grow_above: float = 1.0
    shrink_below: float = 0.5
    target_queued_tokens: int = 4096  # per prefill worker
    target_kv_fraction: float = 0.8  # of a decode worker's blocks in use
    target_batch: int = 32  # requests per decode worker
    target_backlog_blocks: int = 256  # leased, unread blocks per decode worker
    target_attainment: float = 0.9  # SLO attainment below this for a whole window: grow
    # the pools it resizes; another keeps the size it is given (serve: a pool without its
    # --autoscale-* flag), its min..max only that size's bounds
    autoscaled: tuple[str, ...] = ROLES

    def __post_init__(self) -> None:
        if not set(self.autoscaled) <= set(ROLES):
            raise ValueError(f"autoscale: pools are {ROLES}, got {self.autoscaled}")
        for role in ROLES:
            low, high = self.min_size.get(role, 0), self.max_size.get(role, 0)
            least = 0 if role == "prefill" and high == 0 else 1  # 0..0: aggregated, stays 0
            if not least <= low <= high:
                raise ValueError(
                    f"autoscale: need {least} <= min <= max for {role}, got {low}..{high}"
                )
        if not 0 < self.shrink_below < self.grow_above:
            raise ValueError("autoscale: need 0 < shrink_below < grow_above")
        if not 0 < self.target_attainment <= 1:
            raise ValueError("autoscale: need 0 < target_attainment <= 1")
        if self.window_s <= 0 or self.cooldown_s < 0 or self.warmup_s < 0:
            raise ValueError("autoscale: window_s must be > 0, cooldown_s and warmup_s >= 0")


@dataclass(frozen=True)
class PoolSample:
    """One pool's load at one moment (sums over its ready workers)."""

    at: float  # seconds on the controller's own monotonic clock (never a worker's)
    role: str
    num_ready: int
    queued_tokens: int = 0
    running: int = 0
    waiting: int = 0
    used_blocks: int = 0
    total_blocks: int = 0
    backlog_blocks: int = 0  # decode: blocks leased on the prefill pool, not yet being read
    newest_ready_at: float | None = None  # when its most recent worker turned ready
    # Of the pool's requests finished recently (e.g. the last window_s), the fraction that met
    # its objective (prefill: TTFT, decode: TPOT); None: none finished, or no SLO was set.
    slo_attainment: float | None = None


@dataclass(frozen=True)
class Decision:
    role: str
    size: int  # the new desired size
    reason: str


class Autoscaler:
    def __init__(self, config: AutoscaleConfig) -> None:
        self.config = config
        self._samples: dict[str, deque[PoolSample]] = {role: deque() for role in ROLES}
        self._last_change: dict[str, float | None] = dict.fromkeys(ROLES)

    def pressure(self, sample: PoolSample, num_workers: int | None = None) -> float:
        """How full the pool is against its targets with `num_workers` (default: its own)."""
        c = self.config
        n = num_workers if num_workers is not None else sample.num_ready
        if n <= 0:
            return float("inf")
        if sample.role == "prefill":
            return sample.queued_tokens / (n * c.target_queued_tokens)
        kv = 0.0
        if sample.total_blocks:
            per_worker = sample.total_blocks / sample.num_ready
            kv = sample.used_blocks / (n * per_worker * c.target_kv_fraction)
        batch = (sample.running + sample.waiting) / (n * c.target_batch)
        backlog = sample.backlog_blocks / (n * c.target_backlog_blocks)
        return max(kv, batch, backlog)

    def observe(self, sample: PoolSample) -> None:
        samples = self._samples[sample.role]
        samples.append(sample)
        # Keep the last sample at or before the window's start: it shows the window is whole.
        while len(samples) > 1 and samples[1].at <= sample.at - self.config.window_s:
            samples.popleft()

    def changed(self, role: str, at: float) -> None:
        """The pool's size was changed (by this autoscaler or an operator) at `at`."""
        self._last_change[role] = at
        self._samples[role].clear()

    def decide(self, role: str, now: float) -> Decision | None:
        """A new size for the pool, or None. The caller applies it and then calls changed()."""
        c = self.config
        if role not in c.autoscaled:
            return None  # its size is the operator's
        last = self._last_change[role]
        if last is not None and now - last < c.cooldown_s:
            return None
        window = list(self._samples[role])
        if not window or window[0].at > now - c.window_s:
            return None  # not a full window yet
        if any(
            s.newest_ready_at is not None and s.at - s.newest_ready_at < c.warmup_s for s in window
        ):
            return None  # a worker is still warming up
        sizes = {s.num_ready for s in window}
        if len(sizes) != 1:
            return None  # the pool changed size inside the window
        (n,) = sizes
        pressures = [self.pressure(s) for s in window]
        if min(pressures) > c.grow_above and n < c.max_size[role]:
            return Decision(role, n + 1, f"pressure {min(pressures):.2f} > {c.grow_above:g}")
        attained = [s.slo_attainment for s in window]
        missing = [a for a in attained if a is not None and a < c.target_attainment]
        busy = min(pressures) >= c.shrink_below
        if len(missing) == len(window) and busy and n < c.max_size[role]:
            return Decision(
                role, n + 1, f"SLO attainment {max(missing):.0%} < {c.target_attainment:.0%}"
            )
        if n > c.min_size[role] and not missing:
            after = [self.pressure(s, n - 1) for s in window]
            if max(after) < c.shrink_below:
                return Decision(
                    role, n - 1, f"pressure with {n - 1}: {max(after):.2f} < {c.shrink_below:g}"
                )
        return None


def slo_attainment(latencies_ms: Sequence[float], objective_ms: float) -> float | None:
    """The fraction of `latencies_ms` at or below `objective_ms`; None when there are none."""
    if not latencies_ms:
        return None
    return sum(value <= objective_ms for value in latencies_ms) / len(latencies_ms)
