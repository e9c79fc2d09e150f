"""The process's OpenTelemetry tracer (None unless configure() got an OTLP endpoint: then no SDK
is imported and nothing is measured), W3C traceparent strings in and out, and the filter that
holds the exporter's failure lines to one a minute."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, SpanKind, Tracer

logger = logging.getLogger(__name__)
TRACES_PATH = "/v1/traces"  # OTLP/HTTP's path for spans, appended to a bare endpoint
EXPORT_DELAY_MS = 1000  # a finished span waits this long at most for its batch to leave
EXPORT_TIMEOUT_S = 5.0  # one batch's export to the collector, its retries included
SHUTDOWN_S = 3.0  # at shutdown, the last spans' flush: past it they are dropped, with one line
QUIET_S = 60.0  # the exporter's failure lines: one a minute at most, with the count held back
# The loggers of the OTLP exporter and the SDK's batch processor: a collector that is down logs
# a line each batch (each second under traffic, in every process) without QuietLog.
EXPORT_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.sdk._shared_internal",
)
TRACEPARENT = "traceparent"  # the W3C header (HTTP) and metadata key (gRPC), in and out
Attributes = Mapping[str, str | int | float | bool]

_tracer: Tracer | None = None
_provider: TracerProvider | None = None


class QuietLog(logging.Filter):
    """Lets one record through a `window_s`, the first; the next one after it says how many
    were held back. State: the window's start and its count (the exporter's thread logs)."""

    def __init__(self, window_s: float = QUIET_S, clock=time.monotonic) -> None:
        super().__init__()
        self.window_s, self.clock = window_s, clock
        self._opened = float("-inf")
        self._held = 0
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        with self._lock:
            now = self.clock()
            if now - self._opened < self.window_s:
                self._held += 1
                return False
            held, self._held, self._opened = self._held, 0, now
        if held:
            record.msg = f"{record.msg} ({held} similar lines held back in the last window)"
        return True


_quiet = QuietLog()


@dataclass(frozen=True)
class SpanHandle:
    """A span of this process and the W3C traceparent naming it (what another process is given
    as its parent, or a client as its answer)."""

    span: Span
    traceparent: str


def check_endpoint(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of `--otlp-endpoint` (a collector's base URL, e.g.
    http://collector:4318, gets /v1/traces); ValueError naming the flag for anything else."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(
            f"--otlp-endpoint must be an http:// or https:// URL of an OTLP/HTTP collector "
            f"(e.g. http://localhost:4318), got {endpoint!r}"
        )
    path = parts.path.rstrip("/")
    return endpoint if path.endswith(TRACES_PATH) else f"{endpoint.rstrip('/')}{TRACES_PATH}"


def configure(
    endpoint: str | None,
    service: str,
    attributes: Attributes | None = None,
    exporter: SpanExporter | None = None,
) -> None:
    """Trace this process's requests from now on, exported to `endpoint` as `service` (its
    resource also carries `attributes`): in batches over OTLP/HTTP (protobuf), a span at most
    EXPORT_DELAY_MS after it ends. `exporter` instead of OTLP gets each span as it ends (tests).
    None and no exporter: tracing stays off (a configured tracer is kept). Every role calls it
    once at start (the router with `--otlp-endpoint`, a worker with its launch config's
    otlp_endpoint) and shutdown() when it stops."""
    global _tracer, _provider
    if endpoint is None and exporter is None:
        return
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    shutdown()
    resource = Resource.create({"service.name": service, **(attributes or {})})
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)  # shutdown() bounds it
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        assert endpoint is not None
        for name in EXPORT_LOGGERS:
            if _quiet not in logging.getLogger(name).filters:
                logging.getLogger(name).addFilter(_quiet)
        otlp = OTLPSpanExporter(endpoint=check_endpoint(endpoint), timeout=EXPORT_TIMEOUT_S)
        provider.add_span_processor(
            BatchSpanProcessor(
                otlp,
                schedule_delay_millis=EXPORT_DELAY_MS,
                export_timeout_millis=EXPORT_TIMEOUT_S * 1000,
            )
        )
    _provider, _tracer = provider, provider.get_tracer("kvrelay")
    logger.info("tracing on: %s spans to %s", service, endpoint or type(exporter).__name__)


def shutdown() -> None:
    """Send the spans still batched and turn tracing off (idempotent); a collector that does not
    take them within SHUTDOWN_S (down, or not answering) costs no more: they are dropped with
    one line, so a stop is not held up by it."""
    global _tracer, _provider
    provider, _provider, _tracer = _provider, None, None
    if provider is None:
        return
    flush = threading.Thread(target=provider.shutdown, name="tracing-shutdown", daemon=True)
    flush.start()
    flush.join(SHUTDOWN_S)
    if flush.is_alive():
        logger.warning(
            "tracing: the collector did not take the last spans within %g s; they are dropped",
            SHUTDOWN_S,
        )


def enabled() -> bool:
    return _tracer is not None


def start_span(
    name: str,
    traceparent: str | None,
    attributes: Attributes | None = None,
    start_monotonic: float | None = None,
    kind: SpanKind | None = None,
) -> Span | None:
    """A span under the span `traceparent` names (a new trace when it names none, or is not a
    valid W3C traceparent); None when tracing is off. start_monotonic: when it began, on this
    process's time.monotonic() clock (default now)."""
    if _tracer is None:
        return None
    from opentelemetry.trace import SpanKind

    return _tracer.start_span(
        name,
        context=_context(traceparent),
        kind=kind or SpanKind.INTERNAL,
        attributes=attributes,
        start_time=None if start_monotonic is None else wall_ns(start_monotonic),
    )


def start_child(
    name: str,
    parent: Span,
    attributes: Attributes | None = None,
    start_monotonic: float | None = None,
) -> Span | None:
    """A span under `parent`, a span of this process (None when tracing is off)."""
    if _tracer is None:
        return None
    from opentelemetry.trace import set_span_in_context

    return _tracer.start_span(
        name,
        context=set_span_in_context(parent),
        attributes=attributes,
        start_time=None if start_monotonic is None else wall_ns(start_monotonic),
    )


def end_span(
    span: Span | None,
    attributes: Attributes | None = None,
    error: str | None = None,
    end_monotonic: float | None = None,
) -> None:
    """End `span` (nothing for None) with these attributes; `error` marks it failed."""
    if span is None:
        return
    if attributes:
        span.set_attributes(attributes)
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, error))
    span.end(None if end_monotonic is None else wall_ns(end_monotonic))


def traceparent_of(span: Span) -> str:
    """The W3C traceparent naming `span` (for a worker, or the client's response)."""
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def wall_ns(monotonic_s: float) -> int:
    """A time.monotonic() instant as OpenTelemetry's nanoseconds since the epoch."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


def _context(traceparent: str | None) -> Any:
    """The OpenTelemetry context whose current span is the remote one `traceparent` names
    (None: a root span; an invalid one is ignored, as W3C Trace Context asks)."""
    if not traceparent:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract({TRACEPARENT: traceparent})
