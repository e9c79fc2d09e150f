"""Aggregated routing (router/aggregated.py, and the Placer's use of it) on hand-made worker
snapshots: with no prefill worker a decode worker computes the prompt, chosen by the KV-aware
policy over the decode workers' caches and loads; objectives queue or refuse it as for the
prefill pool (a burst on a stale published load counting its own prompts); the
conditional-prefill rule is left alone while a prefill pool exists."""

from __future__ import annotations

import asyncio

import pytest

from common.messages import GenerateRequest, WorkerInfo, WorkerLoad
from common.placement_rules import LocalPrefill, SloTargets
from engine.sampling.sampling_params import SamplingParams
from router.aggregated import AGGREGATED, route_aggregated
from router.errors import SloUnmet
from router.placement import Placer
from router.policy import KVAwarePolicy, NoWorkerAvailable
from router.prefix_index import IndexView
from router.slo import LocalRoute, RouteInputs, Unmet
from router.worker_set import WorkerSet

BLOCK = 16
PROMPT = 320  # 20 blocks
ROOM = 100  # free blocks: room for the whole request


def decode(worker_id: str, **load: int) -> WorkerInfo:
    load.setdefault("free_blocks", ROOM)
    return WorkerInfo(worker_id, "decode", worker_id, load=WorkerLoad(**load))


def inputs(workers, overlap=None) -> RouteInputs:
    return RouteInputs([], None, workers, overlap or {}, BLOCK, PROMPT, 30)


def test_the_decode_worker_holding_the_prefix_wins_unless_its_queue_costs_more() -> None:
    warm, cold = decode("d0", queued_tokens=100), decode("d1")
    chosen = route_aggregated(
        inputs([warm, cold], {"d0": 25}), KVAwarePolicy(), LocalPrefill(), SloTargets()
    )
    assert isinstance(chosen, LocalRoute)
    assert chosen.placement.worker.worker_id == "d0" and chosen.placement.reason == AGGREGATED
    assert chosen.placement.num_cached_tokens == PROMPT  # capped at the prompt
    # 400 cached tokens saved against 1000 queued: the idle worker computes it all.
    busy = decode("d0", queued_tokens=1000)
    chosen = route_aggregated(
        inputs([busy, cold], {"d0": 25}), KVAwarePolicy(), LocalPrefill(), SloTargets()
    )
    assert isinstance(chosen, LocalRoute) and chosen.placement.worker.worker_id == "d1"
    assert chosen.placement.num_cached_tokens == 0


def test_a_worker_without_room_is_left_out_unless_none_has_room() -> None:
    full, roomy = decode("d0", free_blocks=2), decode("d1", queued_tokens=50)
    chosen = route_aggregated(
        inputs([full, roomy], {"d0": 25}), KVAwarePolicy(), LocalPrefill(), SloTargets()
    )
    assert isinstance(chosen, LocalRoute) and chosen.placement.worker.worker_id == "d1"
    chosen = route_aggregated(inputs([full]), KVAwarePolicy(), LocalPrefill(), SloTargets())
    assert isinstance(chosen, LocalRoute) and chosen.placement.worker.worker_id == "d0"
    with pytest.raises(NoWorkerAvailable):
        route_aggregated(inputs([]), KVAwarePolicy(), LocalPrefill(), SloTargets())


def test_objectives_queue_or_place_as_for_the_prefill_pool() -> None:
    rule = LocalPrefill(chunk_tokens=64)
    # 5 steps of 64 tokens at 100 ms each: 0.5 s to the first token on the busy worker.
    busy = decode("d0", running=2, queued_tokens=2, step_us=100_000)
    slo = SloTargets(ttft_ms=300)
    unmet = route_aggregated(inputs([busy]), KVAwarePolicy(), rule, slo)
    assert isinstance(unmet, Unmet) and "500 ms" in unmet.reason
    placed = route_aggregated(inputs([busy]), KVAwarePolicy(), rule, SloTargets(300, 0, "place"))
    assert isinstance(placed, LocalRoute) and placed.predicted_ttft_s == pytest.approx(0.5)
    # An idle worker is taken even when the prompt alone is over the objective.
    idle = decode("d1", step_us=100_000)
    chosen = route_aggregated(inputs([busy, idle]), KVAwarePolicy(), rule, slo)
    assert isinstance(chosen, LocalRoute) and chosen.placement.worker.worker_id == "d1"
    # TPOT: a worker stepping too slowly is left out; all of them: Unmet.
    fast = decode("d1", running=1, step_us=10_000)
    chosen = route_aggregated(inputs([busy, fast]), KVAwarePolicy(), rule, SloTargets(0, 50))
    assert isinstance(chosen, LocalRoute) and chosen.placement.worker.worker_id == "d1"
    assert isinstance(
        route_aggregated(inputs([busy]), KVAwarePolicy(), rule, SloTargets(0, 50)), Unmet
    )


