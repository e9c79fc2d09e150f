"""Aggregated routing (pure, no I/O): where a request goes when the prefill pool has no ready
worker (`kvrelay serve --prefill 0`, or a pool scaled to 0 or emptied by failures): a decode
worker computes its prompt and decodes it. Owns no state.

The choice is the prefill placement's, over the decode workers and their prefix caches: the
policy (kv_aware: cached tokens saved against queued tokens) among the workers with room for
the whole request (all of them when none has), after leaving out those predicted over the TPOT
objective; with a TTFT objective, among those predicted to compute the prompt within what is
left of it (router/slo.py local_ttft_s), else among the idle ones (the prompt alone is over
the objective), else Unmet (queued or refused as SloTargets.overload says; "place" places
anyway).
"""

from __future__ import annotations

from collections.abc import Sequence

from common.messages import WorkerInfo
from common.placement_rules import LocalPrefill, SloTargets
from router.policy import LocalPlacement, PrefillPolicy
from router.slo import (
    LocalRoute,
    RouteInputs,
    Unmet,
    decode_within_tpot,
    local_ttft_s,
    ttft_left,
)

AGGREGATED = "aggregated"  # LocalPlacement.reason and the prefill metric's label (local_...)


def route_aggregated(
    inputs: RouteInputs,
    policy: PrefillPolicy,
    rule: LocalPrefill,
    slo: SloTargets,
    ttft_budget_s: float | None = None,
) -> LocalRoute | Unmet:
    """The decode worker that computes this prompt itself (inputs.prefill is not looked at).
    Raises NoWorkerAvailable (from the policy) when there is no decode worker either."""
    place_anyway = slo.overload == "place"
    decode = decode_within_tpot(list(inputs.decode), slo)
    if isinstance(decode, Unmet):
        return decode
    roomy = [w for w in decode if w.load.free_blocks >= inputs.num_blocks_needed] or decode
    if slo.ttft_ms <= 0 or not roomy:
        return _place(inputs, policy, roomy, None)
    budget_s = slo.ttft_ms / 1000 if ttft_budget_s is None else ttft_budget_s
    predicted = {w.worker_id: _predicted(inputs, w, rule) for w in roomy}
    within = [w for w in roomy if (p := predicted[w.worker_id]) is None or p <= budget_s]
    if within:
        return _place(inputs, policy, within, predicted)
    idle = [w for w in roomy if w.load.running + w.load.waiting == 0]
    if place_anyway or idle:  # idle: the prompt itself is too long for the objective
        return _place(inputs, policy, idle or roomy, predicted)
    fastest = min(p for p in predicted.values() if p is not None)  # all known: none met
    return Unmet(
        f"the decode workers are predicted to take {fastest * 1000:.0f} ms to the first token, "
        f"over {ttft_left(slo, budget_s)}"
    )


def _cached(inputs: RouteInputs, worker: WorkerInfo) -> int:
    blocks = max(0, inputs.decode_overlap.get(worker.worker_id, 0))
    return min(blocks * inputs.block_size, inputs.num_prompt_tokens)


def _predicted(inputs: RouteInputs, worker: WorkerInfo, rule: LocalPrefill) -> float | None:
    uncached = inputs.num_prompt_tokens - _cached(inputs, worker)
    return local_ttft_s(worker.load, uncached, rule.chunk_tokens, all_steps_until_measured=True)


def _place(
    inputs: RouteInputs,
    policy: PrefillPolicy,
    workers: Sequence[WorkerInfo],
    predicted: dict[str, float | None] | None,
) -> LocalRoute:
    chosen = policy.choose(workers, inputs.decode_overlap, inputs.block_size).worker
    placement = LocalPlacement(chosen, _cached(inputs, chosen), AGGREGATED)
    return LocalRoute(placement, None if predicted is None else predicted[chosen.worker_id])
