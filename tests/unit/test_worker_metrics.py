"""WorkerStatsCollector: each worker's handoff figures as Prometheus series, by role."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from common.cluster_state import DecodeStats, PrefillStats, WorkerState
from common.messages import WorkerLoad
from engine.kv_cache.tier_stats import TierStats
from router.worker_metrics import WorkerStatsCollector


def prefill_stats(**fields) -> PrefillStats:
    return PrefillStats(state=WorkerState.READY, load=WorkerLoad(), **fields)


def decode_stats(**fields) -> DecodeStats:
    return DecodeStats(state=WorkerState.READY, load=WorkerLoad(), **fields)


def registry_with(collector: WorkerStatsCollector) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(collector)
    return registry


def test_each_role_exports_its_own_states_and_counters() -> None:
    collector = WorkerStatsCollector()
    collector.update(
        "p0",
        "prefill",
        prefill_stats(
            num_blocks_held=3,
            num_blocks_being_read=2,
            num_expired_leases=1,
            handoff_transitions=(("new->held", 7),),
        ),
    )
    collector.update("d0", "decode", decode_stats(num_blocks_reading=4, num_refused_handshakes=2))
    value = registry_with(collector).get_sample_value
    held = {"worker_id": "p0", "role": "prefill", "state": "held"}
    assert value("kvrelay_kv_handoff_blocks", held) == 3
    reading = {"worker_id": "d0", "role": "decode", "state": "reading"}
    assert value("kvrelay_kv_handoff_blocks", reading) == 4
    # A lease state is not a decode worker's; a handshake refusal is not a prefill worker's.
    assert value("kvrelay_kv_handoff_blocks", {**reading, "state": "held"}) is None
    assert value("kvrelay_kv_expired_leases_total", {"worker_id": "p0", "role": "prefill"}) == 1
    assert (
        value("kvrelay_kv_refused_handshakes_total", {"worker_id": "p0", "role": "prefill"}) is None
    )
    assert value("kvrelay_kv_refused_handshakes_total", {"worker_id": "d0", "role": "decode"}) == 2
    moved = {"worker_id": "p0", "role": "prefill", "transition": "new->held"}
    assert value("kvrelay_kv_handoff_transitions_total", moved) == 7
    assert value("kvrelay_kv_stranded_blocks", {"worker_id": "d0", "role": "decode"}) == 0


def test_a_worker_that_did_not_answer_loses_its_series() -> None:
    collector = WorkerStatsCollector()
    collector.update("p0", "prefill", prefill_stats(num_stranded_blocks=1))
    collector.update("p1", "prefill", prefill_stats())
    collector.keep_only({"p1"})
    value = registry_with(collector).get_sample_value
    assert value("kvrelay_kv_stranded_blocks", {"worker_id": "p0", "role": "prefill"}) is None
    assert value("kvrelay_kv_stranded_blocks", {"worker_id": "p1", "role": "prefill"}) == 0


def test_prefix_cache_counters_are_exported_for_both_roles() -> None:
    collector = WorkerStatsCollector()
    collector.update(
        "p0", "prefill", prefill_stats(num_host_hit_blocks=5, num_partial_reused_tokens=9)
    )
    collector.update("d0", "decode", decode_stats(num_host_offloaded_blocks=3))
    value = registry_with(collector).get_sample_value
    p0, d0 = {"worker_id": "p0", "role": "prefill"}, {"worker_id": "d0", "role": "decode"}
    assert value("kvrelay_host_kv_hit_blocks_total", p0) == 5
    assert value("kvrelay_prefix_partial_reused_tokens_total", p0) == 9
    assert value("kvrelay_host_kv_offloaded_blocks_total", d0) == 3
    assert value("kvrelay_host_kv_hit_blocks_total", d0) == 0


def test_each_kv_tier_exports_its_size_hits_and_loads() -> None:
    tiers = (
        TierStats("device", 100, 80, 40, 10, 0, 0.0),
        TierStats(
            "disk", 1000, 300, 30, 12, 12 * 4096, 0.25, bad_files=2, passed_over=4, writes_dropped=6
        ),
        TierStats("shared", 5000, 700, 18, 6, 6 * 4096, 0.5, write_failures=3),
    )
    collector = WorkerStatsCollector()
    collector.update("p0", "prefill", prefill_stats(tiers=tiers))
    value = registry_with(collector).get_sample_value
    worker = {"worker_id": "p0", "role": "prefill"}
    disk, shared = worker | {"tier": "disk"}, worker | {"tier": "shared"}
    assert value("kvrelay_kv_tier_blocks", shared | {"kind": "capacity"}) == 5000
    assert value("kvrelay_kv_tier_blocks", disk | {"kind": "used"}) == 300
    assert value("kvrelay_kv_tier_hit_blocks_total", disk) == 12
    assert value("kvrelay_kv_tier_lookup_blocks_total", shared) == 18
    assert value("kvrelay_kv_tier_loaded_bytes_total", shared) == 6 * 4096
    assert value("kvrelay_kv_tier_load_seconds_total", disk) == 0.25
    assert value("kvrelay_kv_tier_bad_files_total", disk) == 2
    assert value("kvrelay_kv_tier_write_failures_total", shared) == 3
    assert value("kvrelay_kv_tier_passed_over_total", disk) == 4
    assert value("kvrelay_kv_tier_writes_dropped_total", disk) == 6
    assert value("kvrelay_kv_tier_hit_blocks_total", worker | {"tier": "host"}) is None


def test_preemptions_are_exported_for_both_roles() -> None:
    collector = WorkerStatsCollector()
    collector.update("p0", "prefill", prefill_stats(num_preemptions=2))
    collector.update("d0", "decode", decode_stats(num_preemptions=3, num_priority_preemptions=1))
    value = registry_with(collector).get_sample_value
    p0, d0 = {"worker_id": "p0", "role": "prefill"}, {"worker_id": "d0", "role": "decode"}
    assert value("kvrelay_preemptions_total", p0) == 2
    assert value("kvrelay_priority_preemptions_total", p0) == 0
    assert value("kvrelay_preemptions_total", d0) == 3
    assert value("kvrelay_priority_preemptions_total", d0) == 1
