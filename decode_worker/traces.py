"""DecodeTraces: the open spans of the traced requests a decode worker holds (`kv_handoff` with its
queue and NIXL read, then `decode`), kept on the engine thread while tracing is on."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common import tracing
from common.messages import GenerateRequest, KVHandle

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from decode_worker.kv_puller import PullerStep
    from engine.step.step_types import RequestOutput


@dataclass
class _Traced:
    """One traced request: its router's traceparent and the span open now (handoff or decode)."""

    traceparent: str
    span: Span
    received_at: float
    decoding: bool = False
    num_steps: int = 0
    num_tokens: int = 0


class DecodeTraces:
    """`kv_handoff`: submit() until the prompt's KV is in place (its `decode.queue`, waiting for
    blocks, then `kv.read`, the NIXL READ with its blocks and bytes, or the recompute that
    replaced it); then `decode` until the last token (its steps and tokens counted, never a span
    a token). Both are children of the router's span.

    Invariant: a request is here from submitted() or prefilled_here() until its last token,
    its refusal or its abort ends its open span."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self._traced: dict[str, _Traced] = {}

    def submitted(self, request: GenerateRequest, handle: KVHandle, received_at: float) -> None:
        """A prefilled request was queued for its KV (an untraced one is ignored)."""
        if request.traceparent is None:
            return
        from opentelemetry.trace import SpanKind

        attributes = {
            "kvrelay.request_id": request.req_id,
            "kvrelay.worker_id": self.worker_id,
            "kvrelay.prefill_worker_id": handle.worker_id,
            "kvrelay.lease.epoch": -1 if handle.epoch is None else handle.epoch,
            "kvrelay.lease.seconds": handle.lease_s,
            "kvrelay.kv.num_leased_blocks": len(handle.block_ids),
        }
        span = tracing.start_span(
            "kv_handoff", request.traceparent, attributes, received_at, SpanKind.SERVER
        )
        assert span is not None
        self._traced[request.req_id] = _Traced(request.traceparent, span, received_at)

    def prefilled_here(self, request: GenerateRequest) -> None:
        """Conditional prefill: the prompt is computed here; no handoff, the decode span only."""
        if request.traceparent is not None:
            self._start_decode(
                request.req_id, request.traceparent, {"kvrelay.prefilled_here": True}
            )

    def puller_step(self, ended: PullerStep) -> None:
        """End the handoffs the KVPuller's step refused or brought in (then decoding starts)."""
        for refused in ended.refused:
            traced = self._traced.pop(refused.req_id, None)
            if traced is not None:
                tracing.end_span(traced.span, error=refused.error)
        for arrival in ended.arrived:
            traced = self._traced.get(arrival.req_id)
            if traced is None or traced.decoding:
                continue
            now, transfer = time.monotonic(), arrival.transfer
            read_at = now - transfer.seconds if transfer.num_blocks else now
            queue = tracing.start_child("decode.queue", traced.span, None, traced.received_at)
            tracing.end_span(queue, end_monotonic=read_at)
            if transfer.num_blocks:
                read = tracing.start_child("kv.read", traced.span, None, read_at)
                tracing.end_span(
                    read,
                    {
                        "kvrelay.kv.num_blocks": transfer.num_blocks,
                        "kvrelay.kv.bytes": transfer.num_bytes,
                    },
                    end_monotonic=now,
                )
            attributes = {
                "kvrelay.kv.num_blocks": transfer.num_blocks,
                "kvrelay.kv.bytes": transfer.num_bytes,
                "kvrelay.kv.recomputed": transfer.recomputed,
            }
            tracing.end_span(traced.span, attributes, end_monotonic=now)
            self._start_decode(arrival.req_id, traced.traceparent, {})

    def on_outputs(
        self,
        outputs: list[RequestOutput],
        is_unfinished: Callable[[str], bool],
        step_s: float = 0.0,
    ) -> None:
        """Count a step's tokens; a request's last ends its decode span. Its first step is an
        event of that span carrying the step's wall time (`step_s`, the engine's)."""
        stepped: set[str] = set()
        ended: set[str] = set()
        for out in outputs:
            traced = self._traced.get(out.req_id)
            if traced is None or not traced.decoding:
                continue
            if traced.num_steps == 0:
                traced.span.add_event("first_step", {"kvrelay.step_ms": step_s * 1000})
            if out.req_id not in stepped:  # n > 1: one output a choice, one step for all
                stepped.add(out.req_id)
                traced.num_steps += 1
            traced.num_tokens += len(out.new_token_ids)
            if out.finished:
                ended.add(out.req_id)
        for req_id in ended:
            if not is_unfinished(req_id):
                traced = self._traced.pop(req_id)
                attributes = {
                    "kvrelay.decode.num_steps": traced.num_steps,
                    "kvrelay.decode.num_tokens": traced.num_tokens,
                }
                tracing.end_span(traced.span, attributes)

    def abort(self, req_id: str) -> None:
        traced = self._traced.pop(req_id, None)
        if traced is not None:
            tracing.end_span(traced.span, {"kvrelay.aborted": True})

    def _start_decode(self, req_id: str, traceparent: str, attributes: dict[str, bool]) -> None:
        span = tracing.start_span(
            "decode",
            traceparent,
            {"kvrelay.request_id": req_id, "kvrelay.worker_id": self.worker_id, **attributes},
        )
        assert span is not None
        self._traced[req_id] = _Traced(traceparent, span, time.monotonic(), decoding=True)
