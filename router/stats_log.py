"""StatsLog: one log line every interval while the cluster is busy (as vLLM logs its throughput):
prompt tokens/s (computed by the prefill pool, or by decode workers for their own prompts),
generated tokens/s (streamed to clients), requests/s, the router's queue by key class (queued
and running), and per pool its running and waiting
requests, KV use and prefix-hit rate. Owns its task and the previous sample; silent while
idle."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from common.cluster_state import DecodeStats, PrefillStats, WorkerStats, format_queue
from common.messages import WorkerLoad
from router.metrics import RouterMetrics, RouterTotals

logger = logging.getLogger(__name__)
DEFAULT_INTERVAL_S = 10.0
ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class WorkerSample:
    role: str
    load: WorkerLoad
    num_prompt_tokens: int  # cumulative: prompt tokens it prefilled (prefill workers report them)
    num_cached_tokens: int  # of those, found in its prefix cache


@dataclass(frozen=True)
class StatsSample:
    """What the router and its workers said at one moment."""

    at_s: float  # time.monotonic()
    router: RouterTotals
    workers: Mapping[str, WorkerSample]  # worker id -> its figures (those that answered)
    # pool -> its ready workers the router knows (some may not have answered in time)
    known: Mapping[str, int] = field(default_factory=dict)


def sample_of(
    at_s: float,
    totals: RouterTotals,
    stats: Mapping[str, tuple[str, WorkerStats]],
    known: Mapping[str, int] | None = None,
) -> StatsSample:
    workers = {
        worker_id: WorkerSample(role, s.load, *_prefilled(s))
        for worker_id, (role, s) in stats.items()
    }
    return StatsSample(at_s, totals, workers, dict(known or {}))


def _prefilled(stats: WorkerStats) -> tuple[int, int]:
    """(prompt tokens, cached tokens) a worker computed: a prefill worker's prompts, a decode
    worker's own (conditional prefill, aggregated: `--prefill 0`)."""
    if isinstance(stats, PrefillStats):
        return stats.num_prompt_tokens, stats.num_cached_tokens
    if isinstance(stats, DecodeStats):
        return stats.num_local_prompt_tokens, stats.num_local_cached_tokens
    return 0, 0


def is_busy(before: StatsSample, now: StatsSample) -> bool:
    """Busy: something ran in the interval (tokens streamed, requests ended, prompts
    prefilled) or something runs or waits now. One line follows the last busy interval, then
    none while idle."""
    router, previous = now.router, before.router
    moved = (
        router.num_streamed_tokens > previous.num_streamed_tokens
        or router.num_finished > previous.num_finished
        or any(prompt > 0 for prompt, _ in _prompt_deltas(before, now).values())
    )
    active = (
        router.num_in_flight > 0
        or any(c.queued for c in router.queue)
        or any(w.load.running or w.load.waiting for w in now.workers.values())
    )
    return moved or active


def stats_line(before: StatsSample, now: StatsSample) -> str | None:
    """The line for the interval from `before` to `now`; None while idle."""
    if not is_busy(before, now):
        return None
    span_s = max(now.at_s - before.at_s, 1e-9)
    router, previous = now.router, before.router
    prompts = _prompt_deltas(before, now)
    num_prompt = sum(prompt for prompt, _ in prompts.values())
    parts = [
        f"prompt {num_prompt / span_s:.1f} tok/s, "
        f"generation {(router.num_streamed_tokens - previous.num_streamed_tokens) / span_s:.1f}"
        f" tok/s, {(router.num_finished - previous.num_finished) / span_s:.2f} req/s, "
        f"in flight {router.num_in_flight}"
    ]
    if router.queue:
        parts.append(f"router queue: {format_queue(router.queue)}")
    for role in ROLES:
        workers = {i: w for i, w in now.workers.items() if w.role == role}
        silent = max(0, now.known.get(role, 0) - len(workers))
        parts.append(_pool_text(role, workers, [prompts[i] for i in workers], silent))
    return "stats: " + " | ".join(parts)


def _pool_text(
    role: str,
    workers: Mapping[str, WorkerSample],
    prompts: list[tuple[int, int]],
    silent: int = 0,
) -> str:
    """silent: the pool's ready workers that did not answer in time (a step holding a CPU
    worker's interpreter): the figures are the others'."""
    loads = [w.load for w in workers.values()]
    total = sum(load.total_blocks for load in loads)
    used = total - sum(load.free_blocks for load in loads)
    workers_text = f"{len(loads)} worker" + ("" if len(loads) == 1 else "s")
    if silent:
        workers_text += f", {silent} not answering"
    text = (
        f"{role} ({workers_text}): running {sum(load.running for load in loads)}, "
        f"waiting {sum(load.waiting for load in loads)}, KV {used / total if total else 0.0:.1%}"
    )
    num_prompt = sum(prompt for prompt, _ in prompts)
    if num_prompt > 0:
        text += f", prefix hits {sum(cached for _, cached in prompts) / num_prompt:.0%}"
    return text


def _prompt_deltas(before: StatsSample, now: StatsSample) -> dict[str, tuple[int, int]]:
    """Worker id -> (prompt tokens, cached tokens) it reported in the interval; a worker new
    since `before` counts from 0 (its counters start there), one gone has none."""
    deltas = {}
    for worker_id, w in now.workers.items():
        old = before.workers.get(worker_id)
        prompt_0, cached_0 = (
            (0, 0) if old is None else (old.num_prompt_tokens, old.num_cached_tokens)
        )
        deltas[worker_id] = (w.num_prompt_tokens - prompt_0, w.num_cached_tokens - cached_0)
    return deltas


class StatsLog:
    """Every `interval_s`: refresh the workers' stats (as a /metrics scrape does), then log the
    interval's line if busy. interval_s <= 0: never starts."""

    def __init__(
        self,
        metrics: RouterMetrics,
        refresh: Callable[[], Awaitable[None]],
        interval_s: float,
        known: Callable[[], Mapping[str, int]] = dict,
    ):
        """known: each pool's ready workers the router knows, answering or not."""
        self.metrics = metrics
        self.refresh = refresh
        self.interval_s = interval_s
        self.known = known
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.interval_s > 0 and self._task is None:
            self._task = asyncio.create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def sample(self) -> StatsSample:
        await self.refresh()
        totals = self.metrics.totals()
        last = self.metrics.worker_stats.last()
        return sample_of(time.monotonic(), totals, last, self.known())

    async def _run(self) -> None:
        before: StatsSample | None = None
        while True:
            try:
                now = await self.sample()
            except Exception as e:  # a failed refresh: the next interval tries again
                logger.debug("no stats this interval: %s", e)
            else:
                line = None if before is None else stats_line(before, now)
                if line is not None:
                    logger.info(line)
                before = now
            await asyncio.sleep(self.interval_s)
