"""MembershipSync: keeps one router's WorkerSet in step with the controller's membership (the
workers to know when Redis is down, which are ready or draining) and tells the controller the
router is alive. Owns the sync task only."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from common.cluster_state import RouterStatus, SloAttainment
from router.worker_set import WorkerSet

logger = logging.getLogger(__name__)


class MembershipSync:
    """One call per interval; a controller that does not answer leaves the last view in place
    (the router keeps serving from Redis and the workers it knows)."""

    def __init__(
        self, controller: Any, workers: WorkerSet, router: RouterStatus, interval_s: float = 1.0
    ):
        self.controller = controller
        self.workers = workers
        self.router = router
        self.interval_s = interval_s
        # What the router tells the controller of its recent requests against the objectives.
        self.report_attainment: Callable[[], SloAttainment | None] = lambda: None
        self._task: asyncio.Task[None] | None = None
        self._failing = False

    async def sync_once(self) -> None:
        router = replace(self.router, attainment=self.report_attainment())
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
                if not self._failing:
                    logger.warning("controller unreachable (%s): keeping the last membership", e)
                self._failing = True
            await asyncio.sleep(self.interval_s)
