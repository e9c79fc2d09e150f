"""What the controller, the workers, the routers and the CLI say about the cluster's make-up (holds
no state): worker states and their timestamped transitions, per-worker figures, pool and router
status, the membership a router syncs, and the names that find the controller in Ray."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any

from common.messages import ServedModel, WorkerLoad
from common.placement_rules import LocalPrefill, SloTargets
from engine.kv_cache.tier_stats import TierStats

NAMESPACE = "kvrelay"  # the Ray namespace of every kvrelay actor
CONTROLLER_NAME = "kvrelay-controller"  # the controller's detached actor name
WARMUP_REQ_PREFIX = "kvrelay-warmup-"  # the controller's warm-up requests (not user traffic)
ROLES = ("prefill", "decode")


class WorkerUnavailable(RuntimeError):
    """A worker has stopped taking work (it drained or is shutting down): place elsewhere."""


class WorkerState(enum.StrEnum):
    """joining -> ready -> draining -> gone; joining -> gone when a start fails or is cancelled."""

    JOINING = "joining"  # actor starting: model loading, NIXL registration, handshake, warm-up
    READY = "ready"  # routers place on it
    DRAINING = "draining"  # no new placements; in-flight work finishes, then it exits
    GONE = "gone"  # exited, died or failed to start


@dataclass(frozen=True)
class Transition:
    state: WorkerState
    at: float  # time.time() where the transition happened
    note: str = ""


@dataclass(frozen=True)
class WorkerStats:
    """A worker's own figures, as it reports them (status, tests, the controller's drain): what
    both roles report. A worker answers with its role's subclass, PrefillStats or DecodeStats."""

    state: WorkerState
    load: WorkerLoad
    num_requests: int = 0  # user requests received (warm-ups not counted)
    num_in_flight: int = 0  # requests, leases, pulls and routes still open (0: drained)
    num_computed_tokens: int = 0  # tokens its engine computed (prefill: prompts, once each)
    num_preemptions: int = 0  # running requests its engine preempted (any cause)
    num_priority_preemptions: int = 0  # of those, for a request of higher priority
    # The prefix cache beyond whole device blocks.
    num_partial_reused_tokens: int = 0  # tokens reused from a partly matching cached block
    num_host_offloaded_blocks: int = 0  # cached blocks moved to the host tier when evicted
    num_host_hit_blocks: int = 0  # prefix blocks copied back from the host tier
    num_disk_stored_blocks: int = 0  # cached blocks written to the disk tier
    num_disk_hit_blocks: int = 0  # prefix blocks loaded back from the disk tier
    num_disk_hit_bytes: int = 0
    num_disk_bad_files: int = 0  # disk tier files found corrupt or truncated (recomputed)
    num_disk_write_failures: int = 0  # blocks the disk refused (full): not stored
    num_disk_cached_blocks: int = 0  # block files its disk tier holds now
    disk_load_s: float = 0.0  # seconds spent reading and checking disk tier files
    tiers: tuple[TierStats, ...] = ()  # each KV tier's size, use, hits and loads (status)
    # Speculative decoding: request-steps that verified drafts, tokens drafted, accepted.
    num_spec_verify_steps: int = 0
    num_spec_drafted_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    # The KV handoff's state machine (its blocks in each live state: the role's fields).
    num_stranded_blocks: int = 0  # held for a handoff, in no handoff state: must be 0
    handoff_transitions: tuple[tuple[str, int], ...] = ()  # ("held->being_read", count), ...
    first_request_at: float | None = None  # time.time() of its first user request
    ready_at: float | None = None  # time.time() it turned ready

    @property
    def prefix_hit_rate(self) -> float | None:
        """Of the prompt tokens it prefilled, the share found cached (None: none prefilled)."""
        return None

    @property
    def transfer_bytes_per_s(self) -> float | None:
        """The pace of its KV pulls (None: none pulled)."""
        return None


@dataclass(frozen=True)
class PrefillStats(WorkerStats):
    num_prompt_tokens: int = 0  # prompt tokens of finished user prefills
    num_cached_tokens: int = 0  # of those, found in its prefix cache
    num_host_leased_blocks: int = 0  # blocks leased from its host tier (host leases)
    num_blocks_held: int = 0  # leased, no read announced
    num_blocks_being_read: int = 0  # leased, a decode worker announced its read
    num_expired_leases: int = 0
    num_stale_releases: int = 0  # releases/notices of an ended lease or old epoch

    @property
    def prefix_hit_rate(self) -> float | None:
        return self.num_cached_tokens / self.num_prompt_tokens if self.num_prompt_tokens else None


