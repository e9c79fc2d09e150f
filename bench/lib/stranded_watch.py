"""StrandedWatch: samples every live worker's stranded-blocks figure (blocks held for a KV
handoff that no handoff state accounts for) while a fault phase runs; owns its sampling task
and the largest figure and sample count it saw."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from common.worker_stats import gather_stats

SAMPLE_S = 0.5


class StrandedWatch:
    def __init__(self, cluster: Any) -> None:
        self.cluster = cluster
        self.max_stranded = 0
        self.num_samples = 0  # worker answers taken
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        """Stop sampling after one last sample of every worker."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.sample()

    async def sample(self) -> None:
        """A frozen or dead worker is skipped in that sample."""
        actors = {**self.cluster.prefill_actors, **self.cluster.decode_actors}
        for stats in (await gather_stats(actors)).values():
            self.num_samples += 1
            self.max_stranded = max(self.max_stranded, stats.num_stranded_blocks)

    async def _run(self) -> None:
        while True:
            await self.sample()
            await asyncio.sleep(SAMPLE_S)
