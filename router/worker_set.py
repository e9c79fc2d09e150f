"""WorkerSet: the router's view of live workers: Ray actor handles, and the load the router
itself has put on each (used when the Redis index is unavailable)."""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import ray

from router.types import WorkerInfo, WorkerLoad

logger = logging.getLogger(__name__)


@dataclass
class _Worker:
    info: WorkerInfo
    actor: Any  # ray.actor.ActorHandle


class WorkerSet:
    def __init__(self) -> None:
        self._workers: dict[str, _Worker] = {}
        self.inflight_tokens: dict[str, int] = defaultdict(int)
        self.inflight_requests: dict[str, int] = defaultdict(int)

    def add(self, worker_id: str, role: str, actor: Any, actor_name: str = "") -> None:
        self._workers[worker_id] = _Worker(WorkerInfo(worker_id, role, actor_name), actor)

    def remove(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)

    def actor(self, info: WorkerInfo) -> Any:
        """The actor of a worker seen in the index; looked up by name the first time."""
        known = self._workers.get(info.worker_id)
        if known is not None:
            return known.actor
        actor = ray.get_actor(info.actor_name)
        self._workers[info.worker_id] = _Worker(info, actor)
        return actor

    def known(self, role: str) -> list[WorkerInfo]:
        """Workers of a role with the router's own load figures (no index needed)."""
        out = []
        for worker_id, worker in sorted(self._workers.items()):
            if worker.info.role != role:
                continue
            load = WorkerLoad(
                running=self.inflight_requests[worker_id],
                queued_tokens=self.inflight_tokens[worker_id],
            )
            out.append(WorkerInfo(worker_id, role, worker.info.actor_name, load=load))
        return out

    def filter_known(self, workers: list[WorkerInfo]) -> list[WorkerInfo]:
        """Index entries whose actor can be reached (unknown names are looked up once)."""
        reachable = []
        for info in workers:
            try:
                self.actor(info)
            except ValueError:
                logger.warning(
                    "worker %s (%s) is in the index but not in Ray", info.worker_id, info.actor_name
                )
                continue
            reachable.append(info)
        return reachable
