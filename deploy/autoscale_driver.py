"""AutoscaleDriver: the controller's autoscale hook. Once a second it samples each pool's load
from its ready workers' own stats (and its SLO attainment from the routers' reports) and
applies the Autoscaler's decisions through the controller. Owns the Autoscaler (its samples,
each pool's last change) and when it last sampled.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Protocol

from common.worker_actors import WorkerActor
from common.worker_stats import gather_stats
from deploy.autoscale import ROLES, AutoscaleConfig, Autoscaler, Decision, PoolSample

logger = logging.getLogger(__name__)
SAMPLE_S = 1.0


class Pools(Protocol):
    """What the driver needs of the controller."""

    def ready_workers(self, role: str) -> list[tuple[WorkerActor, float]]:
        """(actor, when the controller saw it turn ready, on its monotonic clock) of each."""

    def settled(self, role: str) -> bool:
        """Desired == ready, nothing joining or draining."""

    def slo_attainment(self, role: str) -> float | None:
        """The routers' recent requests against the pool's objective (None: unknown)."""

    def resize(self, role: str, size: int, reason: str) -> bool:
        """Apply a decision; False when the controller held the pool (past its capacity)."""


class AutoscaleDriver:
    def __init__(self, config: AutoscaleConfig) -> None:
        self.scaler = Autoscaler(config)
        self._last_sample: float | None = None

    def operator_changed(self, role: str, now: float) -> None:
        """`kvrelay scale` set the pool's size: that counts as a change (its cooldown)."""
        self.scaler.changed(role, now)

    async def tick(self, pools: Pools, now: float) -> list[Decision]:
        """Sample (at most once per SAMPLE_S) and apply what the autoscaler decides."""
        if self._last_sample is not None and now - self._last_sample < SAMPLE_S:
            return []
        self._last_sample = now
        ready = {role: pools.ready_workers(role) for role in ROLES}
        asked = {f"{role}-{i}": a for role in ROLES for i, (a, _) in enumerate(ready[role])}
        answered = await gather_stats(asked)  # both pools at once
        if len(answered) < len(asked):
            # A dead or frozen worker: its load is unknown (the health check deals with it).
            logger.info("autoscale: no sample this second (a worker did not answer)")
            return []
        stats = {role: [answered[f"{role}-{i}"] for i in range(len(ready[role]))] for role in ROLES}
        backlog = sum(s.num_blocks_held for s in stats["prefill"])
        decisions = []
        for role in self.scaler.config.autoscaled:
            if not ready[role] or not pools.settled(role):
                self.scaler.changed(role, now)  # the window restarts once the pool settles
                continue
            newest = max(at for _, at in ready[role])
            sample = _sample(role, now, stats[role], newest, backlog)
            self.scaler.observe(replace(sample, slo_attainment=pools.slo_attainment(role)))
            decision = self.scaler.decide(role, now)
            if decision is not None and pools.resize(role, decision.size, decision.reason):
                logger.warning(
                    "autoscale: %s pool -> %d (%s)", role, decision.size, decision.reason
                )
                self.scaler.changed(role, now)
                decisions.append(decision)
        return decisions


def _sample(role: str, now: float, stats: list[Any], newest: float, backlog: int) -> PoolSample:
    loads = [s.load for s in stats]
    return PoolSample(
        now,
        role,
        len(stats),
        queued_tokens=sum(load.queued_tokens for load in loads),
        running=sum(load.running for load in loads),
        waiting=sum(load.waiting for load in loads),
        used_blocks=sum(load.total_blocks - load.free_blocks for load in loads),
        total_blocks=sum(load.total_blocks for load in loads),
        backlog_blocks=backlog if role == "decode" else 0,
        newest_ready_at=newest,
    )
