"""WorkerSet: the router's view of live workers: their Ray actor handles and states (from the
controller's membership), the workers it saw die, and what it has itself placed on each worker
and not yet seen end (its own in-flight accounting, so a burst is spread before any worker has
published its new load)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import ray

from common.cluster_state import NAMESPACE, Member
from common.messages import WorkerInfo, WorkerLoad
from common.worker_actors import WorkerActor

logger = logging.getLogger(__name__)


@dataclass
class _Worker:
    info: WorkerInfo
    actor: WorkerActor  # a Ray actor handle


@dataclass
class _Placed:
    """Requests this router placed on one worker that have not left it yet."""

    num_requests: int = 0
    num_tokens: int = 0  # uncached prompt tokens still to compute (a decode worker's own too)


class WorkerSet:
    """Invariants: a worker marked dead is never returned for placement until a new actor takes
    its id; `placed` counts only requests between place() and done(), so it never goes below 0."""

    def __init__(self) -> None:
        self._workers: dict[str, _Worker] = {}
        self._dead_actor_ids: dict[str, str] = {}  # worker_id -> Ray actor id that died
        self._placed: dict[str, _Placed] = {}

    def add(
        self,
        worker_id: str,
        role: str,
        actor: WorkerActor,
        actor_name: str = "",
        state: str = "ready",
    ) -> None:
        info = WorkerInfo(worker_id, role, actor_name, state=state)
        self._workers[worker_id] = _Worker(info, actor)
        self._dead_actor_ids.pop(worker_id, None)

    def sync(self, members: list[Member]) -> None:
        """Take the controller's membership: new workers are looked up, states updated, the
        ones it no longer lists forgotten (their in-flight streams keep their own handles)."""
        listed = {m.worker_id: m for m in members}
        for worker_id in [w for w in self._workers if w not in listed]:
            del self._workers[worker_id]
        for member in members:
            known = self._workers.get(member.worker_id)
            if known is not None:
                known.info = replace(known.info, state=member.state.value)
                continue
            info = WorkerInfo(member.worker_id, member.role, member.actor_name)
            try:
                self.actor(info)
            except ValueError:
                continue  # died meanwhile, or not yet visible: the next sync sees it again
            self._workers[member.worker_id].info = replace(info, state=member.state.value)

    def state_of(self, worker_id: str) -> str | None:
        """The worker's last known state (None: not known, or seen dead)."""
        known = self._workers.get(worker_id)
        return None if known is None else known.info.state

    def actors(self, role: str) -> dict[str, WorkerActor]:
        """Worker id -> actor of every worker of a role this router knows (any state)."""
        return {i: w.actor for i, w in sorted(self._workers.items()) if w.info.role == role}

    def mark_dead(self, worker_id: str) -> None:
        """The worker's actor died: leave placement at once (not after its Redis TTL)."""
        worker = self._workers.pop(worker_id, None)
        if worker is not None:
            self._dead_actor_ids[worker_id] = _actor_id(worker.actor)
        self._placed.pop(worker_id, None)

    def is_dead(self, worker_id: str) -> bool:
        return worker_id in self._dead_actor_ids

    def actor(self, info: WorkerInfo) -> WorkerActor:
        """The actor of a worker seen in the index; looked up by name the first time.

        Raises ValueError when the actor cannot be reached or is the one that died."""
        known = self._workers.get(info.worker_id)
        if known is not None:
            return known.actor
        actor = ray.get_actor(info.actor_name, namespace=NAMESPACE)
        if self._dead_actor_ids.get(info.worker_id) == _actor_id(actor):
            raise ValueError(f"worker {info.worker_id} died")
        self._dead_actor_ids.pop(info.worker_id, None)
        self._workers[info.worker_id] = _Worker(info, actor)
        return actor

    def known(self, role: str) -> list[WorkerInfo]:
        """Ready workers of a role, with only the router's own load figures (no index needed)."""
        infos = [
            w.info
            for _, w in sorted(self._workers.items())
            if w.info.role == role and w.info.state == "ready"
        ]
        return self.with_placed([replace(info, load=WorkerLoad()) for info in infos])

    def filter_known(self, workers: list[WorkerInfo]) -> list[WorkerInfo]:
        """Index entries whose actor can be reached (unknown names are looked up once)."""
        reachable = []
        for info in workers:
            try:
                self.actor(info)
            except ValueError:
                if not self.is_dead(info.worker_id):
                    logger.warning(
                        "worker %s (%s) is in the index but not in Ray",
                        info.worker_id,
                        info.actor_name,
                    )
                continue
            reachable.append(info)
        return reachable

    # ---- the router's own in-flight accounting ---------------------------------------------
    def with_placed(self, workers: list[WorkerInfo]) -> list[WorkerInfo]:
        """Each worker's load, raised to at least what this router has placed on it: a worker's
        published load lags (heartbeats), but a placement made a moment ago is already real."""
        out = []
        for info in workers:
            placed = self._placed.get(info.worker_id)
            if placed is None:
                out.append(info)
                continue
            load = replace(
                info.load,
                waiting=max(info.load.waiting, placed.num_requests - info.load.running),
                queued_tokens=max(info.load.queued_tokens, placed.num_tokens),
            )
            out.append(replace(info, load=load))
        return out

    def place(self, worker_id: str, num_tokens: int = 0) -> None:
        placed = self._placed.setdefault(worker_id, _Placed())
        placed.num_requests += 1
        placed.num_tokens += num_tokens

    def computed(self, worker_id: str, num_tokens: int) -> None:
        """The prompt tokens placed on a decode worker (it computes them itself) are done: the
        request stays placed there (it decodes) until done()."""
        placed = self._placed.get(worker_id)
        if placed is not None:
            placed.num_tokens = max(0, placed.num_tokens - num_tokens)

    def done(self, worker_id: str, num_tokens: int = 0) -> None:
        placed = self._placed.get(worker_id)
        if placed is None:
            return  # the worker was marked dead meanwhile
        placed.num_requests = max(0, placed.num_requests - 1)
        placed.num_tokens = max(0, placed.num_tokens - num_tokens)
        if not placed.num_requests:
            del self._placed[worker_id]

    def num_placed(self, worker_id: str) -> int:
        placed = self._placed.get(worker_id)
        return 0 if placed is None else placed.num_requests


def _actor_id(actor: WorkerActor) -> str:
    actor_id = getattr(actor, "_actor_id", None)
    return actor_id.hex() if actor_id is not None else str(id(actor))
