"""How many workers an embedded cluster's machine holds (`kvrelay serve` on one machine, CPU
workers: no node ever joins, so a pool past its memory is not pending but killed by the
out-of-memory killer, the serving workers with it). Measured from the workers that started:
the memory their processes hold of their own against what the machine has free. Holds no
state."""

from __future__ import annotations

import math
from collections.abc import Iterable

import psutil

from common.cluster_state import ClusterStatus, WorkerState

HEADROOM = 0.8  # of the free memory, what more workers may take (their steps grow, and others')


def worker_bytes(pids: Iterable[int]) -> int:
    """The memory one worker's processes (its ranks') hold of their own: unique set size, not
    counting the libraries they share with every other worker (resident size where the
    system cannot say); 0 for any gone."""
    total = 0
    for pid in pids:
        try:
            process = psutil.Process(pid)
            try:
                total += process.memory_full_info().uss
            except (psutil.AccessDenied, AttributeError):
                total += process.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return total


def free_bytes() -> int:
    """What the machine has free now (for a share of it: capacity's `available`)."""
    return psutil.virtual_memory().available


def capacity(status: ClusterStatus, available: int | None = None) -> tuple[int, str] | None:
    """(the most workers of both pools, why) for this model's cluster: its live workers and as
    many more as HEADROOM of `available` bytes (default: the machine's free memory now; with
    several models, each model's share) holds at the largest worker's size; None when no
    worker's memory could be read."""
    live = [
        w
        for pool in status.pools
        for w in pool.workers
        if w.state in (WorkerState.JOINING, WorkerState.READY) and w.pid
    ]
    sizes = [worker_bytes({w.pid, *(r.pid for r in w.ranks)}) for w in live]
    each = max(sizes, default=0)
    if each <= 0:
        return None
    free = free_bytes() if available is None else available
    most = len(live) + math.floor(free * HEADROOM / each)
    why = (
        f"this machine's memory holds about {most} workers of this model ({each / 2**30:.1f} "
        f"GiB each, {free / 2**30:.1f} GiB free for it when serve started) and an embedded cluster "
        "adds no nodes"
    )
    return most, why
