"""WorkerStatsCollector: the last WorkerStats each worker answered with, exported as Prometheus
series (load: running, waiting, free blocks...; KV handoff blocks per state, expired leases,
stale releases, refused handshakes, stranded blocks, handoff transitions) when the router's
/metrics is scraped.

The figures are the workers' own: a worker's counters are cumulative in that worker, so they
are exported as counters labelled by worker; a worker that is gone or did not answer the last
scrape has no series (a restarted worker starts its counters at 0 under a new worker id).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import fields

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from common.cluster_state import WorkerStats
from common.messages import WorkerLoad

_LOAD_FIELDS = tuple(f.name for f in fields(WorkerLoad))  # running, waiting, free_blocks, ...

# WorkerStats field -> the handoff state its blocks are in (prefill: lease, decode: pull).
_BLOCK_STATES = {
    "num_blocks_held": "held",
    "num_blocks_being_read": "being_read",
    "num_blocks_reserved": "reserved",
    "num_blocks_reading": "reading",
}
_COUNTERS: dict[str, tuple[str | None, str, str]] = {  # field -> (role, name, help); None: both
    "num_expired_leases": (
        "prefill",
        "kvrelay_kv_expired_leases",
        "Prefill leases that ran out (their blocks freed on the holder's clock).",
    ),
    "num_stale_releases": (
        "prefill",
        "kvrelay_kv_stale_releases",
        "Releases or notices refused for an ended lease or an old epoch (no block freed).",
    ),
    "num_refused_handshakes": (
        "decode",
        "kvrelay_kv_refused_handshakes",
        "Prefill peers a decode worker refused (protocol, model or KV layout mismatch).",
    ),
    "num_orphans_aborted": (
        "decode",
        "kvrelay_orphan_requests_aborted",
        "Requests a decode worker aborted because their router stopped polling.",
    ),
    "num_preemptions": (
        None,
        "kvrelay_preemptions",
        "Running requests a worker's engine preempted (short of blocks or seats, or for a "
        "higher priority); their full blocks stay cached.",
    ),
    "num_priority_preemptions": (
        None,
        "kvrelay_priority_preemptions",
        "Of those, running requests preempted for a request of higher priority.",
    ),
    "num_partial_reused_tokens": (
        None,
        "kvrelay_prefix_partial_reused_tokens",
        "Prompt tokens reused from a cached block the prompt diverges inside (copied).",
    ),
    "num_host_offloaded_blocks": (
        None,
        "kvrelay_host_kv_offloaded_blocks",
        "Cached blocks a worker's device pool evicted into its host tier.",
    ),
    "num_host_hit_blocks": (
        None,
        "kvrelay_host_kv_hit_blocks",
        "Prefix blocks a worker copied back from its host tier instead of recomputing.",
    ),
    "num_disk_stored_blocks": (
        None,
        "kvrelay_disk_kv_stored_blocks",
        "Cached blocks a worker wrote to its disk tier (evicted from its host tier or device).",
    ),
    "num_disk_hit_blocks": (
        None,
        "kvrelay_disk_kv_hit_blocks",
        "Prefix blocks a worker loaded back from its disk tier instead of recomputing.",
    ),
    "num_disk_hit_bytes": (
        None,
        "kvrelay_disk_kv_hit_bytes",
        "Bytes of KV a worker loaded back from its disk tier.",
    ),
    "num_disk_bad_files": (
        None,
        "kvrelay_disk_kv_bad_files",
        "Disk tier block files found corrupt or truncated at load (removed, recomputed).",
    ),
    "num_disk_write_failures": (
        None,
        "kvrelay_disk_kv_write_failures",
        "Blocks a worker's disk refused to store (full): recomputed when needed.",
    ),
    "disk_load_s": (
        None,
        "kvrelay_disk_kv_load_seconds",
        "Seconds a worker spent reading and checking disk tier files for prefix hits.",
    ),
    "num_spec_verify_steps": (
        None,
        "kvrelay_spec_verify_steps",
        "Request-steps that verified drafted tokens (speculative decoding).",
    ),
    "num_spec_drafted_tokens": (
        None,
        "kvrelay_spec_draft_tokens",
        "Tokens drafted for verification; acceptance rate = accepted / drafted.",
    ),
    "num_spec_accepted_tokens": (
        None,
        "kvrelay_spec_accepted_tokens",
        "Drafted tokens verified and kept; mean accepted per step = accepted / verify steps.",
    ),
}


_TIER_COUNTERS = {  # TierStats field -> (name, help)
    "lookup_blocks": (
        "kvrelay_kv_tier_lookup_blocks",
        "Prompt blocks looked up in a KV tier (those the faster tiers lacked).",
    ),
    "hit_blocks": (
        "kvrelay_kv_tier_hit_blocks",
        "Prompt blocks found in a KV tier; hit rate = hit / lookup blocks.",
    ),
    "load_bytes": ("kvrelay_kv_tier_loaded_bytes", "KV bytes loaded from a tier into the device."),
    "load_s": (
        "kvrelay_kv_tier_load_seconds",
        "Seconds spent reading and checking a tier's block files (disk, shared).",
    ),
    "bad_files": (
        "kvrelay_kv_tier_bad_files",
        "A tier's block files found corrupt or truncated at load (removed, recomputed).",
    ),
    "write_failures": (
        "kvrelay_kv_tier_write_failures",
        "Blocks a tier's filesystem refused (full): not stored, recomputed when needed.",
    ),
    "writes_dropped": (
        "kvrelay_kv_tier_writes_dropped",
        "Blocks a tier did not store: its writer behind the step was past its queue (the disk "
        "or the store slower than blocks arrive).",
    ),
    "passed_over": (
        "kvrelay_kv_tier_passed_over",
        "Prompts whose hits in a tier were computed again: reading a block back was slower "
        "than computing it (--kv-tier-reads measured).",
    ),
}


class WorkerStatsCollector(Collector):
    """Holds each worker's last stats; `collect()` turns them into metric families."""

    def __init__(self) -> None:
        self._stats: dict[str, tuple[str, WorkerStats]] = {}  # worker id -> (role, stats)

    def update(self, worker_id: str, role: str, stats: WorkerStats) -> None:
        self._stats[worker_id] = (role, stats)

    def keep_only(self, worker_ids: set[str]) -> None:
        """Drop the series of workers not in `worker_ids` (gone, or silent this scrape)."""
        for worker_id in set(self._stats) - worker_ids:
            del self._stats[worker_id]

    def last(self) -> dict[str, tuple[str, WorkerStats]]:
        """Worker id -> (role, its last stats), of the workers that answered the last refresh."""
        return dict(self._stats)

    def collect(self) -> Iterator[Metric]:
        yield self._load()
        yield from self._handoff()
        yield from self._tiers()

    def _tiers(self) -> Iterator[Metric]:
        """Per KV tier (device, host, disk, shared): its size and use, lookups, hits, loads
        (bytes, seconds), bad files and refused writes, as each worker counted them."""
        labels = ["worker_id", "role", "tier"]
        blocks = GaugeMetricFamily(
            "kvrelay_kv_tier_blocks",
            "A KV tier's bound and the blocks it holds (kind: capacity, used); the shared "
            "store's as the worker last counted it (all workers' files).",
            labels=[*labels, "kind"],
        )
        counters = {
            field: CounterMetricFamily(name, text, labels=labels)
            for field, (name, text) in _TIER_COUNTERS.items()
        }
        for worker_id, (role, stats) in sorted(self._stats.items()):
            for tier in stats.tiers:
                key = [worker_id, role, tier.tier]
                blocks.add_metric([*key, "capacity"], tier.capacity_blocks)
                blocks.add_metric([*key, "used"], tier.used_blocks)
                for field, family in counters.items():
                    family.add_metric(key, getattr(tier, field))
        yield blocks
        yield from counters.values()

    def _load(self) -> Metric:
        load = GaugeMetricFamily(
            "kvrelay_worker_load",
            "A worker's load as it reported it at this scrape (field: running, waiting,"
            " free_blocks, total_blocks, queued_tokens, prefill_tok_s, step_us, prompt_tok_s,"
            " disk_load_us, shared_load_us, host_load_us).",
            labels=["worker_id", "role", "field"],
        )
        for worker_id, (role, stats) in sorted(self._stats.items()):
            for name in _LOAD_FIELDS:
                load.add_metric([worker_id, role, name], getattr(stats.load, name))
        return load

    def _handoff(self) -> Iterator[Metric]:
        blocks = GaugeMetricFamily(
            "kvrelay_kv_handoff_blocks",
            "Blocks in each KV handoff state (prefill: held, being_read; decode: reserved,"
            " reading), as the worker last reported.",
            labels=["worker_id", "role", "state"],
        )
        stranded = GaugeMetricFamily(
            "kvrelay_kv_stranded_blocks",
            "Blocks held for a handoff but in no handoff state: must stay 0.",
            labels=["worker_id", "role"],
        )
        transitions = CounterMetricFamily(
            "kvrelay_kv_handoff_transitions",
            "KV handoff state transitions on a worker (e.g. held->being_read).",
            labels=["worker_id", "role", "transition"],
        )
        counters = {
            field: CounterMetricFamily(name, text, labels=["worker_id", "role"])
            for field, (_, name, text) in _COUNTERS.items()
        }
        for worker_id, (role, stats) in sorted(self._stats.items()):
            for field, state in _BLOCK_STATES.items():
                if _owns(role, state):
                    blocks.add_metric([worker_id, role, state], getattr(stats, field))
            stranded.add_metric([worker_id, role], stats.num_stranded_blocks)
            for name, count in stats.handoff_transitions:
                transitions.add_metric([worker_id, role, name], count)
            for field, family in counters.items():
                if _COUNTERS[field][0] in (role, None):
                    family.add_metric([worker_id, role], getattr(stats, field))
        yield blocks
        yield stranded
        yield transitions
        yield from counters.values()


def _owns(role: str, state: str) -> bool:
    """Lease states are the prefill side's, pull states the decode side's."""
    return (state in ("held", "being_read")) == (role == "prefill")
