"""gather_stats: many workers' own stats at once, each within a timeout (holds no state). The
controller's status, its autoscaler, the router's /metrics and the benches all ask this way."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

from common.cluster_state import WorkerStats
from common.worker_actors import WorkerActor

logger = logging.getLogger(__name__)
STATS_TIMEOUT_S = 2.0  # a worker slower than this (frozen, dying) is left out of that answer


async def gather_stats(
    actors: Mapping[str, WorkerActor], timeout_s: float = STATS_TIMEOUT_S
) -> dict[str, WorkerStats]:
    """Worker id -> its `stats()`, asked in parallel. A worker that is dead, slower than
    `timeout_s` or failing is left out (and logged at debug level)."""
    ids = list(actors)

    async def one(worker_id: str) -> WorkerStats:
        return await asyncio.wait_for(actors[worker_id].stats.remote(), timeout_s)

    answers = await asyncio.gather(*(one(i) for i in ids), return_exceptions=True)
    stats = {}
    for worker_id, answer in zip(ids, answers, strict=True):
        if isinstance(answer, BaseException):
            logger.debug("no stats from %s: %s", worker_id, type(answer).__name__)
        else:
            stats[worker_id] = answer
    return stats
