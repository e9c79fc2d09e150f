"""RouterMetrics: the router's Prometheus metrics, in a CollectorRegistry of its own per instance.

The front ends record request latencies, token counts, finish reasons and refusals (invalid,
overloaded, unauthenticated); the cluster backend records KV-transfer time and bytes and
prefix-index availability through the hooks below; each worker's load and handoff figures are
its own report, asked for at each scrape (WorkerStatsCollector). `render()` gives the
text exposition for `GET /metrics`.
"""

from __future__ import annotations

from typing import NamedTuple

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from common.cluster_state import ClassQueue
from common.messages import TransferStats
from common.placement_rules import SloTargets
from engine.finish_reason import FinishReason
from router.fair_queue import queue_by_class
from router.recent_latency import RecentLatencies
from router.worker_metrics import WorkerStatsCollector

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class RouterTotals(NamedTuple):
    """The router's running totals, for the periodic stats line."""

    num_streamed_tokens: int  # output tokens that reached clients' streams (see totals())
    num_finished: int  # requests that ended, however
    num_in_flight: int  # requests running now
    queue: tuple[ClassQueue, ...] = ()  # the router's queue by key class (none: no FairQueue)


class RouterMetrics:
    """Every metric the router exports; one instance per app (tests build several)."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.recent = RecentLatencies()  # for the controller's SLO attainment, not exported
        # output tokens that reached clients' streams, every choice's (the stats line's rate)
        self.num_streamed_tokens = 0
        # A router serving several models: each model's own, for its own controller (set by
        # ModelsBackend; one model's load never judges another's pools).
        self.per_model = False
        self._recent_by_model: dict[str, RecentLatencies] = {}
        r = self.registry
        # the latencies by served model (a router may serve several: each its own objectives)
        self.ttft = Histogram(
            "kvrelay_time_to_first_token_seconds",
            "Arrival at the router to the first generated token reaching it, by served model.",
            ["model"],
            registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        self.itl = Histogram(
            "kvrelay_inter_token_latency_seconds",
            "Time between two successive output tokens of one request (per token), by served"
            " model.",
            ["model"],
            registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        self.queue_time = Histogram(
            "kvrelay_queue_time_seconds",
            "Arrival at the router to the backend taking the request (validation, tokenizing,"
            " admission), by served model.",
            ["model"],
            registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        self.e2e_latency = Histogram(
            "kvrelay_request_latency_seconds",
            'Arrival at the router to the request\'s end, by served model ("": refused before'
            " its model was known).",
            ["model"],
            registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        self.prompt_tokens = Counter(
            "kvrelay_prompt_tokens",
            "Prompt tokens of ended requests (those that ended before their first token too).",
            registry=r,
        )
        self.cached_prompt_tokens = Counter(
            "kvrelay_cached_prompt_tokens",
            "Prompt tokens served from a prefix cache (hit rate = this / prompt tokens).",
            registry=r,
        )
        self.generation_tokens = Counter(
            "kvrelay_generation_tokens", "Generated tokens returned to clients.", registry=r
        )
        self.requests = Counter(
            "kvrelay_requests",
            "Finished requests by finish reason (stop, length, abort, error).",
            ["finish_reason"],
            registry=r,
        )
        self.model_requests = Counter(
            "kvrelay_model_requests",
            "Finished requests by served model and finish reason.",
            ["model", "finish_reason"],
            registry=r,
        )
        self.model_generation_tokens = Counter(
            "kvrelay_model_generation_tokens",
            "Generated tokens returned to clients, by served model.",
            ["model"],
            registry=r,
        )
        self.rejected = Counter(
            "kvrelay_rejected_requests", "Requests refused as invalid (HTTP 400).", registry=r
        )
        self.running = Gauge("kvrelay_running_requests", "Requests in flight.", registry=r)
        self.overloaded = Counter(
            "kvrelay_overloaded_requests",
            "Requests refused at once because the router held --max-queued-requests already"
            " (HTTP 503 / RESOURCE_EXHAUSTED).",
            registry=r,
        )
        self.unavailable = Counter(
            "kvrelay_unavailable_requests",
            "Requests refused before any output because no worker could take them, the server"
            " was shutting down (HTTP 503 / gRPC UNAVAILABLE) or no worker was predicted to meet"
            " the objectives (HTTP 503 / gRPC RESOURCE_EXHAUSTED, kvrelay_slo_refused).",
            registry=r,
        )
        self.unauthenticated = Counter(
            "kvrelay_unauthenticated_requests",
            "Requests refused for a missing or unknown API key (HTTP 401 / UNAUTHENTICATED).",
            registry=r,
        )
        self.admitted = Gauge(
            "kvrelay_admitted_requests",
            "Requests the router holds now: being parsed, queued or running.",
            registry=r,
        )
        self.max_queued = Gauge(
            "kvrelay_max_queued_requests",
            "The bound on admitted requests (--max-queued-requests).",
            registry=r,
        )
        # Per API-key tenant (router/rate_limits.py); the tenants are the key file's.
        self.tenant_requests = Counter(
            "kvrelay_tenant_requests",
            "Requests of each API-key tenant that passed its per-key limits.",
            ["tenant"],
            registry=r,
        )
        self.tenant_tokens = Counter(
            "kvrelay_tenant_tokens",
            "Tokens of each API-key tenant's ended requests, by kind (prompt, completion).",
            ["tenant", "kind"],
            registry=r,
        )
        self.tenant_refused = Counter(
            "kvrelay_tenant_refused_requests",
            "Requests refused by a tenant's per-key limit (HTTP 429 / RESOURCE_EXHAUSTED), by"
            " limit (rps, tpm, streams).",
            ["tenant", "limit"],
            registry=r,
        )
        self.rate_limits_available = Gauge(
            "kvrelay_rate_limits_available",
            "1 while Redis answers the per-key limits' scripts; 0 while they fail open.",
            registry=r,
        )
        self.rate_limits_available.set(1)
        # Hooks for the cluster backend.
        self.transfer_time = Histogram(
            "kvrelay_kv_transfer_seconds",
            "One request's KV pull from prefill to decode worker.",
            registry=r,
            buckets=_TRANSFER_BUCKETS,
        )
        self.transfer_bytes = Counter(
            "kvrelay_kv_transfer_bytes", "Bytes of KV moved between workers.", registry=r
        )
        self.prefills = Counter(
            "kvrelay_prefills",
            "Prompts prefilled, by where: remote (the prefill pool, then a KV transfer) or"
            " local_short / local_cached / local_slo / local_aggregated (a decode worker"
            " computed it itself: few tokens left, most of it in its cache, the prefill pool"
            " would miss the TTFT objective, or there is no prefill worker).",
            ["where"],
            registry=r,
        )
        self.slo_queued = Counter(
            "kvrelay_slo_queued",
            "Requests that waited in the router because no worker was predicted to meet the"
            " objectives (--slo-overload queue).",
            registry=r,
        )
        self.slo_deferred = Counter(
            "kvrelay_slo_deferred",
            "Placement looks (one each poll) that found a worker predicted to meet the"
            " objectives but left it to a request of higher priority waiting for them.",
            registry=r,
        )
        self.slo_refused = Counter(
            "kvrelay_slo_refused",
            "Requests refused (503 / RESOURCE_EXHAUSTED) because no worker was predicted to"
            " meet the objectives in time.",
            registry=r,
        )
        self.slo_requests = Counter(
            "kvrelay_slo_requests",
            "Requests that finished (stop or length), judged against each objective the router"
            " places for (objective: ttft, or tpot for those of two tokens or more; met: true"
            " or false), by served model and the API key's traffic class (interactive or"
            " batch; interactive without keys). A request with deadline_s is placed without"
            " the objectives and not judged.",
            ["model", "traffic_class", "objective", "met"],
            registry=r,
        )
        self.migrations = Counter(
            "kvrelay_migrations",
            "Requests resumed on another decode worker after theirs died.",
            registry=r,
        )
        self.index_drift = Counter(
            "kvrelay_prefix_index_drift_tokens",
            "Prompt tokens the index said a prefill worker held that it did not reuse.",
            registry=r,
        )
        self.index_drift_events = Counter(
            "kvrelay_prefix_index_drifts",
            "Prefills that reused less than the index promised (the worker re-publishes).",
            registry=r,
        )
        self.index_available = Gauge(
            "kvrelay_prefix_index_available",
            "1 while the Redis prefix index answers; 0 while routing by load alone.",
            registry=r,
        )
        self.index_available.set(1)
        # The workers' own figures (load, KV handoff states and refusals), refreshed per scrape.
        self.worker_stats = WorkerStatsCollector()
        r.register(self.worker_stats)

    def recent_of(self, model: str) -> RecentLatencies:
        """The recent latencies a model's controller is told of: the router's own with one
        model, that model's alone with several."""
        if not self.per_model:
            return self.recent
        return self._recent_by_model.setdefault(model, RecentLatencies())

    # ---- front-end hooks -----------------------------------------------------------------
    def observe_finished(
        self,
        finish_reason: FinishReason,
        num_prompt_tokens: int,
        num_cached_tokens: int,
        num_output_tokens: int,
        latency_s: float,
        model: str = "",
    ) -> None:
        """model: the served model's id ("" when not known: no per-model series)."""
        self.requests.labels(finish_reason=finish_reason).inc()
        if model:
            self.model_requests.labels(model=model, finish_reason=finish_reason).inc()
            self.model_generation_tokens.labels(model=model).inc(num_output_tokens)
        self.prompt_tokens.inc(num_prompt_tokens)
        self.cached_prompt_tokens.inc(num_cached_tokens)
        self.generation_tokens.inc(num_output_tokens)
        self.e2e_latency.labels(model=model).observe(latency_s)

    def observe_objectives(
        self,
        slo: SloTargets,
        ttft_s: float,
        tpot_s: float | None,
        model: str = "",
        traffic_class: str = "interactive",
    ) -> None:
        """One request that finished with output, against each objective slo sets (as the
        controller's attainment judges them: at or under the objective is met)."""
        judged = [("ttft", ttft_s, slo.ttft_ms), ("tpot", tpot_s, slo.tpot_ms)]
        for objective, seconds, target_ms in judged:
            if target_ms > 0 and seconds is not None:
                met = "true" if seconds <= target_ms / 1000 else "false"
                self.slo_requests.labels(model, traffic_class, objective, met).inc()

    # ---- cluster-backend hooks -----------------------------------------------------------
    def observe_transfer(self, stats: TransferStats) -> None:
        """One request's KV pull (nothing to record when no block moved)."""
        if stats.num_bytes:
            self.transfer_time.observe(stats.seconds)
            self.transfer_bytes.inc(stats.num_bytes)

    def observe_index_drift(self, num_tokens: int) -> None:
        self.index_drift.inc(num_tokens)
        self.index_drift_events.inc()

    def observe_prefill(self, where: str) -> None:
        self.prefills.labels(where=where).inc()

    def observe_migration(self) -> None:
        self.migrations.inc()

    def set_index_available(self, available: bool) -> None:
        self.index_available.set(1 if available else 0)

    def observe_streamed(self, num_tokens: int) -> None:
        """num_tokens of one choice's output reached its client's stream."""
        self.num_streamed_tokens += num_tokens

    def totals(self) -> RouterTotals:
        """Totals so far; streamed tokens are counted as they stream (every choice's), not when
        the request ends."""
        finished = _sum(self.requests, "_total")
        running = int(_sum(self.running, ""))
        return RouterTotals(
            self.num_streamed_tokens, int(finished), running, queue_by_class(self.registry)
        )

    def render(self) -> bytes:
        """Prometheus text exposition of this instance's registry."""
        return generate_latest(self.registry)


def _sum(metric: Counter | Gauge | Histogram, suffix: str) -> float:
    """The sum of a metric's samples named with `suffix` (over all its labels)."""
    [family] = metric.collect()
    return sum(s.value for s in family.samples if s.name == family.name + suffix)