@dataclass(frozen=True)
class DecodeStats(WorkerStats):
    num_transferred_blocks: int = 0  # blocks pulled over NIXL
    num_host_read_blocks: int = 0  # of those, read from a prefill worker's host tier
    num_transferred_bytes: int = 0
    transfer_seconds: float = 0.0  # summed time of those pulls
    num_recomputed: int = 0  # prompts recomputed because the pull failed
    num_orphans_aborted: int = 0  # requests of routers that stopped polling
    num_local_prefills: int = 0  # prompts it computed itself (conditional prefill, aggregated)
    num_local_prompt_tokens: int = 0  # their prompt tokens (counted at their first output)
    num_local_cached_tokens: int = 0  # of those, found in its prefix cache
    num_blocks_reserved: int = 0  # reserved for a pull not yet started
    num_blocks_reading: int = 0  # a NIXL read in flight into them
    num_refused_handshakes: int = 0  # prefill peers refused (protocol, model, layout)

    @property
    def transfer_bytes_per_s(self) -> float | None:
        return self.num_transferred_bytes / self.transfer_seconds if self.transfer_seconds else None


@dataclass(frozen=True)
class RankPlace:
    """Where one tensor-parallel rank of a worker runs (rank 0 hosts the worker's Engine)."""

    rank: int
    node_ip: str
    node_id: str
    pid: int
    device: str  # "cpu", or the GPU: "cuda:0 (GPU-<uuid>)" as the rank's process sees it

    def __str__(self) -> str:
        return f"rank {self.rank} {self.node_ip} pid {self.pid} {self.device}"


@dataclass(frozen=True)
class WorkerDescription:
    """What a worker tells the controller once its model is loaded and its KV pool registered."""

    worker_id: str
    role: str
    node_ip: str
    node_id: str  # Ray's node id (fake multi-node clusters share one IP)
    pid: int
    model: ServedModel
    ranks: tuple[RankPlace, ...] = ()  # tensor-parallel ranks, rank 0 first; () for one rank


@dataclass(frozen=True)
class LeakCheck:
    """A worker's block accounting taken before it exits (drain) or on request."""

    num_free_blocks: int
    num_total_blocks: int
    num_held_blocks: int = 0  # prefill: blocks still under a lease
    num_requests: int = 0
    num_stranded_blocks: int = 0  # held for a handoff that no handoff state accounts for

    @property
    def clean(self) -> bool:
        return (
            self.num_free_blocks == self.num_total_blocks
            and not self.num_held_blocks
            and not self.num_requests
            and not self.num_stranded_blocks
        )


@dataclass(frozen=True)
class Member:
    """One worker as routers see it from the controller (membership when Redis is down)."""

    worker_id: str
    role: str
    actor_name: str
    state: WorkerState


@dataclass(frozen=True)
class WorkerStatus:
    worker_id: str
    role: str
    state: WorkerState
    transitions: tuple[Transition, ...]
    node_ip: str = ""
    node_id: str = ""
    pid: int = 0
    stats: WorkerStats | None = None  # None: the worker did not answer (joining, gone)
    exit_check: LeakCheck | None = None  # taken when it drained
    error: str | None = None  # why it is gone, when it did not drain
    ranks: tuple[RankPlace, ...] = ()  # a tensor-parallel worker's ranks (its description's)


@dataclass(frozen=True)
class PoolStatus:
    role: str
    desired: int
    workers: tuple[WorkerStatus, ...]
    autoscale: str = ""  # "" when off; else its bounds and its last decision with the reason

    @property
    def num_ready(self) -> int:
        return sum(w.state == WorkerState.READY for w in self.workers)

    @property
    def settled(self) -> bool:
        return pool_settled(self.desired, [w.state for w in self.workers])


def pool_settled(desired: int, states: list[WorkerState]) -> bool:
    """A pool has reached its size: `desired` ready workers, none joining or draining."""
    busy = WorkerState.JOINING in states or WorkerState.DRAINING in states
    return not busy and states.count(WorkerState.READY) == desired


@dataclass(frozen=True)
class SloAttainment:
    """Of the requests one router finished recently, how many each objective judged and the
    fraction that met it (None: none to judge)."""

    num_ttft: int = 0
    ttft: float | None = None
    num_tpot: int = 0
    tpot: float | None = None


def combined_attainment(reports: list[SloAttainment], objective: str) -> float | None:
    """One fraction over several routers' reports ("ttft" or "tpot"), weighted by their counts;
    None when none judged anything."""
    total = sum(getattr(r, f"num_{objective}") for r in reports)
    if not total:
        return None
    met = sum(getattr(r, f"num_{objective}") * (getattr(r, objective) or 0.0) for r in reports)
    return met / total


