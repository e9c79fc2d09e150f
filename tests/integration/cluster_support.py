"""Test support for the embedded cluster: start one, read its workers' block accounting."""

from __future__ import annotations

import asyncio
import time

from deploy.local_cluster import ClusterSpec, LocalCluster
from engine.config import CacheConfig, EngineConfig
from router.types import GenerateRequest, TokenDelta

NUM_BLOCKS = 256


def cluster_spec(**overrides) -> ClusterSpec:
    engine = EngineConfig(cache=CacheConfig(num_blocks=NUM_BLOCKS))
    fields = dict(engine=engine, num_prefill=2, num_decode=1, threads_per_worker=1, lease_s=20.0)
    fields.update(overrides)
    return ClusterSpec(**fields)


async def collect(backend, request: GenerateRequest) -> list[TokenDelta]:
    return [delta async for delta in backend.generate(request)]


def tokens_of(deltas: list[TokenDelta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


async def worker_accounts(cluster: LocalCluster) -> dict[str, dict[str, int]]:
    actors = {**cluster.prefill_actors, **cluster.decode_actors}
    results = await asyncio.gather(*(a.check_no_leaks.remote() for a in actors.values()))
    return dict(zip(actors, results, strict=True))


async def wait_until_no_leaks(cluster: LocalCluster, timeout_s: float = 20.0) -> None:
    """Poll every worker until all blocks are free and nothing is in flight (leases are
    released asynchronously by NIXL notifications)."""
    deadline = time.monotonic() + timeout_s
    while True:
        accounts = await worker_accounts(cluster)
        busy = {
            name: acc
            for name, acc in accounts.items()
            if acc["free"] != acc["total"]
            or acc["requests"]
            or acc.get("held")
            or acc.get("pulls")
            or acc.get("open_handles")
        }
        if not busy:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"blocks still in use: {busy}")
        await asyncio.sleep(0.05)
