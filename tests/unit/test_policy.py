"""Placement policies on hand-made worker snapshots (pure: no Redis, no I/O)."""

from __future__ import annotations

import pytest

from common.messages import WorkerInfo, WorkerLoad
from router.policy import (
    DISK_HIT_CREDIT,
    KVAwarePolicy,
    LocalPrefill,
    NoWorkerAvailable,
    Overlap,
    RandomPolicy,
    RoundRobinPolicy,
    choose_decode,
    choose_local_prefill,
    make_prefill_policy,
    route_by_load,
)

BLOCK = 16


def make_worker(worker_id: str, role: str = "prefill", **load: int) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role=role, load=WorkerLoad(**load))


def test_kv_aware_prefers_the_longest_cached_prefix() -> None:
    workers = [make_worker("a"), make_worker("b"), make_worker("c")]
    placement = KVAwarePolicy().choose(workers, {"a": 1, "b": 4, "c": 2}, BLOCK)
    assert placement.worker.worker_id == "b"
    assert placement.num_cached_tokens == 4 * BLOCK
    assert placement.score == 4 * BLOCK
    assert placement.policy == "kv_aware"


def test_kv_aware_trades_cache_hits_against_queued_tokens() -> None:
    busy = make_worker("busy", queued_tokens=100)
    idle = make_worker("idle", queued_tokens=0)
    overlap = {"busy": 4}  # 64 cached tokens saved, 100 queued
    assert KVAwarePolicy(load_weight=1.0).choose([busy, idle], overlap, BLOCK).worker is idle
    assert KVAwarePolicy(load_weight=0.5).choose([busy, idle], overlap, BLOCK).worker is busy
    # load_weight 0: pure cache affinity
    assert KVAwarePolicy(load_weight=0.0).choose([busy, idle], overlap, BLOCK).worker is busy


def test_kv_aware_ties_break_by_load_then_id() -> None:
    a = make_worker("a", waiting=3)
    b = make_worker("b", waiting=1)
    c = make_worker("c", waiting=1)
    assert KVAwarePolicy().choose([a, b, c], {}, BLOCK).worker is b
    assert KVAwarePolicy().choose([c, a, b], {}, BLOCK).worker is b  # order does not matter


def test_kv_aware_treats_missing_overlap_as_zero_and_rejects_negative_weight() -> None:
    placement = KVAwarePolicy().choose([make_worker("a")], {"ghost": 9}, BLOCK)
    assert placement.num_cached_tokens == 0
    with pytest.raises(ValueError):
        KVAwarePolicy(load_weight=-1)


def test_round_robin_cycles_in_id_order_ignoring_cache() -> None:
    policy = RoundRobinPolicy()
    workers = [make_worker("c"), make_worker("a"), make_worker("b")]
    picks = [policy.choose(workers, {"c": 10}, BLOCK).worker.worker_id for _ in range(4)]
    assert picks == ["a", "b", "c", "a"]


def test_random_is_reproducible_with_a_seed_and_covers_all_workers() -> None:
    workers = [make_worker(f"w{i}") for i in range(4)]
    picks = [RandomPolicy(seed=7).choose(workers, {}, BLOCK).worker for _ in range(3)]
    assert len(set(picks)) == 1
    policy = RandomPolicy(seed=1)
    seen = {policy.choose(workers, {}, BLOCK).worker.worker_id for _ in range(200)}
    assert seen == {w.worker_id for w in workers}


def test_make_prefill_policy_by_name() -> None:
    assert isinstance(make_prefill_policy("kv_aware", load_weight=2.0), KVAwarePolicy)
    assert isinstance(make_prefill_policy("round_robin"), RoundRobinPolicy)
    assert isinstance(make_prefill_policy("random", seed=3), RandomPolicy)
    with pytest.raises(ValueError, match="unknown placement policy"):
        make_prefill_policy("fastest")


@pytest.mark.parametrize("policy", [KVAwarePolicy(), RoundRobinPolicy(), RandomPolicy(0)])
def test_no_worker_raises(policy) -> None:
    with pytest.raises(NoWorkerAvailable):
        policy.choose([], {}, BLOCK)
    with pytest.raises(NoWorkerAvailable):
        route_by_load([])
    with pytest.raises(NoWorkerAvailable):
        choose_decode([], 1)