@dataclass(frozen=True)
class ClassQueue:
    """One key class's requests in a router's queue (router/fair_queue.py): held back, and
    sent on to the cluster and not ended."""

    kind: str  # the TrafficClass value: "interactive" or "batch"
    queued: int = 0
    running: int = 0


def format_queue(classes: tuple[ClassQueue, ...]) -> str:
    """'interactive 0 queued 3 running, batch 12 queued 4 running' ('' for none)."""
    return ", ".join(f"{c.kind} {c.queued} queued {c.running} running" for c in classes)


@dataclass(frozen=True)
class RouterStatus:
    router_id: str
    http_url: str = ""
    grpc_address: str = ""
    last_seen: float = 0.0  # time.time() of its last membership sync
    attainment: SloAttainment | None = None  # its recent requests against the objectives
    queue: tuple[ClassQueue, ...] = ()  # its queue by key class, at its last sync


@dataclass(frozen=True)
class RedisStatus:
    url: str  # password redacted; "" when the cluster runs without Redis
    reachable: bool = False
    num_registered_workers: int = 0
    error: str = ""


@dataclass(frozen=True)
class ClusterStatus:
    model_id: str
    pools: tuple[PoolStatus, ...]
    routers: tuple[RouterStatus, ...]
    redis: RedisStatus
    error: str = ""  # why the controller cannot reach its desired size, if it cannot

    def pool(self, role: str) -> PoolStatus:
        return next(p for p in self.pools if p.role == role)

    def to_json_dict(self) -> dict[str, Any]:
        """Plain JSON types (`kvrelay status --json`), with the derived rates filled in."""
        out = _plain(dataclasses.asdict(self))
        for pool, raw in zip(self.pools, out["pools"], strict=True):
            raw["num_ready"] = pool.num_ready
            for worker, raw_worker in zip(pool.workers, raw["workers"], strict=True):
                if worker.stats is not None:
                    raw_worker["stats"]["prefix_hit_rate"] = worker.stats.prefix_hit_rate
                    raw_worker["stats"]["transfer_bytes_per_s"] = worker.stats.transfer_bytes_per_s
                    raw_worker["stats"]["tiers"] = [
                        t._asdict() | {"hit_rate": t.hit_rate} for t in worker.stats.tiers
                    ]
        return out


@dataclass(frozen=True)
class RouterConfig:
    """What a router needs from the controller to serve the cluster's pools."""

    model: ServedModel
    redis_url: str | None
    policy: str = "kv_aware"
    max_migrations: int = 2  # times one request may move to another decode worker
    local_prefill: LocalPrefill = field(default_factory=LocalPrefill)  # conditional prefill
    slo: SloTargets = field(default_factory=SloTargets)  # the objectives routers place for
    shared_store: bool = False  # the workers publish to a cluster-shared KV store (routers ask it)
    # The serve's API keys and per-key limits, as a digest (None: it admits every caller): a
    # router that joins must bring the same, or it would open the cluster to any caller.
    access_digest: str | None = None


@dataclass(frozen=True)
class KVEvictRequest:
    """`kvrelay kv evict`: a prompt's blocks (prompt, hashed under cache_salt) or, without a
    prompt, every block computed under cache_salt, dropped by every worker from each tier and
    from the shared store."""

    prompt: str | None = None
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if self.prompt is None and not self.cache_salt:
            raise ValueError("give --prefix-of TEXT, --salt S (or --tenant T), or both")
        if self.prompt == "":
            raise ValueError("--prefix-of must not be empty (no block has an empty prompt)")


MAX_POOL_SIZE = 1024  # workers a pool may be asked for (a typo's billion would be started)


@dataclass(frozen=True)
class ScaleRequest:
    """Desired pool sizes; None leaves a pool as it is."""

    prefill: int | None = None
    decode: int | None = None

    def sizes(self) -> dict[str, int]:
        wanted = {"prefill": self.prefill, "decode": self.decode}
        # prefill 0 is aggregated (the decode workers compute every prompt); decode 0 serves none
        lowest = {"prefill": 0, "decode": 1}
        for role, size in wanted.items():
            if size is not None and not lowest[role] <= size <= MAX_POOL_SIZE:
                why = " (the decode workers serve every request)" if role == "decode" else ""
                raise ValueError(
                    f"--{role} must be in [{lowest[role]}, {MAX_POOL_SIZE}]{why}, got {size}"
                )
        return {role: size for role, size in wanted.items() if size is not None}


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value
