"""RateLimiter and its Lua scripts against a real redis-server, on a clock the test moves: token
buckets refused at their rate and not below it (two limiters, as two routers, share them), the
Retry-After they give, tokens per minute corrected at the end, stream slots given back and
lost leases freed, nothing charged for a refusal, the usage counters `kvrelay status --keys`
reads, and failing open while Redis is down."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

import pytest
import redis

from router.errors import RateLimited
from router.metrics import RouterMetrics
from router.rate_limit_schema import TenantKeys, read_usage
from router.rate_limits import RateLimiter
from router.tenant_limits import TenantLimits
from tests.manual_clock import ManualClock
from tests.redis_server import RedisServer

T0 = 1_800_000_000.0


def limiter(url: str, clock: ManualClock, **limits: TenantLimits) -> RateLimiter:
    return RateLimiter(url, limits, clock=clock, metrics=RouterMetrics(), lease_s=30.0)


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(coro)


async def refusal(limiter: RateLimiter, tenant: str, req_id: str, tokens: int = 1) -> RateLimited:
    with pytest.raises(RateLimited) as info:
        await limiter.admit(tenant, req_id, tokens)
    return info.value


def test_requests_per_second_across_two_routers(redis_url: str) -> None:
    clock = ManualClock(T0)

    async def body() -> None:
        limits = {"a": TenantLimits(rps=4), "b": TenantLimits(rps=4)}
        routers = [limiter(redis_url, clock, **limits), limiter(redis_url, clock, **limits)]
        for i in range(4):  # the bucket's 4, taken through both routers in turn
            await routers[i % 2].admit("a", f"a{i}", 1)
        for router in routers:
            error = await refusal(router, "a", "a-over")
            assert error.limit == "rps" and error.retry_after_s == 1
            assert "requests per second (rps): limit 4" in error.message
        for i in range(4):  # another tenant's bucket is its own: none refused at its rate
            await routers[i % 2].admit("b", f"b{i}", 1)
        clock.now += 0.25  # one token back
        await routers[1].admit("a", "a4", 1)
        await refusal(routers[0], "a", "a5")
        clock.now += 10  # full again, never more than its capacity
        for i in range(4):
            await routers[i % 2].admit("a", f"a-later{i}", 1)
        await refusal(routers[1], "a", "a-later4")
        for router in routers:
            await router.close()

    run(body())


def test_a_slow_rate_waits_whole_seconds(redis_url: str) -> None:
    clock = ManualClock(T0)

    async def body() -> None:
        one = limiter(redis_url, clock, a=TenantLimits(rps=0.25))
        await one.admit("a", "r0", 1)  # capacity 1
        assert (await refusal(one, "a", "r1")).retry_after_s == 4
        clock.now += 3.5
        assert (await refusal(one, "a", "r1")).retry_after_s == 1  # 0.5 s rounded up
        clock.now += 0.5
        await one.admit("a", "r1", 1)
        clock.now -= 100  # a router whose clock lags: the bucket does not go back
        assert (await refusal(one, "a", "r2")).retry_after_s == 4
        await one.close()

    run(body())


def test_tokens_per_minute_are_charged_then_corrected(redis_url: str) -> None:
    clock = ManualClock(T0)
    keys = TenantKeys.of("a")
    store = redis.Redis.from_url(redis_url, decode_responses=True)

    async def body() -> None:
        one = limiter(redis_url, clock, a=TenantLimits(tpm=60))  # a token a second
        grant = await one.admit("a", "r0", 50)  # prompt 10 + max_tokens 40
        error = await refusal(one, "a", "r1", 20)
        assert error.limit == "tpm" and error.retry_after_s == 10
        assert "tokens per minute (tpm): limit 60" in error.message
        await one.release(grant, 10, 5)  # 35 of the 50 were not used: back in the bucket
        assert float(store.hget(keys.tpm, "tokens")) == pytest.approx(45)
        await one.admit("a", "r1", 20)
        too_big = await refusal(one, "a", "r2", 61)
        assert too_big.retry_after_s is None and "lower max_tokens" in too_big.message
        await one.close()

    run(body())
    usage = {row.tenant: row for row in read_usage(store, clock.now)}
    assert usage["a"].counts["requests"] == 2
    assert usage["a"].counts["prompt_tokens"] == 10
    assert usage["a"].counts["completion_tokens"] == 5
    assert usage["a"].counts["refused_tpm"] == 2
    assert usage["a"].limits == "tpm=60"
    assert usage["a"].num_streams == 1  # r1 still runs


def test_stream_slots_are_given_back_and_a_refusal_charges_nothing(redis_url: str) -> None:
    clock = ManualClock(T0)
    keys = TenantKeys.of("a")
    store = redis.Redis.from_url(redis_url, decode_responses=True)

    async def body() -> None:
        routers = [
            limiter(redis_url, clock, a=TenantLimits(rps=5, tpm=600, streams=2)) for _ in range(2)
        ]
        first = await routers[0].admit("a", "r0", 10)
        await routers[1].admit("a", "r1", 10)
        error = await refusal(routers[0], "a", "r2", 10)
        assert error.limit == "streams" and error.retry_after_s == 1
        assert "concurrent streams (streams): limit 2" in error.message
        assert float(store.hget(keys.rps, "tokens")) == 3  # the refused one took no token
        assert float(store.hget(keys.tpm, "tokens")) == 580
        await routers[0].release(first, 10, 0)
        await routers[0].admit("a", "r2", 10)  # the slot came back
        await refusal(routers[1], "a", "r3", 10)
        await routers[0].close()  # a router that stops renewing its leases (it died)...
        clock.now += 31  # ...loses its slot when its lease runs out; the live router renews
        await routers[1]._renew_leases_once()
        await routers[1].admit("a", "r3", 10)
        await refusal(routers[1], "a", "r4", 10)
        await routers[1].close()

    run(body())
    assert read_usage(store, clock.now)[0].counts["refused_streams"] == 3


def test_redis_down_fails_open_and_says_so(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    clock = ManualClock(T0)
    caplog.set_level(logging.WARNING, "router.rate_limits")

    async def body() -> None:
        one = limiter(redis_server.url, clock, a=TenantLimits(rps=1))
        one.retry_interval_s = 0.0  # ask Redis again at each request
        await one.admit("a", "r0", 1)
        await refusal(one, "a", "r1")
        redis_server.stop()
        grants = [await one.admit("a", f"down{i}", 1) for i in range(3)]
        assert not any(grant.counted for grant in grants)
        for grant in grants:
            await one.release(grant, 1, 1)
        assert one.metrics is not None
        assert "kvrelay_rate_limits_available 0.0" in one.metrics.render().decode()
        redis_server.restart()
        await one.admit("a", "r2", 1)  # an empty Redis: a full bucket
        await refusal(one, "a", "r3")
        assert "kvrelay_rate_limits_available 1.0" in one.metrics.render().decode()
        await one.close()

    run(body())
    off = [r for r in caplog.records if "per-key limits OFF (failing open)" in r.message]
    assert len(off) == 1  # once an outage, not once a request
    assert any("per-key limits back ON" in r.message for r in caplog.records)


def test_a_caller_cancelled_while_redis_admits_gives_the_grant_back(redis_url: str) -> None:
    clock = ManualClock(T0)
    store = redis.Redis.from_url(redis_url, decode_responses=True)
    keys = TenantKeys.of("a")

    async def body() -> None:
        one = limiter(redis_url, clock, a=TenantLimits(tpm=100, streams=1))
        admitting = asyncio.ensure_future(one.admit("a", "r0", 40))
        await asyncio.sleep(0)  # the script is on its way to Redis
        admitting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await admitting
        await one.close()  # waits for the background release

    run(body())
    [row] = read_usage(store, clock.now)
    assert row.counts["requests"] == 1 and row.num_streams == 0  # admitted, then given back
    assert float(store.hget(keys.tpm, "tokens")) == 100
    assert store.zcard(keys.streams) == 0


def test_the_available_gauge_follows_redis_on_a_scrape_with_no_request(
    redis_server: RedisServer,
) -> None:
    """An idle router: /metrics asks Redis (check), so the gauge drops during an outage and
    comes back after it without waiting for a request."""
    clock = ManualClock(T0)

    async def body() -> None:
        one = limiter(redis_server.url, clock, a=TenantLimits(rps=1))
        one.retry_interval_s = 0.0
        metrics = one.metrics
        assert metrics is not None

        def available() -> str:
            [line] = [
                line
                for line in metrics.render().decode().splitlines()
                if line.startswith("kvrelay_rate_limits_available ")
            ]
            return line.split()[1]

        await one.check()
        assert available() == "1.0"
        redis_server.stop()
        await one.check()
        assert available() == "0.0"
        redis_server.restart()
        await one.check()
        assert available() == "1.0"
        await one.close()

    run(body())


def test_an_admission_redis_ran_after_its_timeout_gives_its_slot_back(
    redis_server: RedisServer,
) -> None:
    """Redis stalled (SIGSTOP) past the admission's timeout: the request goes on uncounted (fail
    open), Redis runs the queued admission once it resumes, and the request's release takes
    that slot back rather than leave it held for a lease."""
    clock = ManualClock(T0)
    store = redis.Redis.from_url(redis_server.url, decode_responses=True)
    streams = TenantKeys.of("a").streams

    async def body() -> None:
        one = limiter(redis_server.url, clock, a=TenantLimits(streams=2))
        await one.release(await one.admit("a", "first", 1), 1, 1)  # the script is loaded
        redis_server.pause()
        try:
            grant = await one.admit("a", "stalled", 1)
        finally:
            redis_server.resume()
        assert not grant.counted and grant.unsure
        for _ in range(100):  # the queued admission runs once Redis resumes
            if store.zcard(streams):
                break
            await asyncio.sleep(0.02)
        assert store.zrange(streams, 0, -1) == [grant.member]
        one._down_until = 0.0  # its retry interval over
        await one.release(grant, 1, 1)
        assert store.zcard(streams) == 0
        await one.close()

    run(body())
