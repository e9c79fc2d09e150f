"""Traces, each module alone: common/tracing.py (the endpoint flag, traceparent strings, off means
no tracer) and the router's root span through Frontend (router/traces.py) over a scripted backend,
read with the SDK's InMemorySpanExporter: the client's traceparent is the root's parent, the
workers get the root's own, the root ends with the usage; with tracing off nothing is made."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from common import tracing
from common.messages import GenerateRequest, TokenDelta
from deploy.cli import build_parser
from deploy.router_flags import router_options
from deploy.serve_flags import spec_from_args
from engine.finish_reason import FinishReason
from engine.models.loader import resolve_model
from engine.sampling.sampling_params import SamplingParams
from router import traces
from router.backend import Backend
from router.errors import InvalidRequest, Overloaded
from router.frontend import Frontend, RequestSpec
from router.request_spec import Prepared
from router.tokenizer import RouterTokenizer

CLIENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
OUTPUT = (7, 8, 9)


class ScriptedBackend(Backend):
    """Answers every request with OUTPUT, one token a delta; keeps what it was sent."""

    model_id, max_model_len, vocab_size = "m", 128, 1000

    def __init__(self) -> None:
        self.requests: list[GenerateRequest] = []

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        self.requests.append(request)
        for i, token in enumerate(OUTPUT):
            last = i == len(OUTPUT) - 1
            yield TokenDelta(
                request.req_id, (token,), last, FinishReason.LENGTH if last else None, 3
            )

    async def abort(self, req_id: str) -> None:
        pass

    async def health(self) -> dict[str, object]:
        return {"ok": True}


class HeldBackend(ScriptedBackend):
    """ScriptedBackend whose requests wait until `release` is set (one held in flight)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        await self.release.wait()
        async for delta in super().generate(request):
            yield delta


async def drain(frontend: Frontend, prepared: Prepared) -> None:
    async for _ in frontend.generate(prepared):
        pass


@pytest.fixture(scope="module")
def tokenizer() -> RouterTokenizer:
    return RouterTokenizer(resolve_model("default"))


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    tracing.configure(None, "kvrelay-router", exporter=exporter)
    yield exporter
    tracing.shutdown()


def run(frontend: Frontend, spec: RequestSpec) -> GenerateRequest:
    async def go() -> GenerateRequest:
        prepared = await frontend.prepare(spec)
        async for _ in frontend.generate(prepared):
            pass
        return prepared.request

    return asyncio.run(go())


def spec(traceparent: str | None = None) -> RequestSpec:
    return RequestSpec(
        prompt_token_ids=(1, 2, 3),
        sampling=SamplingParams(max_tokens=len(OUTPUT)),
        max_tokens_param="max_tokens",
        traceparent=traceparent,
    )


def test_the_endpoint_flag_takes_a_collectors_url_and_refuses_anything_else() -> None:
    assert tracing.check_endpoint("http://c:4318") == "http://c:4318/v1/traces"
    assert tracing.check_endpoint("https://c/otlp/") == "https://c/otlp/v1/traces"
    assert tracing.check_endpoint("http://c:4318/v1/traces") == "http://c:4318/v1/traces"
    for bad in ("c:4318", "grpc://c:4317", "http://"):
        with pytest.raises(ValueError, match="--otlp-endpoint"):
            tracing.check_endpoint(bad)
    for command in ("serve", "router"):
        with pytest.raises(ValueError, match="--otlp-endpoint"):
            router_options(build_parser().parse_args([command, "--otlp-endpoint", "localhost"]))
        args = build_parser().parse_args([command, "--otlp-endpoint", "http://c:4318"])
        assert router_options(args).otlp_endpoint == "http://c:4318"
        assert "  traces         OTLP/HTTP to http://c:4318" in router_options(args).describe()
    assert router_options(build_parser().parse_args(["serve"])).otlp_endpoint is None
    # serve's workers get it through their launch config
    serve = build_parser().parse_args(["serve", "--device", "cpu", "--otlp-endpoint", "http://c"])
    assert spec_from_args(serve).otlp_endpoint == "http://c"
    assert spec_from_args(build_parser().parse_args(["serve"])).otlp_endpoint is None


