"""SLO-aware routing (pure, no I/O): predicted time to first token and time per output token of
each worker from its published load, and the route of one request under the cluster's
objectives and conditional-prefill rule. Owns no state.

Predictions (seconds; None: the worker has not measured its rate yet, which counts as meeting):
- TTFT on a prefill worker: (its queued prompt tokens + this prompt's uncached ones) / its recent
  token rate (WorkerLoad.prefill_tok_s; a worker without one borrows the pool's best).
- TTFT on a decode worker prefilling locally: one chunk of the queued and this prompt's uncached
  tokens per step, at its recent step time (WorkerLoad.step_us), and no sooner than those
  tokens take at its prompt rate once it has one (WorkerLoad.prompt_tok_s): its recent steps
  are mostly decodes, shorter than the steps that carry a prompt's chunk.
- TPOT on a decode worker: its recent step time (each running request gets a token per step);
  None while it is idle.
A request is refused (or queued) only for queueing: one that an idle prefill worker would not
serve within the TTFT objective either is placed, as it would be without objectives.
The KV transfer and the router's own time are left out: they are small next to a queue.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

from common.messages import WorkerInfo, WorkerLoad
from common.placement_rules import LocalPrefill, SloTargets
from router.policy import (
    LocalPlacement,
    Placement,
    PrefillPolicy,
    choose_local_prefill,
    route_by_load,
)


def prefill_ttft_s(load: WorkerLoad, num_uncached: int, pool_tok_s: float = 0.0) -> float | None:
    rate = load.prefill_tok_s or pool_tok_s
    if rate <= 0:
        return None
    return (load.queued_tokens + num_uncached) / rate


def local_ttft_s(
    load: WorkerLoad, num_uncached: int, chunk_tokens: int, all_steps_until_measured: bool = False
) -> float | None:
    """all_steps_until_measured: a worker that computes every prompt (aggregated) without a
    prompt rate yet is predicted at its all-steps rate instead: its only steps were the warm-up's
    few tokens, whose step time says nothing of a chunk's (a first burst on a fresh server was
    predicted at 0.6 s and took 16 s). A disaggregated decode worker keeps the step estimate:
    it computes a prompt only when picked for it, and its decode-heavy rate would never let it
    be picked."""
    queued = max(0, load.queued_tokens - load.running)  # a running decode queues its 1 token
    tokens = queued + num_uncached
    by_steps = -(-tokens // chunk_tokens) * load.step_us / 1e6 if load.step_us > 0 else None
    rate = load.compute_tok_s if all_steps_until_measured else load.prompt_tok_s
    by_rate = tokens / rate if rate > 0 else None
    known = [s for s in (by_steps, by_rate) if s is not None]
    return max(known) if known else None


def tpot_s(load: WorkerLoad) -> float | None:
    """An idle worker's last step time says nothing of the next request's (steps are measured
    only while it runs): None, as for a worker that never stepped."""
    if load.step_us <= 0 or load.running + load.waiting == 0:
        return None
    return load.step_us / 1e6


def within_tpot(workers: Sequence[WorkerInfo], tpot_ms: float) -> list[WorkerInfo]:
    """The decode workers predicted to meet a TPOT objective (an unmeasured one counts)."""
    return [w for w in workers if _meets(tpot_s(w.load), tpot_ms / 1000)]


def _meets(predicted: float | None, objective_s: float) -> bool:
    return predicted is None or predicted <= objective_s


class RemoteRoute(NamedTuple):
    """Prefill in the prefill pool on placement.worker; meets: predicted within the objectives."""

    placement: Placement
    predicted_ttft_s: float | None
    meets: bool = True


class LocalRoute(NamedTuple):
    """The decode worker computes the prompt itself (reason "short", "cached" or "slo")."""

    placement: LocalPlacement
    predicted_ttft_s: float | None = None


class Unmet(NamedTuple):
    """No worker is predicted to serve the request within the objectives; why, in words."""

    reason: str


Route = RemoteRoute | LocalRoute | Unmet


class RouteInputs(NamedTuple):
    """One request's candidates as the router sees them (loads include its own placements)."""

    prefill: Sequence[WorkerInfo]
    prefill_overlap: Mapping[str, int] | None  # None: the index is unavailable
    decode: Sequence[WorkerInfo]
    decode_overlap: Mapping[str, int]
    block_size: int
    num_prompt_tokens: int
    num_blocks_needed: int


def decode_within_tpot(decode: list[WorkerInfo], slo: SloTargets) -> list[WorkerInfo] | Unmet:
    """The decode workers predicted within the TPOT objective (all of them without one, or
    when none is and overload is "place"); Unmet when none is."""
    if slo.tpot_ms <= 0 or not decode:
        return decode
    within = within_tpot(decode, slo.tpot_ms)
    if within or slo.overload == "place":
        return within or decode
    best = min(tpot_s(w.load) or 0.0 for w in decode)
    return Unmet(
        f"every decode worker is over the TPOT objective of {slo.tpot_ms:g} ms "
        f"(the fastest steps in {best * 1000:.0f} ms)"
    )