def test_a_fresh_worker_without_a_prompt_rate_is_predicted_at_its_all_steps_rate() -> None:
    """Right after start a worker's steps were the warm-up's few tokens (118 ms each on a CPU):
    5 such steps looked like 0.6 s for 40 x 229 queued tokens, and a first burst was admitted
    whole (TTFT p50 16 s against a 2 s objective). Until it has a prompt rate, its all-steps
    rate (133 tok/s here) predicts: the burst queues past what it serves in time."""
    rule = LocalPrefill(chunk_tokens=2048)
    fresh = decode("d0", running=1, waiting=8, queued_tokens=9 * 229, step_us=118_000,
                   prefill_tok_s=133)  # fmt: skip
    unmet = route_aggregated(inputs([fresh]), KVAwarePolicy(), rule, SloTargets(ttft_ms=2000))
    assert isinstance(unmet, Unmet)
    measured = decode("d0", running=1, waiting=8, queued_tokens=9 * 229, step_us=118_000,
                      prefill_tok_s=133, prompt_tok_s=4000)  # fmt: skip
    placed = route_aggregated(inputs([measured]), KVAwarePolicy(), rule, SloTargets(2000))
    assert isinstance(placed, LocalRoute)
    assert placed.predicted_ttft_s == pytest.approx((9 * 229 - 1 + PROMPT) / 4000)  # by rate


class TwoPoolIndex:
    """Stands in for PrefixIndex.view: `prefill` lists the prefill pool (empty: aggregated)."""

    def __init__(self, prefill: list[WorkerInfo]):
        self.prefill = prefill
        self.roles: list[str] = []

    async def view(self, role: str, hashes: list[int]) -> IndexView:
        self.roles.append(role)
        if role == "prefill":
            return IndexView(self.prefill, {})
        return IndexView([decode("d0", free_blocks=ROOM), decode("d1")], {"d1": 4})


def placer(index: TwoPoolIndex) -> Placer:
    """The router's own view (membership) agrees with the index: the same prefill pool."""
    workers = WorkerSet()
    for worker in [*index.prefill, decode("d0"), decode("d1")]:
        workers.add(worker.worker_id, worker.role, actor=object())  # type: ignore[arg-type]
    return Placer(BLOCK, workers, index, KVAwarePolicy())  # type: ignore[arg-type]


REQUEST = GenerateRequest("r1", tuple(range(PROMPT)), SamplingParams(max_tokens=8))


def test_the_placer_routes_locally_only_when_the_prefill_pool_is_empty() -> None:
    index = TwoPoolIndex([])
    p = placer(index)
    routed = asyncio.run(p.route(REQUEST, list(range(20))))
    assert isinstance(routed, LocalRoute) and routed.placement.reason == AGGREGATED
    assert routed.placement.worker.worker_id == "d1"  # its cache holds 4 blocks of the prompt
    assert index.roles == ["prefill", "decode"] and p.workers.num_placed("d1") == 1
    # A prefill pool, conditional prefill off: the prompt goes there (the decode view unread).
    index = TwoPoolIndex([WorkerInfo("p0", "prefill", "p0")])
    routed = asyncio.run(placer(index).route(REQUEST, []))
    assert isinstance(routed, tuple) and routed[0].placement.worker.worker_id == "p0"
    assert index.roles == ["prefill"]
    # After a failed placement: another decode worker, the tried one left out.
    p = placer(TwoPoolIndex([]))
    again = asyncio.run(p.place_aggregated(REQUEST, [], frozenset({"d1"})))
    assert again.placement.worker.worker_id == "d0" and p.workers.num_placed("d0") == 1
    with pytest.raises(NoWorkerAvailable):
        asyncio.run(p.place_aggregated(REQUEST, [], frozenset({"d0", "d1"})))