def test_off_no_tracer_no_span_and_no_traceparent_for_the_workers(tokenizer) -> None:
    tracing.configure(None, "kvrelay-router")  # no endpoint: stays off
    assert not tracing.enabled()
    assert tracing.start_span("x", CLIENT) is None
    backend = ScriptedBackend()
    request = run(Frontend(backend, tokenizer), spec(CLIENT))
    assert request.traceparent is None and backend.requests[0].traceparent is None


def test_the_clients_traceparent_is_the_roots_parent_and_the_workers_get_the_roots(
    tokenizer, spans: InMemorySpanExporter
) -> None:
    backend = ScriptedBackend()
    request = run(Frontend(backend, tokenizer), spec(CLIENT))
    (root,) = spans.get_finished_spans()
    assert root.name == "kvrelay.request" and root.kind is SpanKind.SERVER
    assert root.context.trace_id == 0x4BF92F3577B34DA6A3CE929D0E0E4736
    assert root.parent is not None and root.parent.span_id == 0x00F067AA0BA902B7
    assert request.traceparent == tracing.traceparent_of(root)  # type: ignore[arg-type]
    assert backend.requests[0].traceparent == request.traceparent
    assert root.attributes["kvrelay.completion_tokens"] == len(OUTPUT)
    assert root.attributes["kvrelay.finish_reasons"] == "length"
    assert root.status.status_code is StatusCode.UNSET


@pytest.mark.parametrize("client", [None, "00-zz-00f067aa0ba902b7-01", "garbage"])
def test_no_or_an_invalid_traceparent_starts_a_new_trace(
    tokenizer, spans: InMemorySpanExporter, client: str | None
) -> None:
    run(Frontend(ScriptedBackend(), tokenizer), spec(client))
    (root,) = spans.get_finished_spans()
    assert root.parent is None and root.context.trace_id != 0


def test_a_failed_request_ends_its_root_span_as_an_error(
    tokenizer, spans: InMemorySpanExporter
) -> None:
    class Failing(ScriptedBackend):
        async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
            raise RuntimeError("the worker is gone")
            yield  # an async generator

    with pytest.raises(Exception, match="the worker is gone"):
        run(Frontend(Failing(), tokenizer), spec(CLIENT))
    (root,) = spans.get_finished_spans()
    assert root.status.status_code is StatusCode.ERROR
    assert root.attributes["kvrelay.finish_reasons"] == "error"


def test_a_client_that_left_ends_its_root_span_aborted_as_metrics_count_it(
    tokenizer, spans: InMemorySpanExporter
) -> None:
    async def go() -> None:
        frontend = Frontend(ScriptedBackend(), tokenizer)
        stream = frontend.generate(await frontend.prepare(spec(CLIENT)))
        await anext(stream)  # one token, then the client goes
        await stream.aclose()

    asyncio.run(go())
    (root,) = spans.get_finished_spans()
    assert root.attributes["kvrelay.client_left"] is True
    assert root.attributes["kvrelay.finish_reasons"] == "abort"  # not "none"


def test_a_request_refused_while_queued_ends_its_root_span_as_an_error(
    tokenizer, spans: InMemorySpanExporter
) -> None:
    """One running slot, held: the next request waits in the router's queue past its deadline
    and is refused there, before any backend call; its root span still ends, failed."""

    async def go() -> None:
        backend = HeldBackend()
        frontend = Frontend(backend, tokenizer, max_running_requests=1)
        first = await frontend.prepare(spec(CLIENT))
        late = await frontend.prepare(replace(spec(CLIENT), deadline_s=0.01))
        holder = asyncio.create_task(drain(frontend, first))
        await asyncio.sleep(0)  # the first takes the slot
        with pytest.raises(Overloaded, match="deadline_s"):
            await drain(frontend, late)
        backend.release.set()
        await holder

    asyncio.run(go())
    late_root, first_root = spans.get_finished_spans()
    assert late_root.status.status_code is StatusCode.ERROR
    assert first_root.status.status_code is StatusCode.UNSET
    assert first_root.attributes["kvrelay.completion_tokens"] == len(OUTPUT)


