"""IndexUpkeep: a worker's entries in the Redis index, kept up from its engine thread. Owns its
publisher, the KV events not yet written, when the next write is due and when a resync may come
again. worker_load: the load a worker publishes, read off its engine's snapshot."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from common.cluster_state import WorkerState
from common.kv_publisher import KVPublisher
from common.messages import WorkerLoad

if TYPE_CHECKING:
    from engine.engine import Engine
    from engine.kv_cache.block_pool import KVEvent
    from engine.step.step_types import EngineSnapshot

RESYNC_MIN_INTERVAL_S = 5.0  # however many routers ask, a full re-publish at most this often


def worker_load(snapshot: EngineSnapshot) -> WorkerLoad:
    return WorkerLoad(
        running=snapshot.num_running,
        waiting=snapshot.num_waiting,
        free_blocks=snapshot.num_free_blocks,
        total_blocks=snapshot.num_total_blocks,
        queued_tokens=snapshot.num_queued_tokens,
        prefill_tok_s=round(snapshot.tokens_per_s),
        step_us=round(snapshot.step_s * 1e6),
        prompt_tok_s=round(snapshot.prompt_tokens_per_s),
        disk_load_us=_load_us(recent_read_s(snapshot, "disk")),
        shared_load_us=_load_us(recent_read_s(snapshot, "shared")),
        host_load_us=_load_us(recent_read_s(snapshot, "host")),
    )


def _load_us(seconds: float) -> int:
    """Microseconds, at least 1 once measured (0 says: not measured)."""
    return max(1, round(seconds * 1e6)) if seconds > 0 else 0


def recent_read_s(snapshot: EngineSnapshot, tier: str) -> float:
    """A tier's recent time to load one block: a file tier's read and check, the one the
    worker's read gate weighs for that tier (recent, not the mean since start: a disk that got
    slower, or faster, must turn the routers' credit as it turns the gate); the host tier's
    copy back, measured at start. 0: not measured yet, or the worker has no such tier."""
    by_tier = {stats.tier: stats.recent_load_s for stats in snapshot.tiers}
    return by_tier.get(tier) or 0.0


class IndexUpkeep:
    """Each tick takes the engine's new KV events; they are written in order, at most once per
    `publish_interval_s` (0: at every tick that has any), and their write refreshes the worker's
    load and TTL. A heartbeat goes out when nothing was written for `heartbeat_s`. Without
    Redis (no publisher) the events are dropped and every call is a no-op. Times are one
    monotonic clock's, the caller's. `load`: the load it publishes (the worker's: its
    engine's, worker_load of a snapshot, and what waits outside the engine)."""

    def __init__(
        self,
        publisher: KVPublisher | None,
        engine: Engine,
        heartbeat_s: float,
        publish_interval_s: float,
        load: Callable[[], WorkerLoad],
    ) -> None:
        self.publisher = publisher
        self.engine = engine
        self._load = load
        self.heartbeat_s = heartbeat_s
        self.publish_interval_s = publish_interval_s
        self._pending: list[KVEvent] = []
        self._last_write = float("-inf")
        self._next_resync = 0.0  # a resync asked before this is skipped

    def tick(self, now: float) -> None:
        events = self.engine.drain_kv_events()
        if self.publisher is None:
            return
        self._pending += events
        if self._pending and now - self._last_write >= self.publish_interval_s:
            self.publisher.publish(self._pending, self._load())
            self._pending, self._last_write = [], now
        elif now - self._last_write >= self.heartbeat_s:
            self.publisher.heartbeat(self._load())
            self._last_write = now

    def publish_state(self, state: WorkerState) -> None:
        """The controller moved the worker: routers read the new state on their next placement."""
        if self.publisher is not None:
            self.publisher.state = state.value
            self.publisher.heartbeat(self._load())

    def resync(self, now: float) -> bool:
        """A router saw this worker's entries drift: re-publish the full state (at most once per
        RESYNC_MIN_INTERVAL_S). True if one was queued."""
        if self.publisher is None or now < self._next_resync:
            return False
        self._next_resync = now + RESYNC_MIN_INTERVAL_S
        self.publisher.mark_dirty()
        self.publisher.heartbeat(self._load())
        return True

    def withdraw(self) -> None:
        """The worker leaves: its HASH, block entries and registration go, for every router at
        once."""
        if self.publisher is not None:
            self.publisher.withdraw()
            self.publisher.close()


def make_publisher(
    redis_url: str | None,
    worker_id: str,
    engine: Engine,
    actor_name: str,
    role: str,
    agent_name: str,
) -> KVPublisher | None:
    """The worker's Redis publisher, or None when the cluster runs without Redis. A worker that
    records no KV events publishes no blocks (the engine gives no hashes), not a stale list."""
    if not redis_url:
        return None
    return KVPublisher(
        redis_url,
        engine.model_id,
        worker_id,
        role,
        cached_hashes=engine.cached_hashes,
        host_hashes=engine.host_cached_hashes,
        disk_hashes=engine.disk_cached_hashes,
        actor_name=actor_name,
        nixl_agent=agent_name,
    )
