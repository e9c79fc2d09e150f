"""RateLimiter: per-tenant requests per second, tokens per minute and concurrent streams, shared
by every router through Redis (router/rate_limit_schema.py); owns this router's Redis client for
them, the leases of its requests in flight and the outage state.

A request is admitted by one script run that charges every limit or none; tokens per minute are
charged prompt + n * max_tokens on admission and corrected to prompt + generated tokens when the
request ends; its stream slot is given back however it ends (release() runs in the Frontend's
shielded cleanup; a lease renewed while it runs frees the slot of a router that died).

Redis down: FAIL OPEN. Every request is admitted with no limit (limits protect the cluster's
fairness, not its security: keys are checked locally and keep working), the router logs one
warning per outage and /metrics shows kvrelay_rate_limits_available 0 until Redis answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import Callable, Mapping
from typing import NamedTuple

from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from common.redis_url import check_url, describe_failure, router_client
from router import rate_limit_schema as schema
from router.errors import RateLimited
from router.metrics import RouterMetrics
from router.tenant_limits import LIMIT_TITLES, NO_LIMITS, TenantLimits

log = logging.getLogger(__name__)
DEFAULT_LEASE_S = 60.0  # a stream slot's lease, renewed every third of it while the request runs


class Grant(NamedTuple):
    """An admitted request's hold on its tenant's limits (counted: False when Redis was down;
    unsure: Redis stalled past the admission's timeout, so it may yet run the admission)."""

    tenant: str
    member: str
    limits: TenantLimits
    num_charged_tokens: int
    counted: bool
    unsure: bool = False


class RateLimiter:
    """Use from one event loop (the router's). Invariant: every Grant with counted=True is
    released exactly once; until then its member is in the tenant's streams ZSET, its lease
    renewed every lease_s / 3."""

    def __init__(
        self,
        redis_url: str,
        limits_by_tenant: Mapping[str, TenantLimits],
        defaults: TenantLimits = NO_LIMITS,
        metrics: RouterMetrics | None = None,  # for kvrelay_rate_limits_available
        clock: Callable[[], float] = time.time,
        lease_s: float = DEFAULT_LEASE_S,
        timeout_s: float = 0.25,
        retry_interval_s: float = 1.0,
        router_id: str | None = None,
    ):
        self.limits_by_tenant = limits_by_tenant
        self.defaults = defaults
        self.metrics = metrics
        self.clock = clock
        self.lease_s = lease_s
        self.retry_interval_s = retry_interval_s
        self.router_id = router_id or uuid.uuid4().hex[:12]
        self._redis_url = check_url(redis_url)
        self._client = router_client(redis_url, timeout_s)
        self._admit_script = self._client.register_script(schema.ADMIT_SCRIPT)
        self._release_script = self._client.register_script(schema.RELEASE_SCRIPT)
        self._held: dict[str, str] = {}  # member -> its tenant's streams key, for lease renewal
        self._renewer: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()  # releases of grants whose caller left
        self._down_until = 0.0  # monotonic time before which Redis is not asked again
        self._outage: str | None = None  # the failure logged for the current outage

    async def check(self) -> None:
        """Ask Redis now (a /metrics scrape: kvrelay_rate_limits_available follows Redis, not
        only the requests that happen to come); nothing while a failure's retry interval runs."""
        if time.monotonic() < self._down_until:
            return
        try:
            await self._client.ping()
        except (RedisError, OSError) as e:
            self._failed(e)
        else:
            self._answered()

    def limits(self, tenant: str) -> TenantLimits:
        return self.limits_by_tenant.get(tenant, NO_LIMITS).over(self.defaults)

    async def admit(self, tenant: str, req_id: str, num_tokens: int) -> Grant:
        """Charge one request of `num_tokens` (prompt + n * max_tokens) to the tenant; raises
        RateLimited naming the first limit that refuses it (nothing charged then). Cancelled
        while Redis answers: a grant it made is released in the background."""
        admitting = asyncio.ensure_future(self._admit(tenant, req_id, num_tokens))
        try:
            return await asyncio.shield(admitting)
        except asyncio.CancelledError:
            task = asyncio.ensure_future(self._give_back(admitting))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            raise

    async def release(self, grant: Grant, num_prompt_tokens: int, num_output_tokens: int) -> None:
        """Give the grant's stream slot back and its unused tokens to the tpm bucket; count the
        tokens used. Never raises (a failure is logged; the lease frees the slot later)."""
        self._held.pop(grant.member, None)
        keys = schema.TenantKeys.of(grant.tenant)
        if grant.unsure:  # a stalled Redis may have run its admission since: take the slot back
            with contextlib.suppress(RedisError, OSError):
                await self._client.zrem(keys.streams, grant.member)
        if not grant.counted:
            return
        tpm = grant.limits.tpm or 0
        refund = max(0, grant.num_charged_tokens - num_prompt_tokens - num_output_tokens)
        args = [self.clock(), grant.member, refund, tpm, tpm / 60, num_prompt_tokens]
        args += [num_output_tokens, schema.USAGE_TTL_S]
        try:
            await self._release_script(keys=[keys.tpm, keys.streams, keys.usage], args=args)
        except (RedisError, OSError) as e:
            self._failed(e)

    async def close(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            await asyncio.gather(self._renewer, return_exceptions=True)
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._client.aclose()

    # ---- inside ----------------------------------------------------------------------------
    async def _admit(self, tenant: str, req_id: str, num_tokens: int) -> Grant:
        limits = self.limits(tenant)
        member = f"{self.router_id}/{req_id}"
        if time.monotonic() < self._down_until:
            return Grant(tenant, member, limits, num_tokens, counted=False)
        keys = schema.TenantKeys.of(tenant)
        now = self.clock()
        rps, tpm = limits.rps or 0, limits.tpm or 0
        args = [now, member, now + self.lease_s, max(1.0, rps) if rps else 0, rps, tpm, tpm / 60]
        args += [num_tokens, limits.streams or 0, schema.USAGE_TTL_S, limits.describe()]
        try:
            admitted, name, wait = await self._admit_script(keys=list(keys), args=args)
        except (RedisError, OSError) as e:
            self._failed(e)
            unsure = isinstance(e, RedisTimeoutError | TimeoutError)  # sent, maybe to be run
            return Grant(tenant, member, limits, num_tokens, counted=False, unsure=unsure)
        self._answered()
        if not admitted:
            raise self._refusal(tenant, limits, name, float(wait), num_tokens)
        self._held[member] = keys.streams
        self._start_renewer()
        return Grant(tenant, member, limits, num_tokens, counted=True)

    def _refusal(
        self, tenant: str, limits: TenantLimits, name: str, wait_s: float, num_tokens: int
    ) -> RateLimited:
        limit = getattr(limits, name)
        title = f"{LIMIT_TITLES[name]} ({name})"
        if wait_s < 0:  # more tokens than the bucket holds: no wait will do
            message = (
                f"rate limit: this request needs {num_tokens} tokens (prompt + n * max_tokens), "
                f"more than the limit of tenant {tenant!r}: {limit:g} {title}; lower max_tokens "
                "(one not set is the context the prompt leaves)"
            )
            return RateLimited(message, name, None)
        retry_s = max(1, math.ceil(wait_s))
        message = (
            f"rate limit reached for tenant {tenant!r} on {title}: limit {limit:g}; "
            f"retry in {retry_s} s"
        )
        return RateLimited(message, name, retry_s)

    async def _give_back(self, admitting: asyncio.Future[Grant]) -> None:
        """Release the grant of an admission whose caller left (a refusal holds nothing)."""
        try:
            grant = await admitting
        except RateLimited:
            return
        await self.release(grant, 0, 0)

    def _start_renewer(self) -> None:
        if self._renewer is None or self._renewer.done():
            self._renewer = asyncio.ensure_future(self._renew_leases())

    async def _renew_leases(self) -> None:
        while self._held:
            await asyncio.sleep(self.lease_s / 3)
            await self._renew_leases_once()

    async def _renew_leases_once(self) -> None:
        """Push the lease end of each member this router holds (ZADD XX: a member released
        meanwhile is not brought back)."""
        end = self.clock() + self.lease_s
        try:
            async with self._client.pipeline(transaction=False) as pipe:
                for member, key in list(self._held.items()):
                    pipe.zadd(key, {member: end}, xx=True)
                    pipe.expire(key, math.ceil(2 * self.lease_s) + 1)
                await pipe.execute()
        except (RedisError, OSError) as e:
            self._failed(e)

    def _failed(self, error: BaseException) -> None:
        self._down_until = time.monotonic() + self.retry_interval_s
        if self.metrics is not None:
            self.metrics.rate_limits_available.set(0)
        failure = describe_failure(self._redis_url, error)
        if failure.kind != self._outage:
            self._outage = failure.kind
            log.warning(
                "per-key limits OFF (failing open): %s; every request is admitted without "
                "limits until Redis answers",
                failure.message,
            )

    def _answered(self) -> None:
        if self._outage is not None:
            log.warning("per-key limits back ON: Redis answers again")
            self._outage = None
            if self.metrics is not None:
                self.metrics.rate_limits_available.set(1)
