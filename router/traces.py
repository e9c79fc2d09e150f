"""A request's spans in the router, no state of its own: its root span (on its Prepared, under the
client's traceparent; its own goes to the workers and back to the client) and its placements'."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from common import tracing
from common.messages import GenerateRequest, WorkerInfo
from common.tracing import SpanHandle
from engine.finish_reason import FinishReason
from router.policy import LocalPlacement, Placement

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from router.choices import ChoiceTrackers

ROOT_SPAN = "kvrelay.request"
# Each function does nothing given None (tracing off, or an untraced request).


def start_request(
    client_traceparent: str | None, req_id: str, model_id: str, arrival: float
) -> SpanHandle | None:
    """The request's root span, begun at `arrival` (monotonic), under the client's span when it
    sent a valid traceparent; None when tracing is off."""
    if not tracing.enabled():
        return None
    from opentelemetry.trace import SpanKind

    attributes = {"kvrelay.request_id": req_id, "kvrelay.model": model_id}
    span = tracing.start_span(ROOT_SPAN, client_traceparent, attributes, arrival, SpanKind.SERVER)
    assert span is not None
    return SpanHandle(span, tracing.traceparent_of(span))


def first_token(trace: SpanHandle | None) -> None:
    """The request's first output leaves the router's stream for the client (an event of its
    root span, `first_token`: where a served TTFT is split, bench/ttft_breakdown.py)."""
    if trace is not None:
        trace.span.add_event("first_token")


def end_request(trace: SpanHandle, tracker: ChoiceTrackers, exc: BaseException | None) -> None:
    """End the root span with the request's usage and each choice's finish reason; `exc` (what
    ended Frontend.generate early) marks it failed, or aborted when the client left."""
    usage = tracker.usage()
    client_left = isinstance(exc, GeneratorExit | asyncio.CancelledError)
    # a choice that did not finish: aborted when the client left (as /metrics counts it), else
    # failed with the request
    unfinished = FinishReason.ABORT if client_left else FinishReason.ERROR
    attributes: dict[str, str | int | bool] = {
        "kvrelay.prompt_tokens": usage.prompt_tokens,
        "kvrelay.completion_tokens": usage.completion_tokens,
        "kvrelay.cached_tokens": usage.cached_tokens,
        "kvrelay.finish_reasons": ",".join(
            (t.finish_reason or unfinished).value for t in tracker.trackers
        ),
    }
    error = None
    if client_left:
        attributes["kvrelay.client_left"] = True
    elif exc is not None:
        error = f"{type(exc).__name__}: {exc}"
    tracing.end_span(trace.span, attributes, error)


def start_placement(
    request: GenerateRequest, name: str, excluded: frozenset[str] = frozenset()
) -> Span | None:
    """A placement step of the request (router.route, router.place_prefill, ...); a retry's
    (excluded: the workers of its role that failed it or stopped taking work) says which
    attempt it is within that role's tries and which workers it passed over."""
    if request.traceparent is None:
        return None
    attributes: dict[str, str | int] = {"kvrelay.attempt": len(excluded) + 1}
    if excluded:
        attributes["kvrelay.excluded_workers"] = ",".join(sorted(excluded))
    return tracing.start_span(name, request.traceparent, attributes)


@contextlib.contextmanager
def placement_span(
    request: GenerateRequest, name: str, excluded: frozenset[str] = frozenset()
) -> Iterator[Span | None]:
    """A placement step's span (None: untraced), ended by end_placement when the step placed
    the request; ended failed when the step raises (refused for the objectives, no worker, the
    index down, cancelled while it queued)."""
    span = start_placement(request, name, excluded)
    try:
        yield span
    except BaseException as e:
        end_placement(span, error=f"{type(e).__name__}: {e}")
        raise


def end_placement(
    span: Span | None,
    placement: Placement | LocalPlacement | None = None,
    decode: WorkerInfo | None = None,
    error: str | None = None,
) -> None:
    """End a placement span naming what it chose: a prefill worker (its id, the prompt tokens
    its cache holds, the policy; a LocalPlacement: the decode worker computes the prompt, and
    why), or a decode worker; `error`: nothing was placed."""
    if span is None:
        return
    attributes: dict[str, str | int | bool] = {}
    if placement is not None:
        local = isinstance(placement, LocalPlacement)
        attributes["kvrelay.local_prefill"] = local
        attributes["kvrelay.worker_id"] = placement.worker.worker_id
        attributes["kvrelay.cached_tokens"] = placement.num_cached_tokens
        attributes["kvrelay.reason"] = placement.reason if local else placement.policy
    if decode is not None:
        attributes["kvrelay.decode_worker_id"] = decode.worker_id
    tracing.end_span(span, attributes, error)
