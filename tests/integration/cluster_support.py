"""Test support for the embedded cluster: start one, read its workers' block accounting."""

from __future__ import annotations

import asyncio
import time

from common.cluster_state import LeakCheck
from common.messages import GenerateRequest, TokenDelta
from deploy.local_cluster import ClusterSpec, LocalCluster
from engine.config import CacheConfig, EngineConfig
from router.access import ApiKeys
from router.frontend import Frontend
from router.metrics import RouterMetrics
from router.serve import RouterServers
from router.tokenizer import RouterTokenizer
from tests.server_harness import LoopThread

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


async def worker_accounts(cluster: LocalCluster) -> dict[str, LeakCheck]:
    actors = {**cluster.prefill_actors, **cluster.decode_actors}
    results = await asyncio.gather(*(a.check_no_leaks.remote() for a in actors.values()))
    return dict(zip(actors, results, strict=True))


async def wait_until_no_leaks(cluster: LocalCluster, timeout_s: float = 20.0) -> None:
    """Poll every worker until all blocks are free and nothing is in flight (leases are
    released asynchronously by NIXL notifications)."""
    deadline = time.monotonic() + timeout_s
    while True:
        accounts = await worker_accounts(cluster)
        busy = {name: acc for name, acc in accounts.items() if not acc.clean}
        if not busy:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"blocks still in use: {busy}")
        await asyncio.sleep(0.05)


class ClusterHarness(LoopThread):
    """A LocalCluster behind the router's HTTP and gRPC servers, as `kvrelay serve` runs it."""

    def __init__(self, spec: ClusterSpec, api_keys: ApiKeys | None = None):
        super().__init__()
        self.cluster = LocalCluster(spec)
        self.api_keys = api_keys
        self.run(self._start(), timeout_s=300)

    async def _start(self) -> None:
        await self.cluster.start(progress=lambda message: None)
        metrics = RouterMetrics()
        self.cluster.backend.metrics = metrics
        tokenizer = RouterTokenizer(self.cluster.model.checkpoint_dir)
        frontend = Frontend(self.cluster.backend, tokenizer, metrics, api_keys=self.api_keys)
        self.servers = RouterServers(frontend)
        await self.servers.start("127.0.0.1", 0, 0)

    def wait_until_no_leaks(self) -> None:
        self.run(wait_until_no_leaks(self.cluster))

    def stop(self) -> None:
        try:
            if self.servers is not None:
                self.run(self.servers.stop(0))
            self.run(self.cluster.close(), timeout_s=120)
        finally:
            self.close()
