"""Router side of the KV index: asyncio reads of membership, load and prefix overlap from Redis.

Owns the router's redis.asyncio connection pool and its outage state (circuit breaker).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NamedTuple, TypeVar

from redis.exceptions import RedisError

from common import kv_index_schema as schema
from common.messages import WorkerInfo
from common.redis_url import RedisFailure, check_url, describe_failure, router_client
from engine.kv_cache.hashing import hash_hex
from router.policy import Overlap

log = logging.getLogger(__name__)
T = TypeVar("T")


class IndexUnavailable(RuntimeError):
    """Redis cannot be reached, timed out or refused the password / TLS handshake: route by load
    alone for now (the message says which, the URL redacted)."""


class IndexView(NamedTuple):
    """Live workers of one role, sorted by worker_id, and how many leading prompt blocks each
    holds, of them how many only in its host tier (every worker in `workers` has an entry; 0
    when it holds none)."""

    workers: list[WorkerInfo]
    overlap: Overlap


class PrefixIndex:
    """Reads the cluster KV index of one model; every public call is one Redis round trip.

    Invariants:
    - a call either returns data read in one atomic script run, or raises IndexUnavailable
      within about `timeout_s` (never hangs on a stalled Redis);
    - after a failure, calls raise IndexUnavailable at once for `retry_interval_s`, then try
      Redis again (the pool reconnects by itself) — the router never waits on a dead Redis;
    - only workers whose HASH is live (TTL not expired) are returned; dead ones found on the way
      are forgotten in the background (their block entries removed) when `reap_dead` is set;
    - an outage is logged once, again only if its cause changes (unreachable / password refused /
      TLS); a URL redis-py cannot use is a ValueError from the constructor.
    Use from one event loop (the router's).
    """

    def __init__(
        self,
        redis_url: str,
        model_id: str,
        timeout_s: float = 0.25,
        retry_interval_s: float = 1.0,
        reap_dead: bool = True,
        shared_store: bool = False,
    ) -> None:
        """shared_store: the workers publish to a cluster-shared KV store, so each lookup also
        asks which blocks it lists (one more command, SMISMEMBER: Redis 6.2 or later)."""
        self.model_id = model_id
        self.shared_store = shared_store
        self.timeout_s = timeout_s
        self.retry_interval_s = retry_interval_s
        self.reap_dead = reap_dead
        self._redis_url = check_url(redis_url)
        self._client = router_client(redis_url, timeout_s)
        self._view_script = self._client.register_script(schema.VIEW_SCRIPT)
        self._overlap_script = self._client.register_script(schema.OVERLAP_SCRIPT)
        self._forget_script = self._client.register_script(schema.FORGET_SCRIPT)
        self._failure: RedisFailure | None = None  # the current outage's cause; None: available
        self._retry_at = 0.0
        self._reaping: dict[str, asyncio.Task[int]] = {}  # worker_id -> forget task
        self.num_unavailable = 0  # calls answered with IndexUnavailable (for metrics)

    @property
    def available(self) -> bool:
        """False from a failed call until the next successful one."""
        return self._failure is None

    async def view(self, role: str, block_hashes: Sequence[int]) -> IndexView:
        """Live workers of `role` ('' for all) and their leading-block overlap with the prompt."""
        keys = [schema.registry_key(self.model_id)]
        keys += [schema.block_key(self.model_id, h) for h in block_hashes]
        args = [schema.worker_key_prefix(self.model_id), role]
        reply, shared = await self._call(
            lambda: self._with_shared(self._view_script(keys=keys, args=args), block_hashes)
        )
        ids, rows, counts, dead = reply
        workers = [parse(wid, row) for wid, row in zip(ids, rows, strict=True)]
        order = sorted(range(len(ids)), key=lambda i: ids[i])
        self._reap(dead)
        overlap = _overlap([ids[i] for i in order], ids, counts, shared)
        return IndexView([workers[i] for i in order], overlap)

    async def probe(self) -> bool:
        """One read at startup, so a refused password or TLS setting is logged before the first
        request is routed; True if Redis answered."""
        try:
            await self.live_workers()
        except IndexUnavailable:
            return False
        return True

    async def live_workers(self, role: str = "") -> list[WorkerInfo]:
        """Live workers of `role` ('' for all), sorted by worker_id, with their latest load."""
        return (await self.view(role, ())).workers

    async def prefix_overlap(
        self, block_hashes: Sequence[int], worker_ids: Sequence[str]
    ) -> Overlap:
        """worker_id -> number of leading blocks of `block_hashes` it holds (stops at a gap),
        device memory first, then its host tier, then its disk tier, then the cluster-shared
        store (`.host`, `.disk`, `.shared`: how many of those)."""
        if not worker_ids:
            return Overlap()
        keys = [schema.block_key(self.model_id, h) for h in block_hashes]
        counts, shared = await self._call(
            lambda: self._with_shared(
                self._overlap_script(keys=keys, args=list(worker_ids)), block_hashes
            )
        )
        return _overlap(list(worker_ids), list(worker_ids), counts, shared)

    async def forget_worker(self, worker_id: str, force: bool = False) -> int:
        """Remove a worker's blocks and membership; unless `force`, only if its HASH has expired.

        Returns the number of block entries removed, -1 if the worker was alive (not forced).
        """
        mode = "withdraw" if force else "dead"
        keys = schema.worker_keys(self.model_id, worker_id)
        args = [schema.block_key_prefix(self.model_id), worker_id, mode]
        return int(await self._call(lambda: self._forget_script(keys=keys, args=args)))

    async def close(self) -> None:
        """Stop the reaping tasks and close the connections. Best effort: a connection that
        will not close in time (a Redis that is down or slow) is logged, not raised, so that
        whoever shuts down after the index still does."""
        tasks = list(self._reaping.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        try:
            await self._client.aclose()
        except RedisError as e:
            log.info("KV index: closing the Redis connections: %s", e)

    async def __aenter__(self) -> PrefixIndex:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # ---- internals -----------------------------------------------------------------------
    async def _with_shared(
        self, script_reply: Awaitable[Any], block_hashes: Sequence[int]
    ) -> tuple[Any, list[int]]:
        """The script's reply, and which of the blocks the shared store lists (1 / 0 each)."""
        reply = await script_reply
        if not block_hashes or not self.shared_store:
            return reply, []
        hexes = [hash_hex(h) for h in block_hashes]
        shared = await self._client.smismember(schema.shared_key(self.model_id), hexes)
        return reply, [int(flag) for flag in shared]

    async def _call(self, request: Callable[[], Awaitable[T]]) -> T:
        if self._failure is not None and time.monotonic() < self._retry_at:
            self.num_unavailable += 1
            raise IndexUnavailable(f"{self._failure.message}; retrying later, route by load")
        try:
            async with asyncio.timeout(self.timeout_s * 2):
                result = await request()
        except (RedisError, OSError, TimeoutError) as exc:
            failure = self._on_failure(exc)
            raise IndexUnavailable(f"{failure.message}; route by load") from exc
        if self._failure is not None:
            log.warning("KV index: Redis is reachable again; KV-aware routing resumes")
        self._failure = None
        return result

    def _on_failure(self, exc: BaseException) -> RedisFailure:
        self.num_unavailable += 1
        self._retry_at = time.monotonic() + self.retry_interval_s
        failure = describe_failure(self._redis_url, exc)
        if self._failure is None or failure.kind != self._failure.kind:
            if failure.kind == "unreachable":
                log.warning("KV index: %s; routing by load alone", failure.message)
            else:  # a wrong password or TLS setting does not heal by itself: say what to fix
                log.error(
                    "KV index: %s; routing by load alone until the Redis URL is fixed",
                    failure.message,
                )
        self._failure = failure
        return failure

    def _reap(self, dead_ids: Sequence[str]) -> None:
        if not self.reap_dead:
            return
        for worker_id in dead_ids:
            if worker_id not in self._reaping:
                task = asyncio.create_task(self._forget_quietly(worker_id))
                self._reaping[worker_id] = task
                task.add_done_callback(lambda _, wid=worker_id: self._reaping.pop(wid, None))

    async def _forget_quietly(self, worker_id: str) -> int:
        try:
            num_removed = await self.forget_worker(worker_id)
        except IndexUnavailable:
            return 0  # the next view() finds it dead again
        except Exception:  # a background task: log, never leave an unretrieved exception
            log.exception("KV index: could not forget dead worker %s", worker_id)
            return 0
        if num_removed >= 0:
            log.info(
                "KV index: forgot worker %s (%d blocks): its entry expired (it died, or stalled "
                "past its TTL: a live one re-publishes on its next heartbeat)",
                worker_id,
                num_removed,
            )
        return num_removed


def _overlap(
    wanted: Sequence[str], ids: Sequence[str], counts: Sequence[int], shared: Sequence[int] = ()
) -> Overlap:
    """The overlap script's flat (device, host, disk) counts per id, for the wanted ids; past
    each one's own blocks, the run of blocks the shared store lists (shared: 1 / 0 a block)."""
    at = {worker_id: i for i, worker_id in enumerate(ids)}
    device = {w: int(counts[3 * at[w]]) for w in wanted}
    host = {w: int(counts[3 * at[w] + 1]) for w in wanted}
    disk = {w: int(counts[3 * at[w] + 2]) for w in wanted}
    own = {w: device[w] + host[w] + disk[w] for w in wanted}
    store = {w: _run_length(shared, own[w]) for w in wanted}
    return Overlap({w: own[w] + store[w] for w in wanted}, host, disk, store)


def _run_length(flags: Sequence[int], start: int) -> int:
    """How many flags from start on are set before the first unset one."""
    n = 0
    for flag in flags[start:]:
        if not flag:
            break
        n += 1
    return n


def parse(worker_id: str, row: Sequence[str]) -> WorkerInfo:
    """A WorkerInfo from an HGETALL reply as a flat [field, value, ...] list."""
    return schema.parse_worker(worker_id, dict(zip(row[::2], row[1::2], strict=True)))