def test_route_by_load_picks_least_queued_then_smallest_batch_then_id() -> None:
    workers = [
        make_worker("a", queued_tokens=50),
        make_worker("b", queued_tokens=10, running=4),
        make_worker("c", queued_tokens=10, running=2),
        make_worker("d", queued_tokens=10, running=2),
    ]
    placement = route_by_load(workers)
    assert placement.worker.worker_id == "c"
    assert placement.num_cached_tokens == 0
    assert placement.policy == "load"


def test_choose_decode_prefers_room_then_small_batch() -> None:
    full = make_worker("full", "decode", free_blocks=2, running=0)
    roomy_busy = make_worker("roomy_busy", "decode", free_blocks=100, running=8)
    roomy_idle = make_worker("roomy_idle", "decode", free_blocks=50, running=1)
    assert choose_decode([full, roomy_busy, roomy_idle], 10) is roomy_idle
    # same batch: more free blocks wins
    twin = make_worker("twin", "decode", free_blocks=80, running=1)
    assert choose_decode([roomy_idle, twin], 10) is twin


def test_choose_decode_without_room_takes_most_free_blocks() -> None:
    small = make_worker("small", "decode", free_blocks=3, running=0)
    larger = make_worker("larger", "decode", free_blocks=6, running=9)
    assert choose_decode([small, larger], 10) is larger


def test_local_prefill_rule_short_or_mostly_cached() -> None:
    rule = LocalPrefill(max_uncached_tokens=128, min_cached_fraction=0.8)
    assert rule.reason(100, 0) == "short"
    assert rule.reason(1000, 960) == "short"  # only 40 tokens left to compute
    assert rule.reason(5000, 4200) == "cached"  # 800 left, but 84% cached
    assert rule.reason(1000, 0) is None
    assert not LocalPrefill().enabled
    assert LocalPrefill(max_uncached_tokens=0, min_cached_fraction=0.5).reason(10, 0) is None
    with pytest.raises(ValueError, match="max_uncached_tokens"):
        LocalPrefill(max_uncached_tokens=-1)


def test_local_prefill_goes_to_the_roomy_worker_with_most_cached() -> None:
    rule = LocalPrefill(max_uncached_tokens=64)
    warm = make_worker("warm", "decode", free_blocks=50, running=5)
    cold = make_worker("cold", "decode", free_blocks=50, running=0)
    full = make_worker("full", "decode", free_blocks=2, running=0)
    overlap = {"warm": 6, "full": 8}  # blocks of 16 tokens
    # 140 tokens: warm has 96 cached (44 left: admitted), cold none (140 left: not), full no room
    chosen = choose_local_prefill(rule, [warm, cold, full], overlap, 16, 140, 10)
    assert chosen is not None and chosen.worker is warm and chosen.num_cached_tokens == 96
    # A short prompt: every roomy worker qualifies; no cache anywhere -> the smaller batch.
    chosen = choose_local_prefill(rule, [warm, cold, full], {}, 16, 40, 4)
    assert chosen is not None and chosen.worker is cold and chosen.reason == "short"
    assert choose_local_prefill(rule, [warm, cold], {}, 16, 500, 40) is None
    assert choose_local_prefill(LocalPrefill(), [warm, cold], {}, 16, 1, 1) is None


def test_kv_aware_credits_a_shared_store_block_as_a_disk_block() -> None:
    own, other = make_worker("own", queued_tokens=20), make_worker("other")
    # "own": 4 blocks in device memory; "other": the same 4, loaded from the shared store
    overlap = Overlap({"own": 4, "other": 4}, shared={"other": 4})
    policy = KVAwarePolicy()
    assert policy.score(other, overlap, BLOCK) == 4 * BLOCK * DISK_HIT_CREDIT
    assert policy.score(own, overlap, BLOCK) == 4 * BLOCK - 20
    assert policy.choose([own, other], overlap, BLOCK).worker is own
    # without the index's shared entries, "other" would be credited nothing
    assert policy.score(other, Overlap({"own": 4}), BLOCK) == 0
