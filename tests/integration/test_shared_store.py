"""The cluster-shared KV store end to end on CPU (tiny random checkpoints, NIXL's POSIX backend,
two engines as two workers over one shared directory): the second worker computes only what the
first did not publish, token for token; a corrupt or truncated shared file is recomputed, never
loaded; salts never share a block in any tier; a full or small store loses no request."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from pathlib import Path

import pytest

from common.index_upkeep import make_publisher, worker_load
from engine.engine import Engine
from engine.kv_cache.hashing import hash_blocks
from engine.kv_cache.shared_store import SharedStore
from kvtransfer.disk_blocks import SUFFIX
from router.prefix_index import PrefixIndex
from tests.integration.test_disk_tier import (
    BLOCK,
    BLOCK_BYTES,
    engine,
    prompts,
    serve,
    small_tmpfs,
    tiny,
)

__all__ = ["tiny"]  # the module-scoped checkpoint fixture

FILE_BYTES = 4096 + BLOCK_BYTES


def worker(
    model: Path, disk: Path, shared: Path | str, shared_blocks: int = 400, **more: object
) -> Engine:
    """A worker with its own disk tier over the shared store at `shared` (a directory, or an
    s3:// location with shared_kv_endpoint in more)."""
    return engine(
        model,
        disk,
        shared_kv_cache_bytes=shared_blocks * FILE_BYTES,
        shared_kv_path=str(shared),
        **more,
    )


def store_of(eng: Engine) -> SharedStore:
    assert eng.kv.disk_tier is not None and eng.kv.disk_tier.shared is not None
    return eng.kv.disk_tier.shared


def published(shared: Path) -> set[int]:
    return {int(p.name.removesuffix(SUFFIX), 16) for p in shared.rglob(f"*{SUFFIX}")}


def leading(prompt: list[int], have: set[int], model_id: str, salt: str | None = None) -> int:
    """How many of the prompt's leading full blocks (the last token excluded) are in `have`."""
    n = 0
    for block_hash in hash_blocks(prompt[:-1], BLOCK, model_id, salt):
        if block_hash not in have:
            break
        n += 1
    return n


def test_a_second_worker_computes_only_what_the_first_did_not_publish(tiny, tmp_path):
    batch = prompts(4, seed=10)
    first = worker(tiny, tmp_path / "a", tmp_path / "shared")
    want = [tokens for tokens, _ in serve(first, batch)]
    there = published(tmp_path / "shared")
    assert store_of(first).num_published == len(there) > 0
    writes = store_of(first).writes  # every publish ran behind the step and was counted
    assert (
        writes is not None and writes.num_issued == len(there) + store_of(first).num_found_published
    )
    expect = [leading(p, there, first.model_id) * BLOCK for p in batch]
    assert expect[0] == 8 * BLOCK and expect[-1] == 0  # the last prompt never left the device
    second = worker(tiny, tmp_path / "b", tmp_path / "shared")  # a new worker: starts warm
    before = second.snapshot().num_computed_tokens
    asked: Counter[int] = Counter()  # the store asked whether it has a block (a HEAD on S3)
    files = store_of(second).files
    exists = files.exists
    files.exists = lambda block_hash: asked.update([block_hash]) or exists(block_hash)
    got = serve(second, batch)
    assert [tokens for tokens, _ in got] == want
    assert [cached for _, cached in got] == expect
    snap = second.snapshot()
    # each prompt's uncached tokens, then one decode step each (max_tokens=2)
    computed = sum(len(p) - c for p, c in zip(batch, expect, strict=True)) + len(batch)
    assert snap.num_computed_tokens - before == computed
    tiers = {tier.tier: tier for tier in snap.tiers}
    assert list(tiers) == ["device", "host", "disk", "shared"]
    assert tiers["host"].recent_load_s > 0  # its copy back, timed at start (the host credit)
    shared = tiers["shared"]
    assert shared.hit_blocks == sum(expect) // BLOCK
    assert shared.load_bytes == shared.hit_blocks * BLOCK_BYTES
    assert shared.bad_files == 0 and shared.load_s > 0
    reads = store_of(second).reads  # each hit block read once, behind the step
    assert reads is not None and reads.num_issued == shared.hit_blocks
    # and asked for once: not again each step its request waits for the reads (it was twice)
    assert asked and max(asked.values()) == 1, asked.most_common(3)
    assert tiers["device"].lookup_blocks == 4 * 8 and tiers["device"].hit_blocks == 0
    assert shared.lookup_blocks == 4 * 8 and shared.used_blocks >= len(there)
    # one writer a block: the second worker's spills were the first's blocks, not rewritten
    assert store_of(second).num_found_published > 0
    assert published(tmp_path / "shared") >= there


def test_corrupt_and_truncated_shared_files_are_recomputed_never_loaded(tiny, tmp_path, caplog):
    batch = prompts(4, seed=11)
    first = worker(tiny, tmp_path / "a", tmp_path / "shared")
    want = [tokens for tokens, _ in serve(first, batch)]
    files = sorted((tmp_path / "shared").rglob(f"*{SUFFIX}"))
    assert len(files) >= 8
    for path in files[::3]:  # a flipped payload byte
        raw = bytearray(path.read_bytes())
        raw[-9] ^= 0x10
        path.write_bytes(bytes(raw))
    for path in files[1::3]:  # cut short
        path.write_bytes(path.read_bytes()[: 4096 + 64])
    (files[2].parent / f".{0xABC:016x}.elsewhere.tmp").write_bytes(b"half")  # a writer at work
    second = worker(tiny, tmp_path / "b", tmp_path / "shared")
    with caplog.at_level(logging.WARNING, logger="engine.kv_cache.shared_store"):
        got = serve(second, batch)
    assert [tokens for tokens, _ in got] == want
    store = store_of(second)
    assert store.num_bad_files > 0
    assert "checksum mismatch" in caplog.text or "bytes, a block file has" in caplog.text
    assert caplog.text.count("shared KV store:") == 1  # logged once
    # each prompt hit exactly its leading blocks whose files were left whole: a bad file ends
    # the match there (its block and the rest computed)
    bad = {int(p.name.removesuffix(SUFFIX), 16) for p in files[::3] + files[1::3]}
    intact = {int(p.name.removesuffix(SUFFIX), 16) for p in files} - bad
    expect = [leading(p, intact, second.model_id) * BLOCK for p in batch]
    assert [cached for _, cached in got] == expect and 0 < sum(expect) < 4 * 8 * BLOCK
    assert store.num_hit_blocks == sum(expect) // BLOCK
    assert (files[2].parent / f".{0xABC:016x}.elsewhere.tmp").exists()  # not another's to remove


def test_two_salts_never_share_a_block_in_any_tier(tiny, tmp_path):
    batch = prompts(3, seed=12)
    first = worker(tiny, tmp_path / "a", tmp_path / "shared")
    serve(first, batch, salt="alice")
    assert store_of(first).num_published > 0
    second = worker(tiny, tmp_path / "b", tmp_path / "shared")
    got = serve(second, batch, salt="bob")
    assert all(cached == 0 for _, cached in got)
    assert store_of(second).num_hit_blocks == 0 and second.kv.num_disk_hit_blocks == 0
    got = serve(second, batch, salt="alice")
    assert any(cached > 0 for _, cached in got) and store_of(second).num_hit_blocks > 0


def test_a_small_or_full_shared_store_loses_no_request(tiny, tmp_path, caplog):
    batch = prompts(4, seed=13)
    want = [tokens for tokens, _ in serve(engine(tiny, None), batch)]
    small = worker(tiny, tmp_path / "a", tmp_path / "small", shared_blocks=10)
    assert [tokens for tokens, _ in serve(small, batch)] == want
    assert store_of(small).num_evicted > 0 and len(published(tmp_path / "small")) <= 10
    with small_tmpfs(tmp_path / "full") as full:  # five block files, far fewer than the
        eng = worker(tiny, tmp_path / "b", full)  # blocks published
        with caplog.at_level(logging.WARNING, logger="engine.kv_cache.shared_store"):
            assert [tokens for tokens, _ in serve(eng, batch)] == want
            assert [tokens for tokens, _ in serve(eng, batch)] == want
    store = store_of(eng)
    assert store.num_write_failures > 0 and 0 < store.num_published <= 5
    assert caplog.text.count("cannot publish a block file") == 1, caplog.text
    assert "No space left on device" in caplog.text


def test_evict_drops_a_salts_or_a_prompts_blocks_from_every_tier(tiny, tmp_path):
    alice, bob = prompts(3, seed=14), prompts(3, seed=15)
    first = worker(tiny, tmp_path / "a", tmp_path / "shared")
    serve(first, alice, salt="alice")
    serve(first, bob, salt="bob")
    first.shutdown()  # every block on its disk and in the shared store
    second = worker(tiny, tmp_path / "b", tmp_path / "shared")
    serve(second, alice, salt="alice")  # alice's blocks now in each of its tiers
    dropped = second.evict_kv(cache_salt="alice")
    assert set(dropped) == {"device", "host", "disk", "shared"}
    assert dropped["device"] > 0 and dropped["disk"] > 0 and dropped["shared"] >= 24
    hits = store_of(second).num_hit_blocks
    got = serve(second, alice, salt="alice")
    assert all(cached == 0 for _, cached in got), got  # from no tier, no worker's files
    assert store_of(second).num_hit_blocks == hits
    # the first worker's own disk still has alice's blocks: evict there too (as the
    # controller does on every worker), by one prompt this time
    restarted = worker(tiny, tmp_path / "a", tmp_path / "shared")
    assert restarted.evict_kv(alice[0], "alice")["disk"] == 8
    got = serve(restarted, alice, salt="alice")
    assert got[0][1] == 0 and got[1][1] == 8 * BLOCK
    got = serve(second, bob, salt="bob")  # bob's untouched
    assert all(cached == 8 * BLOCK for _, cached in got)
    with pytest.raises(ValueError, match="token_ids, a cache_salt"):
        second.evict_kv()


def test_the_index_lists_shared_blocks_for_every_worker(tiny, tmp_path, redis_url):
    batch = prompts(3, seed=16)
    first = worker(tiny, tmp_path / "a", tmp_path / "shared", record_kv_events=True)
    second = worker(tiny, tmp_path / "b", tmp_path / "shared", record_kv_events=True)
    publishers = [
        make_publisher(redis_url, name, eng, "actor", "prefill", "")
        for name, eng in (("a", first), ("b", second))
    ]
    serve(first, batch)
    for publisher, eng in zip(publishers, (first, second), strict=True):
        assert publisher is not None
        assert publisher.publish(eng.drain_kv_events(), worker_load(eng.snapshot()))
    hashes = hash_blocks(batch[0], BLOCK, first.model_id)

    async def overlap(shared_store: bool = True):
        async with PrefixIndex(
            redis_url, first.model_id, retry_interval_s=0.0, shared_store=shared_store
        ) as index:
            return await index.prefix_overlap(hashes, ["a", "b"])

    got = asyncio.run(overlap())
    # the first worker's own disk tier, the second (nothing of its own) the shared store's
    assert got == {"a": 8, "b": 8} and got.disk == {"a": 8, "b": 0}
    assert got.shared == {"a": 0, "b": 8}
    assert asyncio.run(overlap(shared_store=False)) == {"a": 8, "b": 0}  # a cluster without one
    assert sum(second.evict_kv(batch[0]).values()) == 8  # the shared store's files of it
    assert publishers[1].publish(second.drain_kv_events(), worker_load(second.snapshot()))
    got = asyncio.run(overlap())
    assert got["b"] == 0 and got.shared == {"a": 0, "b": 0}
    for publisher in publishers:
        publisher.close()
