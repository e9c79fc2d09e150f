"""Worker side of the KV index: publishes one worker's KV events, load and liveness to Redis.

Owns the worker's sync Redis connection and its outage state (healthy / dirty). Torch-free; the
router's reader (router/prefix_index.py) and this writer share common/kv_index_schema.py.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from common import kv_index_schema as schema
from common.messages import WorkerLoad
from common.redis_url import RedisFailure, check_url, describe_failure
from engine.kv_cache.block_pool import BlockRemoved, BlockStored, KVEvent
from engine.kv_cache.hashing import hash_hex

log = logging.getLogger(__name__)

CachedHashes = Callable[[], Iterable[int]]
HOST_OPS = {"+": "h+", "-": "h-"}
DISK_OPS = {"+": "d+", "-": "d-"}


class KVPublisher:
    """Mirrors one worker's prefix cache and load into the Redis index.

    Invariants:
    - no method raises into the caller for a Redis failure (returns False instead, logs one
      line per outage, again only if its cause changes: unreachable / password refused / TLS),
      so the engine loop never stops because Redis did; a URL redis-py cannot use is a
      ValueError from the constructor;
    - each call is one round trip (one script run: the step's events in order, the load and
      the TTL refresh, applied atomically), plus one MULTI with the full state when needed;
    - every key it writes has a TTL (kv_index_schema): its own HASH and blocks SET are
      refreshed by every call; the block SETs it writes to and the registry, shared with other
      workers, are kept alive at least its blocks TTL by each write, and every block SET it
      holds a block in by a walk that starts every half blocks TTL and keeps a page of them
      (schema.KEEP_PAGE) alive in each call's script run, so no run blocks Redis for long;
    - a write is applied only under the epoch of the worker's latest full publish, so a step
      that timed out and reached Redis late cannot undo a newer resync;
    - after a failure, or when the worker's HASH is found missing (first publish, Redis restarted
      empty, TTL expired while the worker stalled), the next successful call re-publishes the
      full state from `cached_hashes()` instead of the delta, so the index is whole again;
    - after a failure, calls are skipped (return False at once) for `retry_interval_s`, so a dead
      Redis costs the engine loop at most one socket timeout per interval.
    Calls are serialised by a lock (heartbeat may run on another thread); `cached_hashes` must
    be safe to call from whichever thread calls publish/heartbeat.
    """

    def __init__(
        self,
        redis_url: str,
        model_id: str,
        worker_id: str,
        role: str,
        cached_hashes: CachedHashes,
        actor_name: str = "",
        host_hashes: CachedHashes = tuple,
        nixl_agent: str = "",
        disk_hashes: CachedHashes = tuple,
        ttl_s: float = 10.0,
        socket_timeout_s: float = 0.5,
        retry_interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.model_id = model_id
        self.worker_id = worker_id
        self.role = role
        self.actor_name = actor_name
        self.nixl_agent = nixl_agent
        self.state = "joining"  # a WorkerState value; the worker sets it, routers read it
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.retry_interval_s = retry_interval_s
        self._clock = clock  # seconds, monotonic: when to retry, when to keep block SETs alive
        self._cached_hashes = cached_hashes
        self._host_hashes = host_hashes
        self._disk_hashes = disk_hashes
        self._redis_url = check_url(redis_url)
        self._client = redis.Redis.from_url(
            redis_url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
            # one immediate retry on a dropped connection (stale socket after a Redis restart),
            # none on a timeout: a hung Redis must not stall the engine loop twice
            retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
            decode_responses=True,
        )
        self._delta = self._client.register_script(schema.DELTA_SCRIPT)
        self._forget = self._client.register_script(schema.FORGET_SCRIPT)
        self._keep = self._client.register_script(schema.KEEP_SCRIPT)
        self.blocks_ttl_ms = self.ttl_ms * schema.BLOCKS_TTL_FACTOR
        self._keep_blocks_at = 0.0  # when the next walk keeping its block SETs alive starts
        self._keep_cursor: str | None = None  # that walk's SSCAN cursor while it is under way
        self._keys = schema.worker_keys(model_id, worker_id)  # HASH, blocks SET, registry
        self._shared_key = schema.shared_key(model_id)
        self._block_prefix = schema.block_key_prefix(model_id)
        # the HASH's epoch changes at every resync; deltas carry it, so a late one is dropped
        self._nonce = os.urandom(4).hex()
        self._num_epochs = 0
        self._epoch = ""
        self._lock = threading.Lock()
        self._dirty = True  # nothing published yet: the first call publishes the full state
        self._failure: RedisFailure | None = None  # the current outage's cause; None: healthy
        self._retry_at = 0.0
        self.num_resyncs = 0
        self.num_failures = 0

    @property
    def healthy(self) -> bool:
        """False from a failed call until the next successful one."""
        return self._failure is None

    @property
    def dirty(self) -> bool:
        """True while the index may be missing part of this worker's state."""
        return self._dirty

    def publish(self, events: Sequence[KVEvent], load: WorkerLoad) -> bool:
        """Once per engine step: this step's KV events (in order) + load + TTL. True if written.

        `cached_hashes()` must already reflect `events` (a resync replaces them with it)."""
        return self._run(events, load)

    def heartbeat(self, load: WorkerLoad) -> bool:
        """Refresh load and TTL when the engine is idle (or between steps)."""
        return self._run((), load)

    def mark_dirty(self) -> None:
        """The index may have drifted from this worker's state: re-publish it in full next."""
        with self._lock:
            self._dirty = True

    def withdraw(self) -> bool:
        """Clean shutdown: remove this worker, its blocks and its load from the index."""
        with self._lock:
            try:
                self._forget(keys=self._keys, args=[self._block_prefix, self.worker_id, "withdraw"])
            except (redis.RedisError, OSError) as exc:
                failure = describe_failure(self._redis_url, exc).message
                log.warning("KV index: could not withdraw worker %s: %s", self.worker_id, failure)
                return False
            self._dirty = True
            return True

    def close(self) -> None:
        self._client.close()

    # ---- internals -----------------------------------------------------------------------
    def _run(self, events: Sequence[KVEvent], load: WorkerLoad) -> bool:
        with self._lock:
            if self._failure is not None and self._clock() < self._retry_at:
                return False
            shared = [e for e in events if e.tier == "shared"]
            if shared:
                events = [e for e in events if e.tier != "shared"]
            try:
                if shared:
                    self._write_shared(shared)
                if self._dirty or not self._write_delta(events, load):
                    self._resync(load)
            except (redis.RedisError, OSError) as exc:
                self._on_failure(exc)
                return False
            if self._failure is not None:
                log.info("KV index: Redis is back; worker %s re-published", self.worker_id)
            self._failure = None
            return True

    def _write_delta(self, events: Sequence[KVEvent], load: WorkerLoad) -> bool:
        """Apply events + load + TTL in one script call; False if the index needs a resync."""
        fields = self._fields(load)
        cursor = self._keep_cursor
        if cursor is None and self._clock() >= self._keep_blocks_at:
            cursor = "0"  # a walk over this worker's block SETs starts, a page a call
        args: list[str | int] = [self._block_prefix, self.worker_id, self._epoch, self.ttl_ms]
        args += (cursor or "", len(fields))
        for name, value in fields.items():
            args += (name, value)
        for event in events:
            op = "+" if isinstance(event, BlockStored) else "-"
            if not isinstance(event, BlockStored | BlockRemoved):
                raise TypeError(f"unknown KV event {event!r}")
            if event.tier == "host":
                op = HOST_OPS[op]
            elif event.tier == "disk":
                op = DISK_OPS[op]
            for block_hash in event.block_hashes:
                args += (op, hash_hex(block_hash))
        result = self._delta(keys=self._keys, args=args)
        if not result:
            return False
        if cursor is not None:
            self._keep_cursor = result[1]
            if result[1] == "0":  # the walk is over
                self._blocks_kept()
        return True

    def _write_shared(self, events: Sequence[KVEvent]) -> None:
        """The shared store's blocks this worker published or removed: the cluster-wide SET
        (no epoch: a block there is any worker's; lost with a failed call, the files stay)."""
        pipe = self._client.pipeline(transaction=False)
        for event in events:
            hexes = [hash_hex(h) for h in event.block_hashes]
            if isinstance(event, BlockStored):
                pipe.sadd(self._shared_key, *hexes)
                pipe.pexpire(self._shared_key, self.blocks_ttl_ms)
            else:
                pipe.srem(self._shared_key, *hexes)
        pipe.execute()

    def _blocks_kept(self) -> None:
        """Every block SET of this worker was just kept alive for the blocks TTL: again in half
        of it (long before any of them expires: a walk of KEEP_PAGE block SETs a call takes 100
        s for 200k of them at one call a second, the heartbeat's pace when idle)."""
        self._keep_cursor = None
        self._keep_blocks_at = self._clock() + self.blocks_ttl_ms / 2000

    def _resync(self, load: WorkerLoad) -> None:
        """Replace this worker's whole entry with its current state, in one MULTI."""
        hashes = [hash_hex(h) for h in self._cached_hashes()]
        host = [hash_hex(h) for h in self._host_hashes()]
        disk = [hash_hex(h) for h in self._disk_hashes()]
        self._num_epochs += 1
        self._epoch = f"{self._nonce}:{self._num_epochs}"
        pipe = self._client.pipeline(transaction=True)
        args = [self._block_prefix, self.worker_id, "resync"]
        self._forget(keys=self._keys, args=args, client=pipe)
        for h in hashes:
            pipe.sadd(self._block_prefix + h, self.worker_id)
        for h in host:
            pipe.sadd(self._block_prefix + h, self.worker_id + schema.HOST)
        for h in disk:
            pipe.sadd(self._block_prefix + h, self.worker_id + schema.DISK)
        entries = hashes + [h + schema.HOST for h in host] + [h + schema.DISK for h in disk]
        if entries:
            pipe.sadd(self._keys[1], *entries)
            pipe.pexpire(self._keys[1], self.blocks_ttl_ms)
        pipe.hset(self._keys[0], mapping=self._fields(load))
        pipe.pexpire(self._keys[0], self.ttl_ms)
        pipe.sadd(self._keys[2], self.worker_id)
        keep_args = [self._block_prefix, self.blocks_ttl_ms]
        self._keep(keys=self._keys[1:], args=keep_args, client=pipe)
        pipe.execute()
        self._blocks_kept()
        self._dirty = False
        self.num_resyncs += 1
        log.info(
            "KV index: worker %s published its full state (%d blocks, %d in its host tier, %d in "
            "its disk tier)",
            self.worker_id,
            len(hashes),
            len(host),
            len(disk),
        )

    def _fields(self, load: WorkerLoad) -> dict[str, str | int]:
        fields = schema.worker_fields(self.role, self.actor_name, self.nixl_agent, load, self.state)
        fields["epoch"] = self._epoch
        return fields

    def _on_failure(self, exc: BaseException) -> None:
        self._dirty = True
        self.num_failures += 1
        self._retry_at = self._clock() + self.retry_interval_s
        failure = describe_failure(self._redis_url, exc)
        last, self._failure = self._failure, failure
        if last is not None and last.kind == failure.kind:
            return  # logged once per outage (and cause)
        if failure.kind == "unreachable":
            log.warning(
                "KV index: %s; worker %s keeps serving and will re-publish its full state when "
                "Redis is back",
                failure.message,
                self.worker_id,
            )
        else:  # a wrong password or TLS setting does not heal by itself: say what to fix
            log.error(
                "KV index: %s; worker %s keeps serving without the index until the Redis URL "
                "is fixed (retrying every %g s)",
                failure.message,
                self.worker_id,
                self.retry_interval_s,
            )
