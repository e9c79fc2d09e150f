"""The disk tier in the cluster KV index: a worker's real KVCacheManager (device pool, host tier,
disk tier over real block files, recording KV events) -> KVPublisher -> real redis-server ->
PrefixIndex. A block that left the host tier counts as held in the disk tier, a resync and a
withdrawal cover it, and placement credits a disk hit by the worker's measured load cost."""

from __future__ import annotations

import asyncio
from pathlib import Path

import redis
import torch

from common.kv_publisher import KVPublisher
from common.messages import WorkerInfo, WorkerLoad
from engine.kv_cache.disk_tier import DiskTier
from engine.kv_cache.host_tier import HostTier
from engine.kv_cache.manager import KVCacheManager
from engine.step.request import Request
from kvtransfer.disk_blocks import DiskBlockFiles, DiskLayout
from router.policy import DISK_HIT_CREDIT, KVAwarePolicy, Overlap, disk_credit
from router.prefix_index import PrefixIndex

MODEL = "disk-tier-model"
BLOCK = 4


class DiskWorker:
    """A worker's KV cache manager with host and disk tiers, published once per 'step'."""

    def __init__(self, url: str, worker_id: str, path: Path):
        self.row = torch.zeros(1, 2, 2, 1, BLOCK, 8)  # the KV a spill writes (its bytes unread)
        files = DiskBlockFiles(path, DiskLayout.of(MODEL, self.row), self.row.dtype)
        self.disk = DiskTier(64, files, record_events=True)
        host = HostTier(3, record_events=True)
        self.kv = KVCacheManager(
            4, BLOCK, MODEL, record_events=True, host_tier=host, disk_tier=self.disk
        )
        self.publisher = KVPublisher(
            url,
            MODEL,
            worker_id,
            "prefill",
            cached_hashes=self.kv.pool.cached_hashes,
            host_hashes=host.cached_hashes,
            disk_hashes=self.disk.cached_hashes,
            retry_interval_s=0.0,
        )

    def serve(self, tokens: list[int]) -> list[int]:
        """Compute and finish a request, write its spills; returns its block hashes."""
        req = Request(f"r{len(tokens)}-{tokens[0]}", tokens)
        match = self.kv.match_prefix(req)
        self.kv.allocate(req, len(tokens) - match.num_tokens, match)
        req.num_computed_tokens = len(tokens)
        self.kv.cache_full_blocks(req)
        self.kv.free(req)
        for spill in self.kv.owed.drain_spills():
            self.disk.put(spill, self.row[0])
        self.kv.owed.drain_copies()
        self.kv.owed.drain_offloads()
        return req.block_hashes

    def step(self) -> bool:
        return self.publisher.publish(self.kv.drain_events(), WorkerLoad())


def overlap(url: str, hashes: list[int], worker_ids: list[str]) -> Overlap:
    async def main() -> Overlap:
        async with PrefixIndex(url, MODEL, retry_interval_s=0.0) as index:
            view = await index.view("prefill", hashes)
            direct = await index.prefix_overlap(hashes, worker_ids)
            assert view.overlap == direct and view.overlap.disk == direct.disk
            return direct

    return asyncio.run(main())


def test_blocks_that_left_the_host_tier_are_indexed_in_the_disk_tier(
    redis_url: str, tmp_path: Path
) -> None:
    worker = DiskWorker(redis_url, "w", tmp_path)
    first = worker.serve(list(range(1, 13)))  # 3 blocks
    worker.serve(list(range(100, 116)))  # 4 more: the first leave the device, then the host
    worker.serve(list(range(200, 216)))
    assert worker.step()
    got = overlap(redis_url, first, ["w"])
    assert got == {"w": 3} and got.disk == {"w": 3} and got.host == {"w": 0}
    worker.publisher.mark_dirty()  # the next publish replaces the entry with the full state
    assert worker.step()
    got = overlap(redis_url, first, ["w"])
    assert got == {"w": 3} and got.disk == {"w": 3}
    assert worker.publisher.withdraw()
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    with client:
        assert not list(client.scan_iter(match=f"kvr:{{{MODEL}}}:b:*"))  # no member left
        assert not list(client.scan_iter(match=f"kvr:{{{MODEL}}}:wb:*"))


def test_placement_credits_a_disk_hit_by_the_measured_load_cost() -> None:
    def worker(name: str, disk_load_us: int) -> WorkerInfo:
        load = WorkerLoad(prefill_tok_s=4000, disk_load_us=disk_load_us)  # 1 ms a 4-token block
        return WorkerInfo(name, "prefill", "", "", load)

    fast, slow, unmeasured = worker("fast", 100), worker("slow", 2000), worker("new", 0)
    assert abs(disk_credit(fast, BLOCK) - 0.9) < 1e-9
    assert disk_credit(slow, BLOCK) == 0.0  # a load dearer than computing: no credit
    assert disk_credit(unmeasured, BLOCK) == DISK_HIT_CREDIT
    same = Overlap({"fast": 8, "slow": 8}, {}, {"fast": 8, "slow": 8})
    placement = KVAwarePolicy().choose([slow, fast], same, BLOCK)
    assert placement.worker.worker_id == "fast" and abs(placement.score - 0.9 * 32) < 1e-9
    device = Overlap({"dev": 8, "fast": 8}, {}, {"fast": 8})
    dev = WorkerInfo("dev", "prefill", "", "", WorkerLoad())
    assert KVAwarePolicy().choose([fast, dev], device, BLOCK).worker.worker_id == "dev"
