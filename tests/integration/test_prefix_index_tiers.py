"""The host tier in the cluster KV index: a worker's real KVCacheManager (device pool + host
tier, recording KV events) -> KVPublisher -> real redis-server -> PrefixIndex. Overlap counts a
block the device evicted as held in the host tier, a resync and a withdrawal cover both tiers,
and the KV-aware policy credits a host-tier hit less than a device hit."""

from __future__ import annotations

import asyncio

import redis
import torch

from common.kv_publisher import KVPublisher
from common.messages import WorkerInfo, WorkerLoad
from engine.kv_cache.disk_tier import DiskTier
from engine.kv_cache.host_tier import HostTier
from engine.kv_cache.manager import KVCacheManager
from engine.step.request import Request
from router.policy import HOST_HIT_CREDIT, KVAwarePolicy, Overlap
from router.prefix_index import PrefixIndex

MODEL = "tier-model"
BLOCK = 4


class TieredWorker:
    """A worker's KV cache manager with a host tier (and a disk tier when given one), published
    once per 'step'."""

    def __init__(
        self,
        url: str,
        worker_id: str,
        num_blocks: int,
        host_slots: int = 32,
        disk: DiskTier | None = None,
        model: str = MODEL,
    ):
        tier = HostTier(host_slots, record_events=True)
        self.disk = disk
        self.kv = KVCacheManager(
            num_blocks, BLOCK, model, record_events=True, host_tier=tier, disk_tier=disk
        )
        self.publisher = KVPublisher(
            url,
            model,
            worker_id,
            "prefill",
            cached_hashes=self.kv.pool.cached_hashes,
            host_hashes=tier.cached_hashes,
            disk_hashes=tuple if disk is None else disk.cached_hashes,
            retry_interval_s=0.0,
        )
        self.row = torch.zeros(1, 2, 2, 1, BLOCK, 8)  # the KV a disk spill writes (bytes unread)

    def serve(self, tokens: list[int]) -> list[int]:
        """Compute and finish a request (and write its disk spills); returns its block hashes."""
        req = Request(f"r{len(tokens)}-{tokens[0]}", tokens)
        match = self.kv.match_prefix(req)
        self.kv.allocate(req, len(tokens) - match.num_tokens, match)
        req.num_computed_tokens = len(tokens)
        self.kv.cache_full_blocks(req)
        self.kv.free(req)
        if self.disk is not None:
            for spill in self.kv.owed.drain_spills():
                self.disk.put(spill, self.row[0])
        self.kv.owed.drain_copies()
        self.kv.owed.drain_offloads()
        return req.block_hashes

    def step(self) -> bool:
        return self.publisher.publish(self.kv.drain_events(), WorkerLoad())


def overlap(url: str, hashes: list[int], worker_ids: list[str], model: str = MODEL) -> Overlap:
    """The index's overlap of hashes with the workers, the same through view() and directly."""

    async def main() -> Overlap:
        async with PrefixIndex(url, model, retry_interval_s=0.0) as index:
            view = await index.view("prefill", hashes)
            direct = await index.prefix_overlap(hashes, worker_ids)
            assert view.overlap == direct  # every tier's count
            return direct

    return asyncio.run(main())


def test_evicted_blocks_are_indexed_in_the_host_tier_and_a_resync_keeps_both(
    redis_url: str,
) -> None:
    worker = TieredWorker(redis_url, "w", num_blocks=4)
    first = worker.serve(list(range(1, 13)))  # 3 blocks on the device, copied to the host
    assert worker.step()
    got = overlap(redis_url, first, ["w"])
    assert got == {"w": 3} and got.host == {"w": 0}
    worker.serve(list(range(100, 116)))  # 4 blocks: the first request's leave the device
    assert worker.step()
    got = overlap(redis_url, first, ["w"])
    assert got == {"w": 3} and got.host == {"w": 3}  # still held, in the host tier
    worker.publisher.mark_dirty()  # the next publish replaces the entry with the full state
    assert worker.step() and worker.publisher.num_resyncs == 2
    got = overlap(redis_url, first, ["w"])
    assert got == {"w": 3} and got.host == {"w": 3}
    assert worker.publisher.withdraw()
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    with client:
        assert not list(client.scan_iter(match=f"kvr:{{{MODEL}}}:b:*"))  # no member left
        assert not list(client.scan_iter(match=f"kvr:{{{MODEL}}}:wb:*"))


def test_a_host_tier_block_dropped_there_leaves_the_index(redis_url: str) -> None:
    worker = TieredWorker(redis_url, "w", num_blocks=3, host_slots=3)
    first = worker.serve(list(range(1, 13)))  # 3 blocks, 3 host slots
    worker.serve(list(range(100, 112)))  # 3 more: the host tier drops the first three
    assert worker.step()
    got = overlap(redis_url, first, ["w"])
    assert got == {"w": 0} and got.host == {"w": 0}


def test_kv_aware_placement_credits_a_host_hit_less_than_a_device_hit() -> None:
    workers = [WorkerInfo("dev", "prefill", "", ""), WorkerInfo("host", "prefill", "", "")]
    same = Overlap({"dev": 8, "host": 8}, {"host": 8})  # the same prefix, one in host memory
    assert KVAwarePolicy().choose(workers, same, BLOCK).worker.worker_id == "dev"
    placement = KVAwarePolicy().choose(workers, Overlap({"dev": 2, "host": 8}, {"host": 8}), 4)
    assert placement.worker.worker_id == "host"  # a longer host-tier prefix still wins
    assert placement.num_cached_tokens == 32  # the tokens it will not compute
    assert placement.score == HOST_HIT_CREDIT * 32
