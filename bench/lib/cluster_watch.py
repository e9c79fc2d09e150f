"""Reading an embedded cluster's state for benches (holds none): pools settled, worker pids,
workers that left since a moment, and every live worker's block accounts until all are free.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from common.cluster_state import ClusterStatus, LeakCheck, WorkerState


async def settle(controller: Any, timeout_s: float | None = None) -> ClusterStatus:
    """Wait until every pool has its desired ready workers and none joining or draining."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        status: ClusterStatus = await controller.status.remote(with_stats=False)
        if status.error:
            raise RuntimeError(status.error)
        if all(p.settled for p in status.pools):
            return status
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"pools not settled after {timeout_s:.0f} s")
        await asyncio.sleep(0.2)


async def router_knows_all(cluster: Any, timeout_s: float) -> None:
    """The in-process router sees every ready worker the controller lists (its sync is 1 s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        status: ClusterStatus = await cluster.controller.status.remote(with_stats=False)
        known = cluster.backend.workers
        if all(len(known.known(p.role)) == p.num_ready for p in status.pools):
            return
        if time.monotonic() > deadline:
            raise TimeoutError("the router did not learn the new workers")
        await asyncio.sleep(0.2)


async def worker_pids(controller: Any) -> dict[str, int]:
    """Worker id -> process id of every worker that has loaded and is not gone."""
    status: ClusterStatus = await controller.status.remote(with_stats=False)
    return {
        w.worker_id: w.pid
        for pool in status.pools
        for w in pool.workers
        if w.pid and w.state != WorkerState.GONE
    }


def left_since(status: ClusterStatus, since: float) -> list[dict[str, Any]]:
    """Workers that went gone at or after `since` (time.time()), with how and their check."""
    out = []
    for pool in status.pools:
        for worker in pool.workers:
            last = worker.transitions[-1]
            if worker.state == WorkerState.GONE and last.at >= since:
                check = worker.exit_check
                out.append(
                    {
                        "worker_id": worker.worker_id,
                        "note": last.note,
                        "error": worker.error,
                        "exit_check_clean": None if check is None else check.clean,
                    }
                )
    return out


def joined_since(status: ClusterStatus, since: float) -> list[str]:
    """Workers started at or after `since` (time.time()): the replacements."""
    return [
        w.worker_id for pool in status.pools for w in pool.workers if w.transitions[0].at >= since
    ]


async def block_accounts(cluster: Any) -> dict[str, LeakCheck]:
    actors = {**cluster.prefill_actors, **cluster.decode_actors}
    checks = await asyncio.gather(*(a.check_no_leaks.remote() for a in actors.values()))
    return dict(zip(actors, checks, strict=True))


async def wait_all_free(cluster: Any, timeout_s: float) -> tuple[dict[str, LeakCheck], float]:
    """Poll every live worker until all its blocks are free and nothing is in flight (leases
    end by notification or expiry); returns the last accounts and the seconds it took."""
    started = time.monotonic()
    while True:
        accounts = await block_accounts(cluster)
        elapsed = time.monotonic() - started
        if all(a.clean for a in accounts.values()) or elapsed > timeout_s:
            return accounts, elapsed
        await asyncio.sleep(0.1)
