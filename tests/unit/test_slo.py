"""SLO-aware routing (router/slo.py) on hand-made worker snapshots: predictions, the route
under TTFT/TPOT objectives, local prefill when the pool would miss, refusals (pure, no I/O)."""

from __future__ import annotations

import pytest

from common.index_upkeep import worker_load
from common.messages import WorkerInfo, WorkerLoad
from common.placement_rules import LocalPrefill, SloTargets
from engine.kv_cache.tier_stats import TierStats
from engine.step.step_rate import StepRate
from engine.step.step_types import EngineSnapshot
from router.policy import KVAwarePolicy
from router.slo import (
    LocalRoute,
    RemoteRoute,
    RouteInputs,
    Unmet,
    local_ttft_s,
    prefill_ttft_s,
    route,
    tpot_s,
)

BLOCK = 16
PROMPT = 1000


def worker(worker_id: str, role: str = "prefill", **load: int) -> WorkerInfo:
    return WorkerInfo(worker_id, role, load=WorkerLoad(**load))


def inputs(prefill, decode=(), prefill_overlap=None, decode_overlap=None, prompt=PROMPT):
    return RouteInputs(
        prefill,
        {} if prefill_overlap is None else prefill_overlap,
        list(decode),
        decode_overlap or {},
        BLOCK,
        prompt,
        num_blocks_needed=-(-(prompt + 100) // BLOCK),
    )


def test_predictions_from_published_rates() -> None:
    load = WorkerLoad(queued_tokens=3000, prefill_tok_s=10_000)
    assert prefill_ttft_s(load, 1000) == pytest.approx(0.4)
    assert prefill_ttft_s(WorkerLoad(queued_tokens=3000), 1000) is None  # not measured yet
    assert prefill_ttft_s(WorkerLoad(), 1000, pool_tok_s=5000) == pytest.approx(0.2)
    # a decode worker: 4 running decodes (a token each queued) + 300 prompt tokens, 256 a step
    decode = WorkerLoad(running=4, queued_tokens=304, step_us=20_000)
    assert local_ttft_s(decode, 300, chunk_tokens=256) == pytest.approx(3 * 0.02)
    # its recent steps were decodes (20 ms), but it computes prompts at 2,000 tokens/s: the
    # 600 tokens take 0.3 s, not three 20 ms steps (a backlog of prompts is not a few steps)
    measured = WorkerLoad(running=4, queued_tokens=304, step_us=20_000, prompt_tok_s=2000)
    assert local_ttft_s(measured, 300, chunk_tokens=256) == pytest.approx(0.3)
    fast = WorkerLoad(running=4, queued_tokens=304, step_us=20_000, prompt_tok_s=1_000_000)
    assert local_ttft_s(fast, 300, chunk_tokens=256) == pytest.approx(3 * 0.02)  # the steps
    assert local_ttft_s(WorkerLoad(queued_tokens=100, prompt_tok_s=1000), 100, 256) == 0.2
    assert local_ttft_s(WorkerLoad(queued_tokens=100), 100, 256) is None  # not measured yet
    # a decode worker that never computed a prompt: its all-steps rate (its decodes) is no
    # prompt rate, the steps alone predict
    decoding = WorkerLoad(running=16, queued_tokens=16, step_us=20_000, prefill_tok_s=800)
    assert local_ttft_s(decoding, 2000, chunk_tokens=512) == pytest.approx(4 * 0.02)
    assert tpot_s(decode) == pytest.approx(0.02)
    assert tpot_s(WorkerLoad()) is None
    assert tpot_s(WorkerLoad(step_us=20_000)) is None  # idle: its last step says nothing


def test_step_rate_follows_recent_steps() -> None:
    rate = StepRate(decay=0.5)
    assert (rate.tokens_per_s, rate.step_s) == (0.0, 0.0)
    rate.record(0.1, 1000)
    assert rate.tokens_per_s == pytest.approx(10_000)
    for _ in range(30):
        rate.record(0.01, 10)
    assert rate.tokens_per_s == pytest.approx(1000, rel=1e-3)
    assert rate.step_s == pytest.approx(0.01, rel=1e-3)
    with pytest.raises(ValueError):
        StepRate(decay=1.0)


def test_without_objectives_the_policy_decides() -> None:
    busy = worker("busy", queued_tokens=50_000, prefill_tok_s=10_000)
    idle = worker("idle", prefill_tok_s=10_000)
    chosen = route(inputs([busy, idle], prefill_overlap={"busy": 60}), KVAwarePolicy(0.0),
                   LocalPrefill(), SloTargets())  # fmt: skip
    assert isinstance(chosen, RemoteRoute) and chosen.placement.worker is busy  # cache only


def test_ttft_objective_leaves_out_workers_predicted_to_miss_it() -> None:
    busy = worker("busy", queued_tokens=50_000, prefill_tok_s=10_000)  # 5.1 s to go
    idle = worker("idle", prefill_tok_s=10_000)  # 0.1 s
    slo = SloTargets(ttft_ms=1000)
    chosen = route(inputs([busy, idle], prefill_overlap={"busy": 60}), KVAwarePolicy(0.0),
                   LocalPrefill(), slo)  # fmt: skip
    assert isinstance(chosen, RemoteRoute) and chosen.placement.worker is idle
    assert chosen.predicted_ttft_s == pytest.approx(0.1)
    # the time spent waiting in the router counts: 50 ms left is too little for anyone
    late = route(inputs([busy]), KVAwarePolicy(), LocalPrefill(), slo, ttft_budget_s=0.05)
    assert (
        isinstance(late, Unmet)
        and "over the 50 ms left of the TTFT objective of 1000 ms" in late.reason
    )
    missed = route(inputs([busy]), KVAwarePolicy(), LocalPrefill(), slo)
    assert isinstance(missed, Unmet) and missed.reason.endswith(
        "over the TTFT objective of 1000 ms"
    )


def test_a_prompt_too_long_for_the_objective_even_when_idle_is_placed_not_refused() -> None:
    busy = worker("busy", queued_tokens=50_000, prefill_tok_s=10_000)
    idle = worker("idle", prefill_tok_s=10_000)  # 0.1 s for the prompt alone
    chosen = route(inputs([busy, idle]), KVAwarePolicy(), LocalPrefill(), SloTargets(ttft_ms=50))
    assert isinstance(chosen, RemoteRoute) and chosen.placement.worker is idle
    assert not chosen.meets  # no wait would help: it is served, late


def test_unmeasured_workers_count_as_meeting() -> None:
    fresh = worker("fresh")
    chosen = route(inputs([fresh]), KVAwarePolicy(), LocalPrefill(), SloTargets(ttft_ms=1))
    assert isinstance(chosen, RemoteRoute) and chosen.placement.worker is fresh


def test_overloaded_pool_refuses_or_places_anyway() -> None:
    a = worker("a", queued_tokens=40_000, prefill_tok_s=10_000)
    b = worker("b", queued_tokens=20_000, prefill_tok_s=10_000)
    for mode in ("queue", "shed"):
        unmet = route(inputs([a, b]), KVAwarePolicy(), LocalPrefill(), SloTargets(500, 0, mode))
        assert isinstance(unmet, Unmet) and "2100 ms" in unmet.reason  # b, the fastest
    placed = route(inputs([a, b]), KVAwarePolicy(), LocalPrefill(), SloTargets(500, 0, "place"))
    assert isinstance(placed, RemoteRoute) and not placed.meets
    assert placed.placement.worker is b


def test_decode_worker_prefills_when_the_pool_would_miss() -> None:
    pool = [worker("p", queued_tokens=40_000, prefill_tok_s=10_000)]  # 4.1 s
    roomy = worker("d0", "decode", running=8, queued_tokens=8, free_blocks=500, step_us=20_000)
    full = worker("d1", "decode", free_blocks=10, step_us=10_000)  # no room for the request
    rule = LocalPrefill(on_slo_miss=True, chunk_tokens=256)
    chosen = route(inputs(pool, [roomy, full]), KVAwarePolicy(), rule, SloTargets(ttft_ms=500))
    assert isinstance(chosen, LocalRoute)
    assert chosen.placement.worker is roomy and chosen.placement.reason == "slo"
    assert chosen.predicted_ttft_s == pytest.approx(4 * 0.02)  # 1000 tokens, 4 chunks
    # without the rule the same request is refused
    off = route(inputs(pool, [roomy, full]), KVAwarePolicy(), LocalPrefill(), SloTargets(500))
    assert isinstance(off, Unmet)
    # a decode worker that would take too long locally is no way out either
    slow = worker("d2", "decode", free_blocks=500, step_us=200_000)
    unmet = route(inputs(pool, [slow]), KVAwarePolicy(), rule, SloTargets(ttft_ms=500))
    assert isinstance(unmet, Unmet)


def test_tpot_objective_leaves_out_slow_decode_workers() -> None:
    pool = [worker("p", prefill_tok_s=10_000)]
    slow = worker("slow", "decode", running=30, free_blocks=500, step_us=90_000)
    fast = worker("fast", "decode", running=4, free_blocks=500, step_us=20_000)
    rule = LocalPrefill(max_uncached_tokens=PROMPT)  # any prompt may be prefilled locally
    chosen = route(inputs(pool, [slow, fast]), KVAwarePolicy(), rule, SloTargets(tpot_ms=50))
    assert isinstance(chosen, LocalRoute) and chosen.placement.worker is fast
    unmet = route(inputs(pool, [slow]), KVAwarePolicy(), rule, SloTargets(tpot_ms=50))
    assert isinstance(unmet, Unmet) and "TPOT objective of 50 ms" in unmet.reason
    placed = route(inputs(pool, [slow]), KVAwarePolicy(), rule, SloTargets(0, 50, "place"))
    assert isinstance(placed, LocalRoute) and placed.placement.worker is slow
    # once idle, its last (slow) step time no longer counts: steps are measured while it runs
    idle = worker("slow", "decode", free_blocks=500, step_us=90_000)
    assert tpot_s(idle.load) is None
    assert isinstance(
        route(inputs(pool, [idle]), KVAwarePolicy(), rule, SloTargets(0, 50)), LocalRoute
    )


def test_index_down_routes_by_load() -> None:
    a = worker("a", queued_tokens=500)
    b = worker("b")
    chosen = route(
        RouteInputs([a, b], None, [], {}, BLOCK, PROMPT, 70),
        KVAwarePolicy(),
        LocalPrefill(),
        SloTargets(ttft_ms=1),
    )
    assert isinstance(chosen, RemoteRoute) and chosen.placement.worker is b


def test_bad_objectives_are_refused() -> None:
    with pytest.raises(ValueError, match="overload must be one of"):
        SloTargets(100, 0, "drop")
    with pytest.raises(ValueError, match=">= 0 ms"):
        SloTargets(-1)
    with pytest.raises(ValueError, match="chunk_tokens"):
        LocalPrefill(chunk_tokens=0)


def test_a_worker_publishes_its_prompt_rate_only_once_it_computed_prompts() -> None:
    """worker_load (common/index_upkeep.py) off an engine snapshot: a decode worker that only
    decoded has an all-steps rate but no prompt rate (0), so routers predict its local TTFT from
    its steps, not from its decode throughput."""
    blank = EngineSnapshot(*([0] * len(EngineSnapshot._fields)))._replace(tiers=())
    decoded = worker_load(blank._replace(tokens_per_s=800.0, step_s=0.02))
    assert (decoded.prefill_tok_s, decoded.step_us, decoded.prompt_tok_s) == (800, 20_000, 0)
    both = worker_load(blank._replace(tokens_per_s=800.0, prompt_tokens_per_s=9000.4))
    assert (both.prefill_tok_s, both.prompt_tok_s) == (800, 9000)


def test_a_worker_publishes_its_recent_block_read_time_not_its_mean_since_start() -> None:
    """The routers' file credit weighs the read times the worker's own gate weighs: each file
    tier's recent one (TierStats.recent_load_s), the disk tier's and the shared store's apart,
    0 before a read; the lifetime mean (1 ms here over 1,000 reads) would hide a disk that is
    now 5x slower."""
    blank = EngineSnapshot(*([0] * len(EngineSnapshot._fields)))._replace(tiers=())
    assert (worker_load(blank).disk_load_us, worker_load(blank).shared_load_us) == (0, 0)
    disk = TierStats("disk", 100, 10, 0, 0, 0, 1.0, recent_load_s=0.005)
    shared = TierStats("shared", 100, 10, 0, 0, 0, 0.0, recent_load_s=0.002)
    snap = blank._replace(disk_load_s=1.0, num_disk_reads=1000, tiers=(disk, shared))
    assert (worker_load(snap).disk_load_us, worker_load(snap).shared_load_us) == (5000, 2000)
    unread = disk._replace(recent_load_s=0.0)
    load = worker_load(snap._replace(tiers=(unread, shared)))
    assert (load.disk_load_us, load.shared_load_us) == (0, 2000)  # each tier its own
    host = TierStats("host", 100, 10, 0, 0, 0, 0.0, recent_load_s=0.00004)  # measured at start
    assert worker_load(snap._replace(tiers=(host, disk))).host_load_us == 40
    quick = host._replace(recent_load_s=4e-7)  # under a microsecond: still measured, not 0
    assert worker_load(snap._replace(tiers=(quick,))).host_load_us == 1
