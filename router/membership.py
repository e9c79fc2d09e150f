"""MembershipSync: keeps one router's WorkerSet in step with the controller's membership (the
workers to know when Redis is down, which are ready or draining) and tells the controller the
router is alive; while the controller does not answer, it checks the known workers itself.
Owns the sync task only."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import replace

from ray.exceptions import ActorUnavailableError, RayActorError

from common.cluster_state import ROLES, ClassQueue, RouterStatus, SloAttainment
from common.worker_actors import ControllerActor
from router.worker_set import WorkerSet

logger = logging.getLogger(__name__)
PROBE_TIMEOUT_S = 5.0  # a worker probe that takes longer proves nothing either way


class MembershipSync:
    """One call per interval; a controller that does not answer leaves the last view in place
    (the router keeps serving from Redis and the workers it knows), less the workers whose actor
    is found dead meanwhile: each interval it asks them directly, and a dead one goes to
    `on_dead` (which must take it out of the WorkerSet)."""

    def __init__(
        self,
        controller: ControllerActor,
        workers: WorkerSet,
        router: RouterStatus,
        interval_s: float = 1.0,
    ):
        self.controller = controller
        self.workers = workers
        self.router = router
        self.interval_s = interval_s
        # What the router tells the controller of its recent requests against the objectives.
        self.report_attainment: Callable[[], SloAttainment | None] = lambda: None
        # Its queue by key class (`kvrelay status` shows it).
        self.report_queue: Callable[[], tuple[ClassQueue, ...]] = lambda: ()
        # A worker seen dead while the controller is away (the backend ends its streams too).
        self.on_dead: Callable[[str], None] = workers.mark_dead
        self._task: asyncio.Task[None] | None = None
        self._failing = False
        # Why the controller's actor is dead for good (Ray said so), None while it may answer
        self.controller_died: str | None = None

    async def sync_once(self) -> None:
        router = replace(
            self.router, attainment=self.report_attainment(), queue=self.report_queue()
        )
        members = await self.controller.members.remote(router)
        self.workers.sync(members)

    async def announce(self, router: RouterStatus) -> None:
        """Take router (e.g. once its servers listen and have addresses) and tell the
        controller now, not at the next interval, so that `kvrelay status` shows it as soon as
        the router says it serves; a controller that does not answer hears it at a later sync."""
        self.router = router
        try:
            await asyncio.wait_for(self.sync_once(), 5.0)
        except Exception as e:  # the loop keeps trying
            logger.info("router %s: first sync after its servers started failed: %s", router, e)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        try:
            await asyncio.wait_for(self.controller.forget_router.remote(self.router.router_id), 2.0)
        except Exception as e:  # the controller is gone too: nothing to tell
            logger.info("could not unregister router %s: %s", self.router.router_id, e)

    async def _run(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self.sync_once(), 5.0)
                if self._failing:
                    logger.warning("controller reachable again: membership syncs resume")
                self._failing = False
            except Exception as e:
                if isinstance(e, RayActorError) and not isinstance(e, ActorUnavailableError):
                    self.controller_died = self.controller_died or str(e).splitlines()[0]
                if not self._failing:
                    logger.warning(
                        "controller unreachable (%s): keeping the last membership, less the "
                        "workers found dead",
                        e,
                    )
                self._failing = True
                await self.probe_workers()
            await asyncio.sleep(self.interval_s)

    async def probe_workers(self) -> list[str]:
        """Ask every known worker for its pid (in parallel, PROBE_TIMEOUT_S each); the ones
        whose actor Ray reports dead go to on_dead. Returns their ids. A slow or temporarily
        unavailable worker is kept."""
        actors = {wid: a for role in ROLES for wid, a in self.workers.actors(role).items()}
        results = await asyncio.gather(
            *(asyncio.wait_for(a.pid.remote(), PROBE_TIMEOUT_S) for a in actors.values()),
            return_exceptions=True,
        )
        dead = [
            worker_id
            for worker_id, result in zip(actors, results, strict=True)
            if isinstance(result, RayActorError) and not isinstance(result, ActorUnavailableError)
        ]
        for worker_id in dead:
            logger.warning("worker %s died (found while the controller is unreachable)", worker_id)
            self.on_dead(worker_id)
        return dead
