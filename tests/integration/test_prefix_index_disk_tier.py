"""The disk tier in the cluster KV index: a worker's real KVCacheManager (device pool, host tier,
disk tier over real block files, recording KV events) -> KVPublisher -> real redis-server ->
PrefixIndex. A block that left the host tier counts as held in the disk tier, a resync and a
withdrawal cover it, and placement credits a disk hit by the worker's measured load cost."""

from __future__ import annotations

from pathlib import Path

import redis
import torch

from common.messages import WorkerInfo, WorkerLoad
from engine.kv_cache.disk_tier import DiskTier
from kvtransfer.disk_blocks import DiskBlockFiles, DiskLayout
from router.policy import DISK_HIT_CREDIT, HOST_HIT_CREDIT, KVAwarePolicy, Overlap, tier_credit
from tests.integration.test_prefix_index_tiers import TieredWorker
from tests.integration.test_prefix_index_tiers import overlap as tiers_overlap

MODEL = "disk-tier-model"
BLOCK = 4


def disk_worker(url: str, worker_id: str, path: Path) -> TieredWorker:
    """A worker with a 4-block pool, 3 host slots and a 64-block disk tier over real files."""
    row = torch.zeros(1, 2, 2, 1, BLOCK, 8)
    files = DiskBlockFiles(path, DiskLayout.of(MODEL, row), row.dtype)
    disk = DiskTier(64, files, record_events=True)
    return TieredWorker(url, worker_id, 4, host_slots=3, disk=disk, model=MODEL)


def overlap(url: str, hashes: list[int], worker_ids: list[str]) -> Overlap:
    return tiers_overlap(url, hashes, worker_ids, MODEL)


def test_blocks_that_left_the_host_tier_are_indexed_in_the_disk_tier(
    redis_url: str, tmp_path: Path
) -> None:
    worker = disk_worker(redis_url, "w", tmp_path)
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
    assert abs(tier_credit(fast, BLOCK) - 0.9) < 1e-9
    assert tier_credit(slow, BLOCK) == 0.0  # a load dearer than computing: no credit
    assert tier_credit(unmeasured, BLOCK) == DISK_HIT_CREDIT
    same = Overlap({"fast": 8, "slow": 8}, {}, {"fast": 8, "slow": 8})
    placement = KVAwarePolicy().choose([slow, fast], same, BLOCK)
    assert placement.worker.worker_id == "fast" and abs(placement.score - 0.9 * 32) < 1e-9
    device = Overlap({"dev": 8, "fast": 8}, {}, {"fast": 8})
    dev = WorkerInfo("dev", "prefill", "", "", WorkerLoad())
    assert KVAwarePolicy().choose([fast, dev], device, BLOCK).worker.worker_id == "dev"


def test_a_shared_store_hit_is_priced_at_the_stores_own_read_time() -> None:
    """A worker's shared-store reads (an object store, 1.5 ms a block) and its disk reads
    (0.1 ms) are credited apart: the same 8 blocks are worth 0.9 of a device block each from
    its disk and 0 from the store, where its gate computes them again."""
    load = WorkerLoad(prefill_tok_s=4000, disk_load_us=100, shared_load_us=1500)
    both = WorkerInfo("both", "prefill", "", "", load)
    assert abs(tier_credit(both, BLOCK, "disk") - 0.9) < 1e-9
    assert tier_credit(both, BLOCK, "shared") == 0.0
    on_disk = Overlap({"both": 8}, {}, {"both": 8})
    in_store = Overlap({"both": 8}, {}, {}, {"both": 8})
    policy = KVAwarePolicy()
    assert abs(policy.score(both, on_disk, BLOCK) - 0.9 * 32) < 1e-9
    assert policy.score(both, in_store, BLOCK) == 0.0
    unmeasured = WorkerInfo("new", "prefill", "", "", WorkerLoad(prefill_tok_s=4000))
    assert tier_credit(unmeasured, BLOCK, "shared") == DISK_HIT_CREDIT


def test_a_disk_hit_is_priced_at_the_workers_prompt_rate_once_it_has_one() -> None:
    """An aggregated worker's steps are mostly decodes: its all-steps rate (500 tok/s) makes a
    4-token block look 8 ms to compute, its prompt rate (8,000 tok/s) says 0.5 ms. A 1 ms read
    is then dearer than computing, and the worker's gate computes the hit again: no credit."""
    load = WorkerLoad(prefill_tok_s=500, prompt_tok_s=8000, disk_load_us=1000)
    agg = WorkerInfo("agg", "decode", "", "", load)
    assert tier_credit(agg, BLOCK) == 0.0
    before = WorkerInfo("agg", "decode", "", "", WorkerLoad(prefill_tok_s=500, disk_load_us=1000))
    assert abs(tier_credit(before, BLOCK) - 0.875) < 1e-9  # no prompt rate yet: all steps
    fast = WorkerInfo("f", "decode", "", "", WorkerLoad(prompt_tok_s=8000, disk_load_us=100))
    assert abs(tier_credit(fast, BLOCK) - 0.8) < 1e-9


def test_a_host_hit_is_credited_by_the_copy_back_time_the_worker_measured() -> None:
    """A host-tier block saves its compute less the copy back the worker timed at start: 40 us
    against 1 ms to compute 4 tokens is 0.96 of a device block; a slow host link (a copy back
    dearer than computing) none; 0.8 until the worker has a compute rate."""

    def worker(name: str, host_load_us: int, rate: int = 4000) -> WorkerInfo:
        load = WorkerLoad(prefill_tok_s=rate, host_load_us=host_load_us)
        return WorkerInfo(name, "prefill", "", "", load)

    quick, slow = worker("quick", 40), worker("slow", 2000)
    assert abs(tier_credit(quick, BLOCK, "host") - 0.96) < 1e-9
    assert tier_credit(slow, BLOCK, "host") == 0.0
    assert tier_credit(worker("new", 40, rate=0), BLOCK, "host") == HOST_HIT_CREDIT
    both = Overlap({"quick": 8, "slow": 8}, {"quick": 8, "slow": 8})
    placement = KVAwarePolicy().choose([slow, quick], both, BLOCK)
    assert placement.worker.worker_id == "quick" and abs(placement.score - 0.96 * 32) < 1e-9
    assert KVAwarePolicy().score(slow, both, BLOCK) == 0.0
