"""Pool planner: the smallest (num_prefill, num_decode) whose predicted TTFT and TPOT meet an SLO
for a workload, from a PoolProfile (pure; owns no state).

The model, for a mean request of `input_len` prompt tokens (a `cached_fraction` of them found
in a prefix cache) and `output_len` output tokens arriving at `rate` per second, spread evenly
over the workers of each pool:
- prefill: one request takes S = the profile's time for a prompt as long as its uncached
  tokens (attention to the cached part is not counted); a worker's
  utilisation is rho = (rate / n) * S, and TTFT = S + the M/D/1 queueing wait
  rho * S / (2 * (1 - rho)) (Poisson arrivals, one prompt served at a time: conservative, the
  engine packs short prompts together). The KV handoff is not modelled.
- decode: every running request holds a context of about input_len + output_len / 2 tokens.
  By Little's law each worker carries batch = rate * output_len * tpot / n, while
  tpot = the profile's step time at that batch and context; the least batch solving both is
  found exactly on the profile's linear pieces. A worker's largest batch is the smaller of
  max_batch and KV capacity / context; utilisation is the workload's output tokens/s per worker
  over the worker's tokens/s at that largest batch (above 1: the batch grows without bound).
- headroom: each pool's utilisation must also stay at or below `utilisation_target` (0.8).
The two pools are independent, so the smallest total is the smallest prefill pool that meets
the TTFT objective plus the smallest decode pool that meets the TPOT objective.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from deploy.profile import PoolProfile

INF = float("inf")


@dataclass(frozen=True)
class Workload:
    rate: float  # requests per second
    input_len: float  # mean prompt tokens
    output_len: float  # mean output tokens
    cached_fraction: float = 0.0  # of the prompt tokens, those found in a prefix cache

    def __post_init__(self) -> None:
        for name in ("rate", "input_len", "output_len"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"workload: {name} must be a positive number, got {value!r}")
        if not 0.0 <= self.cached_fraction <= 1.0:
            raise ValueError(
                f"workload: cached_fraction must be in [0, 1], got {self.cached_fraction}"
            )

    @property
    def uncached_len(self) -> float:
        """Prompt tokens a prefill worker computes (at least the last one)."""
        return max(1.0, self.input_len * (1.0 - self.cached_fraction))


@dataclass(frozen=True)
class Slo:
    ttft_ms: float
    tpot_ms: float

    def __post_init__(self) -> None:
        if not (self.ttft_ms > 0 and self.tpot_ms > 0):
            raise ValueError(f"slo: ttft_ms and tpot_ms must be > 0, got {self}")


class RecordedRequest(NamedTuple):
    arrival_s: float
    input_len: int
    cached_len: int
    output_len: int
    ok: bool = True  # a failed request counts as an arrival, not in the token means


@dataclass(frozen=True)
class PrefillPrediction:
    num_workers: int
    service_ms: float  # one request's prefill alone
    ttft_ms: float  # inf: saturated (utilisation >= 1)
    utilisation: float


@dataclass(frozen=True)
class DecodePrediction:
    num_workers: int
    batch: float  # running requests per worker; inf: saturated
    tpot_ms: float  # inf: saturated
    kv_fraction: float  # of a worker's KV capacity in use
    utilisation: float


class Failure(NamedTuple):
    objective: str  # "ttft", "tpot" or "max_workers"
    message: str


@dataclass(frozen=True)
class Plan:
    workload: Workload
    slo: Slo
    utilisation_target: float
    max_workers: int
    prefill: PrefillPrediction  # the recommended size, or the largest tried when it fails
    decode: DecodePrediction
    failures: tuple[Failure, ...] = ()

    @property
    def feasible(self) -> bool:
        return not self.failures

    @property
    def num_workers(self) -> int:
        return self.prefill.num_workers + self.decode.num_workers


def predict_prefill(
    profile: PoolProfile, workload: Workload, num_workers: int
) -> PrefillPrediction:
    service_ms = profile.prefill_time_ms(workload.uncached_len)
    rho = workload.rate / num_workers * service_ms / 1000.0
    wait_ms = rho * service_ms / (2.0 * (1.0 - rho)) if rho < 1.0 else INF
    return PrefillPrediction(num_workers, service_ms, service_ms + wait_ms, rho)


def decode_context(workload: Workload) -> float:
    """Tokens a running request holds on average: its prompt and half its output."""
    return workload.input_len + workload.output_len / 2.0


def predict_decode(profile: PoolProfile, workload: Workload, num_workers: int) -> DecodePrediction:
    if workload.input_len + workload.output_len > profile.kv_capacity_tokens:
        return DecodePrediction(num_workers, INF, INF, INF, INF)  # one request does not fit
    context = decode_context(workload)
    largest = min(float(profile.max_batch), profile.kv_capacity_tokens / context)
    per_ms = workload.rate * workload.output_len / num_workers / 1000.0  # output tokens per ms
    utilisation = per_ms * profile.decode_step_time_ms(largest, context) / largest
    batch = profile.steady_batch(per_ms, context)
    if batch is None or batch > largest or utilisation > 1.0:
        return DecodePrediction(num_workers, INF, INF, INF, utilisation)
    tpot_ms = profile.decode_step_time_ms(batch, context)
    kv_fraction = batch * context / profile.kv_capacity_tokens
    return DecodePrediction(num_workers, batch, tpot_ms, kv_fraction, utilisation)


def plan(
    profile: PoolProfile,
    workload: Workload,
    slo: Slo,
    max_workers: int = 16,
    utilisation_target: float = 0.8,
) -> Plan:
    """The smallest pools meeting both objectives within `max_workers` GPUs in all, or the
    largest sizes tried with a Failure for each objective that none of them meets."""
    if max_workers < 2:
        raise ValueError(f"max_workers must be >= 2 (one worker per pool), got {max_workers}")
    if not 0.0 < utilisation_target <= 1.0:
        raise ValueError(f"utilisation_target must be in (0, 1], got {utilisation_target}")
    sizes = range(1, max_workers)  # the other pool needs one worker at least
    prefill = [predict_prefill(profile, workload, n) for n in sizes]
    decode = [predict_decode(profile, workload, n) for n in sizes]
    chosen_p = next(
        (p for p in prefill if p.ttft_ms <= slo.ttft_ms and p.utilisation <= utilisation_target),
        None,
    )
    chosen_d = next(
        (d for d in decode if d.tpot_ms <= slo.tpot_ms and d.utilisation <= utilisation_target),
        None,
    )
    failures = []
    if chosen_p is None:
        failures.append(_prefill_failure(prefill[-1], workload, slo, utilisation_target))
    if chosen_d is None:
        failures.append(_decode_failure(decode[-1], profile, workload, slo, utilisation_target))
    p, d = chosen_p or prefill[-1], chosen_d or decode[-1]
    if chosen_p and chosen_d and p.num_workers + d.num_workers > max_workers:
        message = (
            f"{p.num_workers} prefill + {d.num_workers} decode workers = "
            f"{p.num_workers + d.num_workers} GPUs, more than max_workers {max_workers}"
        )
        failures.append(Failure("max_workers", message))
    return Plan(workload, slo, utilisation_target, max_workers, p, d, tuple(failures))


def _prefill_failure(
    largest: PrefillPrediction, workload: Workload, slo: Slo, target: float
) -> Failure:
    if largest.service_ms > slo.ttft_ms:
        message = (
            f"one prefill of {workload.uncached_len:.0f} uncached tokens takes "
            f"{largest.service_ms:.0f} ms alone, over the {slo.ttft_ms:g} ms TTFT objective: "
            "no prefill pool size meets it"
        )
    else:
        message = (
            f"even {largest.num_workers} prefill workers (all that max_workers leaves) predict "
            f"TTFT {_ms(largest.ttft_ms)} at {largest.utilisation:.1%} utilisation "
            f"(wanted: TTFT <= {slo.ttft_ms:g} ms at <= {target:.0%})"
        )
    return Failure("ttft", message)


def _decode_failure(
    largest: DecodePrediction, profile: PoolProfile, workload: Workload, slo: Slo, target: float
) -> Failure:
    context = decode_context(workload)
    alone_ms = profile.decode_step_time_ms(1, context)
    if alone_ms > slo.tpot_ms:
        message = (
            f"one decode step at {context:.0f} tokens of context takes {alone_ms:.1f} ms even at "
            f"batch 1, over the {slo.tpot_ms:g} ms TPOT objective: no decode pool size meets it"
        )
    elif (needed := workload.input_len + workload.output_len) > profile.kv_capacity_tokens:
        message = (
            f"one request's {needed:.0f} tokens exceed a decode worker's KV capacity "
            f"({profile.kv_capacity_tokens} tokens): no decode pool size meets the TPOT objective"
        )
    else:
        message = (
            f"even {largest.num_workers} decode workers (all that max_workers leaves) predict "
            f"TPOT {_ms(largest.tpot_ms)} at {largest.utilisation:.1%} utilisation "
            f"(wanted: TPOT <= {slo.tpot_ms:g} ms at <= {target:.0%})"
        )
    return Failure("tpot", message)


def _ms(value: float) -> str:
    return "unbounded (saturated)" if value == INF else f"{value:.1f} ms"


# ---- recorded workloads --------------------------------------------------------------------
def workload_from_records(records: Sequence[RecordedRequest]) -> Workload:
    """Mean rate (arrivals - 1 over their span) and token counts (of the requests that
    finished; the cached fraction weighted by prompt tokens) of a recorded trace."""
    if len(records) < 2:
        raise ValueError(f"a recorded trace needs at least 2 requests, got {len(records)}")
    arrivals = sorted(r.arrival_s for r in records)
    span = arrivals[-1] - arrivals[0]
    if span <= 0:
        raise ValueError("the trace's requests all arrive at once: no rate to plan for")
    ok = [r for r in records if r.ok]
    if not ok:
        raise ValueError("the trace has no finished request to take token counts from")
    prompt = sum(r.input_len for r in ok)
    return Workload(
        rate=(len(arrivals) - 1) / span,
        input_len=prompt / len(ok),
        output_len=sum(r.output_len for r in ok) / len(ok),
        cached_fraction=sum(r.cached_len for r in ok) / prompt if prompt else 0.0,
    )


def records_from_report(report: Any, run_index: int = -1) -> list[RecordedRequest]:
    """The per-request records of a serve_bench JSON report (its "requests", or those of
    `runs[run_index]` when it ran several rates); each with its send time."""
    if not isinstance(report, dict):
        raise ValueError("trace: expected a serve_bench JSON object")
    if "runs" in report and "requests" not in report:
        runs = report["runs"]
        if not isinstance(runs, list) or not runs:
            raise ValueError("trace: runs: expected a non-empty list")
        try:
            report = runs[run_index]
        except IndexError:
            raise ValueError(f"trace: no run {run_index} (it has {len(runs)})") from None
    rows = report.get("requests") if isinstance(report, dict) else None
    if not isinstance(rows, list):
        raise ValueError("trace: requests: expected the list of per-request records")
    records = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"trace: requests[{i}]: expected an object")
        if row.get("send_s") is None:
            continue  # never sent (cancelled before its arrival time)
        try:
            records.append(
                RecordedRequest(
                    float(row["send_s"]),
                    int(row.get("prompt_tokens") or 0),
                    int(row.get("cached_tokens") or 0),
                    int(row.get("output_tokens") or 0),
                    bool(row.get("ok", True)),
                )
            )
        except (TypeError, ValueError) as e:
            raise ValueError(f"trace: requests[{i}]: {e}") from None
    return records