class ConcurrentIndex(TwoPoolIndex):
    """Counts the views asked at once (each waits a loop turn, as a Redis round trip would)."""

    def __init__(self, prefill: list[WorkerInfo]):
        super().__init__(prefill)
        self.in_flight = self.most_in_flight = 0

    async def view(self, role: str, hashes: list[int]) -> IndexView:
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        await asyncio.sleep(0)
        self.in_flight -= 1
        return await super().view(role, hashes)


def test_with_no_prefill_worker_known_both_views_are_read_in_one_round_trip() -> None:
    index = ConcurrentIndex([])
    routed = asyncio.run(placer(index).route(REQUEST, list(range(20))))
    assert isinstance(routed, LocalRoute) and routed.placement.worker.worker_id == "d1"
    assert sorted(index.roles) == ["decode", "prefill"] and index.most_in_flight == 2
    # A prefill pool the router knows: its view alone, then the decode view only if it is empty.
    index = ConcurrentIndex([WorkerInfo("p0", "prefill", "p0")])
    routed = asyncio.run(placer(index).route(REQUEST, []))
    assert isinstance(routed, tuple) and index.roles == ["prefill"] and index.most_in_flight == 1


class StaleIndex:
    """Stands in for PrefixIndex.view with an aggregated pool whose published load never moves
    (a burst between two load publications): one decode worker, one request running, prompts
    computed at 3,200 tokens/s (0.1 s a 320-token prompt), decode steps of 10 ms."""

    async def view(self, role: str, hashes: list[int]) -> IndexView:
        if role == "prefill":
            return IndexView([], {})
        load = {"running": 1, "queued_tokens": 1, "step_us": 10_000, "prompt_tok_s": 3200}
        return IndexView([decode("d0", **load)], {})


def test_a_burst_on_a_stale_load_counts_its_own_prompts_against_the_ttft_objective() -> None:
    workers = WorkerSet()
    workers.add("d0", "decode", actor=object())  # type: ignore[arg-type]
    slo = SloTargets(ttft_ms=450, overload="shed")
    p = Placer(BLOCK, workers, StaleIndex(), KVAwarePolicy(), slo=slo)  # type: ignore[arg-type]

    async def burst() -> list[LocalRoute | str]:
        out: list[LocalRoute | str] = []
        for i in range(6):
            request = GenerateRequest(f"r{i}", tuple(range(PROMPT)), SamplingParams(max_tokens=8))
            try:
                out.append(await p.route(request, []))
            except SloUnmet as e:
                out.append(str(e))
        return out

    routes = asyncio.run(burst())
    # 0.1 s of prompt each: the fourth is predicted at 0.4 s, the fifth at 0.5 s (shed), as is
    # the sixth; the published load alone (one 320-token prompt) would have placed them all
    placed = [r for r in routes if isinstance(r, LocalRoute)]
    assert [r.predicted_ttft_s for r in placed] == pytest.approx([0.1, 0.2, 0.3, 0.4], abs=1e-3)
    assert all("over the TTFT objective of 450 ms" in r for r in routes[4:])
    # The first token of one counts its prompt off (it decodes on: still placed there).
    workers.computed("d0", PROMPT)
    (seen,) = workers.with_placed(asyncio.run(StaleIndex().view("decode", [])).workers)
    assert seen.load.queued_tokens == 3 * PROMPT and workers.num_placed("d0") == 4


def test_place_still_prefers_a_worker_within_the_tpot_objective() -> None:
    """overload "place" (and every admitted request: a migrated one, one with a deadline) is
    placed even when no worker is within the objectives, but among workers some of which are,
    on one of those: here not on the one holding the prefix whose steps take 200 ms."""
    slow = decode("slow", running=2, step_us=200_000)
    ok = decode("ok", running=2, step_us=20_000, queued_tokens=5000)
    slo = SloTargets(tpot_ms=50, overload="place")
    chosen = route_aggregated(
        inputs([slow, ok], {"slow": 20}), KVAwarePolicy(), LocalPrefill(), slo
    )
    assert isinstance(chosen, LocalRoute) and chosen.placement.worker.worker_id == "ok"
    only_slow = route_aggregated(
        inputs([slow]), KVAwarePolicy(), LocalPrefill(), SloTargets(tpot_ms=50, overload="place")
    )
    assert isinstance(only_slow, LocalRoute)  # none within: placed anyway
