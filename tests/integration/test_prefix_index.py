"""KVPublisher -> real redis-server -> PrefixIndex: overlap, removals, TTL, outages, salts.

Each "worker" is a real BlockPool recording KV events, published the way a worker does it once
per engine step. Each test gets a fresh redis-server (tests.redis_fixtures).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import pytest
import redis

from common import kv_index_schema as schema
from common.kv_publisher import KVPublisher
from common.messages import WorkerLoad
from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.hashing import hash_blocks, hash_hex
from router.cluster_backend import ClusterBackend
from router.metrics import RouterMetrics
from router.prefix_index import IndexUnavailable, PrefixIndex
from router.worker_set import WorkerSet
from tests.redis_server import RedisServer

MODEL = "test-model"
BLOCK = 4
WAIT_S = 10.0


def prompt_hashes(num_blocks: int, salt: str | None = None, first_token: int = 0) -> list[int]:
    tokens = list(range(first_token, first_token + num_blocks * BLOCK))
    return hash_blocks(tokens, BLOCK, MODEL, cache_salt=salt)


class PoolWorker:
    """A worker's real BlockPool wired to its KVPublisher."""

    def __init__(
        self, url: str, worker_id: str, role: str = "prefill", num_blocks: int = 32, **publisher_kw
    ) -> None:
        self.pool = BlockPool(num_blocks, record_events=True)
        publisher_kw.setdefault("retry_interval_s", 0.0)
        self.publisher = KVPublisher(
            url, MODEL, worker_id, role, cached_hashes=self.pool.cached_hashes, **publisher_kw
        )

    def cache(self, *block_hashes: int) -> None:
        """Compute blocks with these hashes and release them (they stay in the prefix cache)."""
        blocks = self.pool.allocate(len(block_hashes))
        for block, block_hash in zip(blocks, block_hashes, strict=True):
            self.pool.cache_block(block, block_hash, None)
        self.pool.free(blocks)

    def step(self, **load: int) -> bool:
        """What the engine loop does after each step."""
        return self.publisher.publish(self.pool.drain_events(), WorkerLoad(**load))


def run(coro_fn: Callable[[PrefixIndex], Awaitable[object]], url: str, **index_kw) -> object:
    """Run an async test body against a PrefixIndex on its own event loop."""
    index_kw.setdefault("retry_interval_s", 0.0)

    async def main() -> object:
        async with PrefixIndex(url, MODEL, **index_kw) as index:
            return await coro_fn(index)

    return asyncio.run(main())