def test_a_field_refused_has_no_trace_and_a_twin_refused_later_ends_its_root_failed(
    tokenizer, spans: InMemorySpanExporter
) -> None:
    """A bad priority is refused before its root span begins (nothing left unended, nothing
    exported); a request_id already in flight is refused once its trace has begun: ended,
    failed, as a 429 or a queue's 503 is."""

    async def go() -> None:
        backend = HeldBackend()
        frontend = Frontend(backend, tokenizer)
        with pytest.raises(InvalidRequest, match="priority"):
            await frontend.prepare(replace(spec(CLIENT), priority=500))
        assert not spans.get_finished_spans()
        first = await frontend.prepare(replace(spec(CLIENT), req_id="twin"))
        twin = await frontend.prepare(replace(spec(CLIENT), req_id="twin"))
        holder = asyncio.create_task(drain(frontend, first))
        await asyncio.sleep(0)  # the first is in flight
        with pytest.raises(InvalidRequest, match="already in flight"):
            await drain(frontend, twin)
        backend.release.set()
        await holder

    asyncio.run(go())
    twin_root, first_root = spans.get_finished_spans()
    assert twin_root.status.status_code is StatusCode.ERROR
    assert "already in flight" in (twin_root.status.description or "")
    assert first_root.status.status_code is StatusCode.UNSET


def test_the_exporters_failure_lines_are_one_a_window_with_the_count_held_back() -> None:
    now = [0.0]
    quiet = tracing.QuietLog(window_s=60, clock=lambda: now[0])

    def record() -> logging.LogRecord:
        return logging.LogRecord("otlp", logging.WARNING, "", 0, "export failed", None, None)

    first = record()
    assert quiet.filter(first) and first.getMessage() == "export failed"
    for t in (1.0, 30.0, 59.0):
        now[0] = t
        assert not quiet.filter(record())
    now[0] = 61.0
    after = record()
    assert quiet.filter(after)
    assert after.getMessage() == "export failed (3 similar lines held back in the last window)"
    now[0] = 200.0  # nothing held in the window since 61: the next line is plain again
    plain = record()
    assert quiet.filter(plain) and plain.getMessage() == "export failed"


def test_a_collector_that_never_answers_does_not_hold_up_shutdown(monkeypatch, caplog) -> None:
    """A real socket that takes connections and never answers (a hung collector): shutdown()
    gives up on the last spans after SHUTDOWN_S and says so, rather than waiting out the
    exporter's retries."""
    monkeypatch.setattr(tracing, "SHUTDOWN_S", 0.2)
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(8)  # never accepted, never answered
        port = hung.getsockname()[1]
        tracing.configure(f"http://127.0.0.1:{port}", "kvrelay-test")
        try:
            tracing.end_span(tracing.start_span("s", None))
        finally:
            with caplog.at_level(logging.WARNING, logger="common.tracing"):
                tracing.shutdown()
    assert not tracing.enabled()
    assert "did not take the last spans within 0.2 s" in caplog.text


def test_a_retried_placement_says_its_attempt_and_the_workers_it_passed_over(
    spans: InMemorySpanExporter,
) -> None:
    """router/traces.py: a placement after failed ones (ClusterBackend's retries pass the
    workers that failed) carries its attempt number; the first carries 1 and no list."""
    request = GenerateRequest("r", (1, 2, 3), SamplingParams(max_tokens=2), traceparent=CLIENT)
    with traces.placement_span(request, "router.route") as span:
        traces.end_placement(span)
    with traces.placement_span(request, "router.place_decode", frozenset({"d1", "d0"})) as span:
        traces.end_placement(span)
    first, retry = spans.get_finished_spans()
    assert (first.name, retry.name) == ("router.route", "router.place_decode")
    assert first.attributes["kvrelay.attempt"] == 1
    assert "kvrelay.excluded_workers" not in first.attributes
    assert retry.attributes["kvrelay.attempt"] == 3
    assert retry.attributes["kvrelay.excluded_workers"] == "d0,d1"
    assert retry.parent is not None and retry.parent.span_id == first.parent.span_id  # the client's
