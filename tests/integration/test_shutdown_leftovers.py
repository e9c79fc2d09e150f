"""What a worker or a serve leaves when it dies without cleaning up: a worker's block SET expires
some time after its HASH (refreshed by every write, like the HASH), late enough that whoever
finds the worker dead still removes its block entries; every key a worker writes has a TTL, the
block SETs and the registry that several workers share the longest of their writers', kept alive
while a worker holds a block however long ago it wrote it (real redis-server); the temp dir and
the redis-server of a LocalRedis whose owner was SIGKILLed are removed by the next LocalRedis."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import redis

from common import kv_index_schema as schema
from common.kv_publisher import KVPublisher
from common.messages import WorkerLoad
from deploy.cluster_address import process_alive
from deploy.redis_local import LocalRedis, ping
from engine.kv_cache.block_pool import BlockPool
from router.prefix_index import PrefixIndex

MODEL = "test-model"
BOUND_S = 30.0  # a bound on each wait, never a timing claim


def test_a_workers_block_set_has_a_ttl_past_its_hash_and_is_refreshed(redis_url):
    pool = BlockPool(8, record_events=True)
    publisher = KVPublisher(
        redis_url, MODEL, "w0", "prefill", cached_hashes=pool.cached_hashes, ttl_s=0.5
    )
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    blocks_key = schema.worker_blocks_key(MODEL, "w0")

    def cache(block_hash: int) -> None:
        [block] = pool.allocate(1)
        pool.cache_block(block, block_hash, None)
        pool.free([block])
        assert publisher.publish(pool.drain_events(), WorkerLoad())

    cache(11)  # the first write publishes the full state
    first = client.pttl(blocks_key)
    assert first > client.pttl(schema.worker_key(MODEL, "w0")) > 0
    assert first <= 500 * schema.BLOCKS_TTL_FACTOR
    cache(12)  # a delta refreshes it
    assert client.smembers(blocks_key) == {"000000000000000b", "000000000000000c"}
    assert client.pttl(blocks_key) > 0

    deadline = time.monotonic() + BOUND_S  # the worker dies: its HASH expires first
    while client.exists(schema.worker_key(MODEL, "w0")):
        assert time.monotonic() < deadline, "the HASH never expired"
        time.sleep(0.05)
    assert client.exists(blocks_key)

    async def forget() -> int:
        # a generous timeout: this test is about TTLs, and a busy machine stalls a first call
        async with PrefixIndex(redis_url, MODEL, timeout_s=5.0) as index:
            return await index.forget_worker("w0")

    assert asyncio.run(forget()) == 2  # a reaper still finds its block entries
    assert not client.keys("kvr:*")
    publisher.close()


class Worker:
    """A publisher over a pool of its own, on a clock the test moves."""

    def __init__(self, redis_url: str, worker_id: str, ttl_s: float, clock):
        self.pool = BlockPool(8, record_events=True)
        self.publisher = KVPublisher(
            redis_url, MODEL, worker_id, "prefill", self.pool.cached_hashes, ttl_s=ttl_s,
            clock=clock,
        )  # fmt: skip

    def cache(self, block_hash: int) -> None:
        [block] = self.pool.allocate(1)
        self.pool.cache_block(block, block_hash, None)
        self.pool.free([block])
        assert self.publisher.publish(self.pool.drain_events(), WorkerLoad())


def test_every_key_has_a_ttl_and_a_shared_one_the_longest_of_its_writers(redis_url):
    now = [0.0]
    short = Worker(redis_url, "w0", ttl_s=1.0, clock=lambda: now[0])  # blocks TTL 60 s
    long = Worker(redis_url, "w1", ttl_s=2.0, clock=lambda: now[0])  # blocks TTL 120 s
    short_ms = short.publisher.blocks_ttl_ms
    client = redis.Redis.from_url(redis_url, decode_responses=True)

    def block_ttl(block_hash: int) -> int:
        return client.pttl(schema.block_key(MODEL, block_hash))

    long.cache(11)  # a full publish (MULTI)
    short.cache(11)  # a full publish: block 11 keeps the longer TTL of w1
    short.cache(12)  # a delta: block 12 gets w0's
    short.cache(13)
    assert short_ms < block_ttl(11) <= long.publisher.blocks_ttl_ms
    assert 0 < block_ttl(12) <= short_ms
    keys = client.keys("kvr:*")
    assert len(keys) == 8  # 3 block SETs, 2 HASHes, 2 blocks SETs, the registry
    assert {key: client.pttl(key) > 0 for key in keys} == dict.fromkeys(keys, True)
    assert client.pttl(schema.registry_key(MODEL)) > short_ms  # the longest writer's too

    # Block 12 was written long ago (its SET about to expire); block 13's SET was left without
    # a TTL by an older kvrelay. Heartbeats keep them only once half of w0's blocks TTL passed.
    client.pexpire(schema.block_key(MODEL, 12), 1000)
    client.persist(schema.block_key(MODEL, 13))
    assert short.publisher.heartbeat(WorkerLoad())
    assert block_ttl(12) <= 1000 and block_ttl(13) == -1  # one write's keys only, so far
    now[0] += short_ms / 2000
    assert short.publisher.heartbeat(WorkerLoad())
    assert 1000 < block_ttl(12) <= short_ms and 0 < block_ttl(13) <= short_ms
    assert block_ttl(11) > short_ms, "a refresh never shortens a longer TTL"
    for worker in (short, long):
        worker.publisher.close()


def test_a_refresh_of_many_block_sets_is_spread_a_page_a_call(redis_url, monkeypatch):
    """A worker holding more block SETs than one page keeps them alive over several calls,
    each script run a page (Redis is never blocked by one run over all of them), and the next
    walk starts only half a blocks TTL after the last one ended."""
    monkeypatch.setattr(schema, "DELTA_SCRIPT", schema.delta_script(page=16))
    now = [0.0]
    worker = Worker(redis_url, "w0", ttl_s=1.0, clock=lambda: now[0])
    worker.cache(1)  # the full publish
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    # 300 more blocks as the worker's deltas would have left them (more than Redis's small-set
    # encoding, which SSCAN returns whole), their SETs about to expire
    keys = []
    for block_hash in range(100, 400):
        client.sadd(schema.worker_blocks_key(MODEL, "w0"), f"{block_hash:016x}")
        keys.append(schema.block_key(MODEL, block_hash))
        client.sadd(keys[-1], "w0")
        client.pexpire(keys[-1], 1000)
    now[0] += worker.publisher.blocks_ttl_ms / 2000
    calls = 0
    while worker.publisher.heartbeat(WorkerLoad()) and worker.publisher._keep_cursor is not None:
        calls += 1
        assert calls < 1000, "the walk never ended"
    assert calls > 1, "every block SET was kept in one run"
    assert all(client.pttl(key) > 1000 for key in keys), "a block SET missed by the walk"
    for key in keys:
        client.pexpire(key, 1000)
    assert worker.publisher.heartbeat(WorkerLoad())
    assert not any(client.pttl(key) > 1000 for key in keys), "a walk began before its time"
    worker.publisher.close()


def test_the_next_local_redis_cleans_up_after_a_killed_owner():
    child = subprocess.run(
        [sys.executable, "-c", OWNER_KILLED_WHILE_SERVING],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert child.returncode == -9, child.stderr
    tmp, pid, port = child.stdout.split()
    orphan, stale = int(pid), Path(tmp)
    assert stale.is_dir() and process_alive(orphan) and ping("127.0.0.1", int(port))

    with LocalRedis():
        assert not stale.exists()
        deadline = time.monotonic() + BOUND_S
        while process_alive(orphan):
            assert time.monotonic() < deadline, "the orphaned redis-server still runs"
            time.sleep(0.05)


# A LocalRedis owner that dies by SIGKILL once its server runs (nothing of its own cleans up).
OWNER_KILLED_WHILE_SERVING = """
import os, signal
from deploy.redis_local import LocalRedis
server = LocalRedis().start()
print(server._tmp.name, server.pid, server.port, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""