async def wait_until(check: Callable[[], Awaitable[bool]], timeout_s: float = WAIT_S) -> None:
    """Poll an async condition until it holds (for Redis-side TTL expiry)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await check():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def model_keys(url: str, kind: str) -> set[str]:
    client = redis.Redis.from_url(url, decode_responses=True)
    with client:
        return set(client.scan_iter(match=f"kvr:{{{MODEL}}}:{kind}*"))


def test_overlap_is_longest_prefix_per_worker(redis_url: str) -> None:
    p = prompt_hashes(5)
    full, gappy, decode = (
        PoolWorker(redis_url, w, r)
        for w, r in [("full", "prefill"), ("gappy", "prefill"), ("dec", "decode")]
    )
    full.cache(*p[:3])
    gappy.cache(p[0], p[2], p[3])  # block 1 missing: blocks 2 and 3 do not count
    decode.cache(*p)
    assert full.step() and gappy.step() and decode.step()
    assert full.publisher.num_resyncs == 1  # the first publish registers the full state
    full.cache(p[3])
    assert full.step()
    assert full.publisher.num_resyncs == 1  # later steps are deltas

    async def body(index: PrefixIndex) -> None:
        view = await index.view("prefill", p)
        assert [w.worker_id for w in view.workers] == ["full", "gappy"]
        assert view.overlap == {"full": 4, "gappy": 1}
        assert (await index.view("decode", p)).overlap == {"dec": 5}
        other = prompt_hashes(5, first_token=500)
        assert (await index.view("", other)).overlap == {"dec": 0, "full": 0, "gappy": 0}
        assert (await index.view("prefill", [])).overlap == {"full": 0, "gappy": 0}
        counts = await index.prefix_overlap(p, ["gappy", "full", "dec", "nobody"])
        assert counts == {"gappy": 1, "full": 4, "dec": 5, "nobody": 0}
        assert await index.prefix_overlap(p, []) == {}

    run(body, redis_url)


def test_removed_events_drop_entries(redis_url: str) -> None:
    p = prompt_hashes(4)
    worker = PoolWorker(redis_url, "w", num_blocks=4)
    worker.cache(*p)
    assert worker.step()
    worker.pool.free(worker.pool.allocate(1))  # evicts the LRU block, p[0]
    assert worker.step()

    async def body(index: PrefixIndex) -> dict[str, int]:
        return await index.prefix_overlap(p, ["w"])

    assert run(body, redis_url) == {"w": 0}  # p[1:] still held, but the prefix starts missing
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    assert not client.exists(schema.block_key(MODEL, p[0]))
    assert client.scard(schema.worker_blocks_key(MODEL, "w")) == 3
    worker.pool.evict_all_cached()
    assert worker.step()
    assert model_keys(redis_url, "b:") == set()
    assert not client.exists(schema.worker_blocks_key(MODEL, "w"))


def test_membership_carries_role_names_and_load(redis_url: str) -> None:
    worker = PoolWorker(redis_url, "p0", actor_name="actor-p0", nixl_agent="agent-p0", ttl_s=30)
    assert worker.step(running=2, waiting=1, free_blocks=20, total_blocks=32, queued_tokens=77)
    client = redis.Redis.from_url(redis_url)
    assert 0 < client.pttl(schema.worker_key(MODEL, "p0")) <= 30_000

    async def body(index: PrefixIndex) -> None:
        (info,) = await index.live_workers("prefill")
        assert (info.worker_id, info.role, info.actor_name, info.nixl_agent) == (
            "p0",
            "prefill",
            "actor-p0",
            "agent-p0",
        )
        assert info.load == WorkerLoad(2, 1, 20, 32, 77)
        assert await index.live_workers("decode") == []
        assert worker.publisher.heartbeat(WorkerLoad(running=5))
        (info,) = await index.live_workers()
        assert info.load == WorkerLoad(running=5)

    run(body, redis_url)


def test_ttl_expiry_drops_a_dead_worker_and_a_late_heartbeat_restores_it(redis_url: str) -> None:
    p = prompt_hashes(3)
    live = PoolWorker(redis_url, "live", ttl_s=60)
    stalled = PoolWorker(redis_url, "stalled", ttl_s=0.1)
    live.cache(*p)
    stalled.cache(*p)
    assert live.step() and stalled.step()

    async def body(index: PrefixIndex) -> None:
        async def only_live() -> bool:
            return [w.worker_id for w in await index.live_workers()] == ["live"]

        await wait_until(only_live)  # the stalled worker's HASH expired
        client = redis.Redis.from_url(redis_url, decode_responses=True)

        async def reaped() -> bool:  # a read that finds a dead worker cleans it up
            await index.live_workers()
            registered = client.smembers(schema.registry_key(MODEL))
            return registered == {"live"} and not client.exists(
                schema.worker_blocks_key(MODEL, "stalled")
            )

        await wait_until(reaped)
        assert all(client.smembers(schema.block_key(MODEL, h)) == {"live"} for h in p)
        assert (await index.view("prefill", p)).overlap == {"live": 3}
        assert await index.prefix_overlap(p, ["stalled"]) == {"stalled": 0}
        assert await index.forget_worker("live") == -1  # alive: not forgotten
        assert stalled.step()  # it comes back: its HASH was gone, so it re-publishes in full
        assert stalled.publisher.num_resyncs == 2
        assert (await index.view("prefill", p)).overlap == {"live": 3, "stalled": 3}

    run(body, redis_url)


def test_withdraw_removes_every_trace_of_the_worker(redis_url: str) -> None:
    worker = PoolWorker(redis_url, "w")
    worker.cache(*prompt_hashes(3))
    assert worker.step()
    assert worker.publisher.withdraw()
    assert model_keys(redis_url, "") == set()
    assert worker.step()  # publishing again after withdraw registers it again, in full
    assert len(model_keys(redis_url, "b:")) == 3


def test_redis_killed_then_restarted_empty(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    p = prompt_hashes(6)
    w1, w2 = PoolWorker(redis_server.url, "w1"), PoolWorker(redis_server.url, "w2")
    w1.cache(*p[:2])
    w2.cache(*p[:1])
    assert w1.step() and w2.step()

    async def body(index: PrefixIndex) -> None:
        assert (await index.view("prefill", p)).overlap == {"w1": 2, "w2": 1}
        redis_server.stop()
        with caplog.at_level(logging.WARNING, logger="router"):
            for _ in range(3):  # the engine keeps stepping; events of the outage are lost
                w1.cache(p[2], p[3])
                assert not w1.step()
                with pytest.raises(IndexUnavailable):
                    await index.view("prefill", p)
        assert not index.available and not w1.publisher.healthy and w1.publisher.dirty
        warnings = [r for r in caplog.records if r.name == "common.kv_publisher"]
        assert len(warnings) == 1  # once per outage, not once per step
        w2.pool.evict_all_cached()  # w2 drops its blocks (and never saw the outage)
        redis_server.restart()
        assert w1.step(queued_tokens=3) and w2.step()
        view = await index.view("prefill", p)
        assert view.overlap == {"w1": 4, "w2": 0}
        assert view.workers[0].load.queued_tokens == 3
        assert index.available and w1.publisher.healthy and not w1.publisher.dirty

    run(body, redis_server.url)


def test_hung_redis_times_out_then_the_worker_resyncs(redis_server: RedisServer) -> None:
    p, q = prompt_hashes(3), prompt_hashes(3, first_token=1000)
    worker = PoolWorker(redis_server.url, "w", socket_timeout_s=0.2)
    worker.cache(*p)
    assert worker.step()

    async def body(index: PrefixIndex) -> None:
        redis_server.pause()  # accepts connections, answers nothing
        with pytest.raises(IndexUnavailable):
            await index.view("prefill", p)
        worker.pool.evict_all_cached()
        worker.cache(*q)
        assert not worker.step()  # timed out, never raised
        redis_server.resume()
        assert worker.step()  # full state: p gone, q there
        assert await index.prefix_overlap(p, ["w"]) == {"w": 0}
        assert await index.prefix_overlap(q, ["w"]) == {"w": 3}
        client = redis.Redis.from_url(redis_server.url, decode_responses=True)
        assert client.smembers(schema.worker_blocks_key(MODEL, "w")) == {hash_hex(h) for h in q}

    run(body, redis_server.url, timeout_s=0.2)


def test_a_delta_from_an_older_epoch_is_refused(redis_url: str) -> None:
    """A step's write that reaches Redis after the worker re-published (it had timed out) must
    not be applied on top of the newer full state."""
    worker = PoolWorker(redis_url, "w")
    assert worker.step()
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    late_block = prompt_hashes(1)[0]
    keys = schema.worker_keys(MODEL, "w")
    args = [schema.block_key_prefix(MODEL), "w", "old-epoch", 1000, 1, "role", "prefill"]
    args += ["+", hash_hex(late_block)]
    assert client.eval(schema.DELTA_SCRIPT, len(keys), *keys, *args) == 0
    assert not client.exists(schema.block_key(MODEL, late_block))
    assert client.hget(keys[0], "role") == "prefill" and client.pttl(keys[0]) > 1000


def test_circuit_breaker_answers_at_once_until_the_retry_interval(
    redis_server: RedisServer,
) -> None:
    async def body(index: PrefixIndex) -> None:
        assert await index.live_workers() == []
        redis_server.stop()
        with pytest.raises(IndexUnavailable):
            await index.live_workers()
        redis_server.restart()
        with pytest.raises(IndexUnavailable, match="retrying later"):
            await index.live_workers()  # no network call during the retry interval
        assert index.num_unavailable == 2

    run(body, redis_server.url, retry_interval_s=3600.0)


def test_cache_salt_isolates_tenants(redis_url: str) -> None:
    tenant_a, tenant_b, unsalted = (prompt_hashes(4, salt) for salt in ("a", "b", None))
    assert not set(tenant_a) & set(tenant_b) and not set(tenant_a) & set(unsalted)
    worker = PoolWorker(redis_url, "w")
    worker.cache(*tenant_a)
    assert worker.step()

    async def body(index: PrefixIndex) -> list[dict[str, int]]:
        return [await index.prefix_overlap(h, ["w"]) for h in (tenant_a, tenant_b, unsalted)]

    assert run(body, redis_url) == [{"w": 4}, {"w": 0}, {"w": 0}]


def test_close_logs_a_connection_that_will_not_close(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """What a slow or gone Redis does to redis-py's aclose (TimeoutError, seen on a loaded CI
    machine) is logged: whoever shuts down after the index (LocalCluster: the controller, Ray)
    still runs."""

    async def main() -> None:
        index = PrefixIndex(redis_url, MODEL, retry_interval_s=0.0)
        assert await index.live_workers() == []  # a real connection to close
        real_aclose = index._client.aclose

        async def timing_out() -> None:
            await real_aclose()
            raise redis.exceptions.TimeoutError("Timed out closing connection after 0.25")

        index._client.aclose = timing_out
        with caplog.at_level(logging.INFO, logger="router.prefix_index"):
            await index.close()

    asyncio.run(main())
    assert "Timed out closing connection" in caplog.text


def test_health_asks_redis_itself_and_says_when_it_died(redis_server: RedisServer) -> None:
    """/health and /ready said "redis": "ok" for ~30 s after Redis died (until a routing call
    failed): the health check asks Redis when its last check is old."""

    def gauge(metrics: RouterMetrics) -> str:  # kvrelay_prefix_index_available's value
        text = metrics.render().decode().splitlines()
        [line] = [x for x in text if x.startswith("kvrelay_prefix_index_available ")]
        return line.split()[1]

    async def body(index: PrefixIndex) -> None:
        backend = ClusterBackend(MODEL, 64, 1000, 16, WorkerSet(), index=index)
        backend.metrics = metrics = RouterMetrics()
        assert (await backend.health())["redis"] == "ok"
        redis_server.stop()
        backend._redis_checked = 0.0  # as REDIS_CHECK_S later
        assert (await backend.health())["redis"] == "unavailable"
        redis_server.restart()
        backend._redis_checked = 0.0
        assert (await backend.health())["redis"] == "ok"
        # a /metrics scrape of an idle router asks too: the gauge follows Redis, not placements
        redis_server.stop()
        backend._redis_checked = 0.0
        await backend.refresh_metrics()
        assert gauge(metrics) == "0.0"
        redis_server.restart()
        backend._redis_checked = 0.0
        await backend.refresh_metrics()
        assert gauge(metrics) == "1.0"
        await backend.close()

    run(body, redis_server.url)
