"""OtlpSink: an OTLP/HTTP trace receiver on a free 127.0.0.1 port (bench/lib/otlp_receiver.py)
that hands every span it is sent, from any process, to an OpenTelemetry SDK
InMemorySpanExporter, as the SDK's ReadableSpan: what a test reads a cluster's traces from. Owns
the exporter and how many of the received requests it holds."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

from bench.lib.otlp_receiver import OtlpReceiver, any_value


class OtlpSink(OtlpReceiver):
    def __init__(self) -> None:
        super().__init__()
        self.exporter = InMemorySpanExporter()
        self.num_requests = 0  # export requests decoded into the exporter so far

    def _decode_new(self) -> None:
        for body in self.bodies(self.num_requests):
            self.num_requests += 1
            request = ExportTraceServiceRequest.FromString(body)
            self.exporter.export([span for rs in request.resource_spans for span in _spans(rs)])

    def spans_of(self, trace_id: int) -> list[ReadableSpan]:
        self._decode_new()
        spans = self.exporter.get_finished_spans()
        return [s for s in spans if s.context is not None and s.context.trace_id == trace_id]

    def wait_for(
        self, trace_id: int, done: Callable[[list[ReadableSpan]], bool], timeout_s: float = 20.0
    ) -> list[ReadableSpan]:
        """The trace's spans once `done` says they are all in (exporters batch them)."""
        deadline = time.monotonic() + timeout_s
        while not done(spans := self.spans_of(trace_id)):
            if time.monotonic() > deadline:
                names = sorted(s.name for s in spans)
                raise AssertionError(f"trace {trace_id:032x} incomplete: {names}")
            time.sleep(0.1)
        return spans


def _spans(resource_spans: Any) -> list[ReadableSpan]:
    resource = Resource(_attributes(resource_spans.resource.attributes))
    spans = []
    for scope in resource_spans.scope_spans:
        for s in scope.spans:
            trace_id = int.from_bytes(s.trace_id, "big")
            context = SpanContext(
                trace_id, int.from_bytes(s.span_id, "big"), False, TraceFlags(s.flags & 0xFF)
            )
            parent = None
            if s.parent_span_id:
                parent = SpanContext(trace_id, int.from_bytes(s.parent_span_id, "big"), True)
            spans.append(
                ReadableSpan(
                    name=s.name,
                    context=context,
                    parent=parent,
                    resource=resource,
                    attributes=_attributes(s.attributes),
                    events=[
                        Event(e.name, _attributes(e.attributes), e.time_unix_nano) for e in s.events
                    ],
                    kind=SpanKind(max(0, s.kind - 1)),  # OTLP counts UNSPECIFIED first
                    status=Status(StatusCode(s.status.code), s.status.message or None),
                    start_time=s.start_time_unix_nano,
                    end_time=s.end_time_unix_nano,
                )
            )
    return spans


def _attributes(pairs: Any) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in pairs}