def route(
    inputs: RouteInputs,
    policy: PrefillPolicy,
    rule: LocalPrefill,
    slo: SloTargets,
    ttft_budget_s: float | None = None,
) -> Route:
    """Where this request goes. ttft_budget_s: what is left of the TTFT objective (the time
    the request already waited in the router is spent); None: the whole objective.

    Order: decode workers predicted over the TPOT objective are left out (none left: Unmet);
    a local prefill the rule admits as "short" or "cached"; the policy's choice among prefill
    workers predicted within the TTFT budget; with rule.on_slo_miss, a decode worker predicted
    to prefill it within the budget; the policy's choice among idle prefill workers (the
    prompt alone is over the budget: no wait would help); else Unmet (or, with overload
    "place", the policy's choice among all prefill workers).
    """
    place_anyway = slo.overload == "place"
    decode = decode_within_tpot(list(inputs.decode), slo)
    if isinstance(decode, Unmet):
        return decode
    local = choose_local_prefill(
        rule,
        decode,
        inputs.decode_overlap,
        inputs.block_size,
        inputs.num_prompt_tokens,
        inputs.num_blocks_needed,
    )
    if local is not None:
        return LocalRoute(local)
    if inputs.prefill_overlap is None:
        placement = route_by_load(inputs.prefill)
        return RemoteRoute(placement, None)
    if slo.ttft_ms <= 0 or not inputs.prefill:  # no objective, or NoWorkerAvailable
        placement = policy.choose(inputs.prefill, inputs.prefill_overlap, inputs.block_size)
        return RemoteRoute(placement, None)
    budget = slo.ttft_ms / 1000 if ttft_budget_s is None else ttft_budget_s
    predicted = _prefill_predictions(inputs)
    within = [w for w in inputs.prefill if _meets(predicted[w.worker_id], budget)]
    if within:
        placement = policy.choose(within, inputs.prefill_overlap, inputs.block_size)
        return RemoteRoute(placement, predicted[placement.worker.worker_id])
    if rule.on_slo_miss:
        here = _local_within(inputs, decode, rule, budget)
        if here is not None:
            return here
    fastest = min(p for p in predicted.values() if p is not None)  # all known: none met
    idle = [w for w in inputs.prefill if w.load.queued_tokens == 0]
    if place_anyway or idle:  # idle: the prompt itself is too long for the objective
        placement = policy.choose(idle or inputs.prefill, inputs.prefill_overlap, inputs.block_size)
        return RemoteRoute(placement, predicted[placement.worker.worker_id], meets=False)
    return Unmet(
        f"the prefill pool is predicted to take {fastest * 1000:.0f} ms to the first token, "
        f"over {ttft_left(slo, budget)}"
    )


LEFT_SLACK_S = 0.02  # a budget this close to the objective is the objective: the lookups' time


def ttft_left(slo: SloTargets, budget_s: float) -> str:
    """What a prediction was held to: the TTFT objective, or what a queued request has left
    of it ("over ...")."""
    if budget_s >= slo.ttft_ms / 1000 - LEFT_SLACK_S:
        return f"the TTFT objective of {slo.ttft_ms:g} ms"
    left_ms = max(0.0, budget_s) * 1000
    return f"the {left_ms:.0f} ms left of the TTFT objective of {slo.ttft_ms:g} ms"


def _prefill_predictions(inputs: RouteInputs) -> dict[str, float | None]:
    overlap = inputs.prefill_overlap or {}
    pool_tok_s = max((w.load.prefill_tok_s for w in inputs.prefill), default=0)
    out = {}
    for worker in inputs.prefill:
        cached = max(0, overlap.get(worker.worker_id, 0)) * inputs.block_size
        uncached = max(0, inputs.num_prompt_tokens - cached)
        out[worker.worker_id] = prefill_ttft_s(worker.load, uncached, pool_tok_s)
    return out


def _local_within(
    inputs: RouteInputs, decode: Sequence[WorkerInfo], rule: LocalPrefill, budget_s: float
) -> LocalRoute | None:
    """The decode worker (with room for the whole request) predicted to prefill it soonest,
    if within the budget."""
    best: LocalRoute | None = None
    for worker in decode:
        if worker.load.free_blocks < inputs.num_blocks_needed:
            continue
        cached = max(0, inputs.decode_overlap.get(worker.worker_id, 0)) * inputs.block_size
        cached = min(cached, inputs.num_prompt_tokens)
        predicted = local_ttft_s(worker.load, inputs.num_prompt_tokens - cached, rule.chunk_tokens)
        if predicted is None or predicted > budget_s:
            continue
        if best is None or predicted < (best.predicted_ttft_s or 0.0):
            best = LocalRoute(LocalPlacement(worker, cached, "slo"), predicted)
    return best
