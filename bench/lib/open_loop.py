"""One engine driven open-loop in this process: each request is added once its arrival time
(seconds after a start shared by every driver) has passed, then engine.step() runs; what each
request saw is kept as a RequestTrace and becomes a serve_bench RequestResult. Owns no state
beyond one plan's traces; imports engine modules only when it runs one.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.lib.serve_client import RequestResult


@dataclass(frozen=True)
class TimedRequest:
    """One request of the workload: prompt ids, tokens to generate, arrival after the start."""

    index: int
    prompt_ids: tuple[int, ...]
    max_tokens: int
    arrival_s: float


@dataclass(frozen=True)
class RunPlan:
    label: str  # unique per run: request ids are f"{label}-{index}"
    start_monotonic: float  # time.monotonic() of the shared start (one clock for all children)
    max_duration_s: float  # after the start: requests still unfinished then are aborted
    requests: tuple[TimedRequest, ...]


@dataclass
class RequestTrace:
    """What a child saw of one request; times in seconds after the shared start. One chunk per
    engine step that gave the request tokens (one token per step)."""

    index: int
    arrival_s: float
    added_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    finish_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    finish_reason: str | None = None
    error: str = ""


# ---- results in serve_bench's form ----------------------------------------------------------
def trace_result(trace: RequestTrace, expected_tokens: int) -> RequestResult:
    """serve_bench's record of one request, from the driver's trace: start is the arrival time
    (not when the driver got to add it), so waiting for a running step counts in TTFT."""
    result = RequestResult(
        trace.index, -1, start=trace.arrival_s, expected_output_tokens=expected_tokens
    )
    result.error = trace.error
    result.token_times = [t - trace.arrival_s for t in trace.chunk_times_s]
    result.chunk_tokens = list(trace.chunk_tokens)
    result.prompt_tokens = trace.prompt_tokens
    result.cached_tokens = trace.cached_tokens
    result.output_tokens = trace.output_tokens
    result.finish_reason = trace.finish_reason
    if trace.finish_s is not None and not trace.error:
        result.e2e_s = trace.finish_s - trace.arrival_s
        result.ok = trace.output_tokens > 0
    return result


def trace_extras(trace: RequestTrace, engine_index: int) -> dict[str, Any]:
    lag = None if trace.added_s is None else trace.added_s - trace.arrival_s
    return {"engine": engine_index, "send_s": trace.arrival_s, "add_lag_s": lag}


# ---- the driver -----------------------------------------------------------------------------
def greedy_params(max_tokens: int) -> Any:
    from engine.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def warm_up(engine: Any, prompts: Sequence[Sequence[int]], max_tokens: int) -> None:
    """Untimed: the first prompt alone, then the others at once while it decodes, so prefill,
    mixed and decode steps (and FlashInfer's JIT) have all run once before any timing."""
    params = greedy_params(max_tokens)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"warmup-{i}", list(prompt), params)
        if i == 0:
            for _ in range(2):
                engine.step()
    for _ in range(100 * max_tokens + 100):
        if not engine.has_unfinished_requests:
            break
        engine.step()
    engine.assert_no_leaks()


def drive_open_loop(engine: Any, plan: RunPlan) -> list[RequestTrace]:
    """Add each request once its arrival time has passed and step the engine; a token's time is
    when the step that made it returned. Aborts what is left at plan.max_duration_s."""
    traces = {f"{plan.label}-{r.index}": RequestTrace(r.index, r.arrival_s) for r in plan.requests}
    pending = deque(sorted(plan.requests, key=lambda r: r.arrival_s))

    def clock() -> float:
        return time.monotonic() - plan.start_monotonic

    while pending or engine.has_unfinished_requests:
        now = clock()
        if now > plan.max_duration_s:
            abort_unfinished(engine, plan.label, traces, pending)
            break
        while pending and pending[0].arrival_s <= now:
            request = pending.popleft()
            req_id = f"{plan.label}-{request.index}"
            engine.add_request(req_id, list(request.prompt_ids), greedy_params(request.max_tokens))
            traces[req_id].added_s = clock()
        if not engine.has_unfinished_requests:  # idle until the next arrival
            time.sleep(max(0.0, min(pending[0].arrival_s, plan.max_duration_s) - clock()))
            continue
        outputs = engine.step()
        step_end = clock()
        for out in outputs:
            record_output(traces[out.req_id], out, step_end)
    return list(traces.values())


def record_output(trace: RequestTrace, out: Any, step_end_s: float) -> None:
    if out.new_token_ids:
        trace.chunk_times_s.append(step_end_s)
        trace.chunk_tokens.append(len(out.new_token_ids))
        trace.output_tokens += len(out.new_token_ids)
    trace.prompt_tokens = out.num_prompt_tokens
    trace.cached_tokens = out.num_cached_tokens
    if out.finished:
        trace.finish_s = step_end_s
        trace.finish_reason = out.finish_reason


def abort_unfinished(
    engine: Any, label: str, traces: dict[str, RequestTrace], pending: deque[TimedRequest]
) -> None:
    for req_id, trace in traces.items():
        if trace.finish_s is None and trace.added_s is not None:
            engine.abort(req_id)
            trace.error = "unfinished at max duration (aborted)"
    for request in pending:
        traces[f"{label}-{request.index}"].error = "not yet arrived at max duration"
    pending.clear()
