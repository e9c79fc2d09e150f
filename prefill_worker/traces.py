"""PrefillTraces: the open spans of the traced requests a prefill worker holds (`prefill`, its
`prefill.queue` and `prefill.compute`), kept on the engine thread while tracing is on."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common import tracing
from common.messages import GenerateRequest, KVHandle
from engine.step.request import RequestStatus

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from engine.step.request import Request


@dataclass
class _Traced:
    """One traced prefill: its spans, the engine's record of it, when its compute began."""

    span: Span
    queue: Span | None
    request: Request
    compute_started_at: float | None = None


class PrefillTraces:
    """From prefill() to its KVHandle: `prefill` under the router's span, its queue (waiting for
    the scheduler) and its compute (the prompt's steps to its first token).

    Invariant: a request is here from begin() until handed() or abort() ends its spans.

    Queue and compute part where the scheduler first admitted the request: tick() runs right
    before each engine step, so the step that admitted it began at the tick before the one
    that first sees it admitted (or at the last tick, when its first token comes in that
    same step)."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self._traced: dict[str, _Traced] = {}
        self._tick_at = self._last_tick_at = 0.0  # when the latest two ticks ran

    def begin(self, request: GenerateRequest, engine_request: Request) -> None:
        """A traced request was added to the engine (an untraced one is ignored)."""
        if request.traceparent is None:
            return
        from opentelemetry.trace import SpanKind

        attributes = {
            "kvrelay.request_id": request.req_id,
            "kvrelay.worker_id": self.worker_id,
            "kvrelay.prompt_tokens": len(request.prompt_token_ids),
        }
        span = tracing.start_span("prefill", request.traceparent, attributes, kind=SpanKind.SERVER)
        assert span is not None
        queue = tracing.start_child("prefill.queue", span)
        self._traced[request.req_id] = _Traced(span, queue, engine_request)

    def tick(self) -> None:
        if not self._traced:
            return
        self._last_tick_at, self._tick_at = self._tick_at, time.monotonic()
        for traced in self._traced.values():
            if traced.queue is not None and traced.request.status is not RequestStatus.WAITING:
                self._start_compute(traced, self._last_tick_at)

    def handed(self, handle: KVHandle) -> None:
        """The request's first tokens are out: its KVHandle ends its spans (blocks leased)."""
        traced = self._traced.pop(handle.req_id, None)
        if traced is None:
            return
        if traced.queue is not None:  # its whole prompt ran in the step of the last tick
            self._start_compute(traced, self._tick_at)
        compute = tracing.start_child(
            "prefill.compute", traced.span, None, traced.compute_started_at
        )
        tracing.end_span(compute)
        attributes = {
            "kvrelay.cached_tokens": handle.num_cached_tokens,
            "kvrelay.kv.num_blocks": len(handle.block_ids),
            "kvrelay.kv.num_host_blocks": handle.num_host_blocks,
            "kvrelay.lease.epoch": -1 if handle.epoch is None else handle.epoch,
            "kvrelay.lease.seconds": handle.lease_s,
            "kvrelay.needs_decode": handle.needs_decode,
        }
        tracing.end_span(traced.span, attributes)

    def abort(self, req_id: str) -> None:
        traced = self._traced.pop(req_id, None)
        if traced is not None:
            tracing.end_span(traced.queue)
            tracing.end_span(traced.span, {"kvrelay.aborted": True})

    def _start_compute(self, traced: _Traced, at: float) -> None:
        tracing.end_span(traced.queue, end_monotonic=at)
        traced.queue, traced.compute_started_at = None, at
