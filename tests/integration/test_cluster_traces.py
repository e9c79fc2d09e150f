"""End-to-end traces on the whole stack (HTTP/gRPC router -> Ray prefill worker -> NIXL -> Ray
decode worker, a local redis-server), every process exporting over OTLP/HTTP (`--otlp-endpoint`)
to a receiver in this test, which keeps the spans in the SDK's InMemorySpanExporter: one
request's tree, router -> placement, prefill (queue, compute) -> KV handoff (queue, NIXL read)
-> decode, each under the right parent, under the client's traceparent."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from opentelemetry.sdk.trace import ReadableSpan

from common import tracing
from router.pb import kvrelay_pb2 as pb
from router.pb import kvrelay_pb2_grpc as pb_grpc
from tests.integration.cluster_support import ClusterHarness, cluster_spec
from tests.otlp_sink import OtlpSink

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 4
# Over three blocks of 16 tokens, led by a tag of each test's own (no prefix shared between
# them): the decode worker reads them over NIXL.
PROMPT = (
    "The old lighthouse keeper climbed the spiral stairs every evening, lit the great lamp, "
    "and watched the ships pass safely through the narrow channel below the cliffs. In the "
    "morning he wrote down every ship he had seen in a leather book kept by the window"
)
CLIENT_SPAN_ID = 0x00F067AA0BA902B7
ROUTER_SPANS = {"kvrelay.request", "router.route", "router.place_decode"}
WORKER_SPANS = {
    "prefill": "kvrelay-prefill",
    "prefill.queue": "kvrelay-prefill",
    "prefill.compute": "kvrelay-prefill",
    "kv_handoff": "kvrelay-decode",
    "decode.queue": "kvrelay-decode",
    "kv.read": "kvrelay-decode",
    "decode": "kvrelay-decode",
}
PARENTS = {  # span -> its parent's name
    "router.route": "kvrelay.request",
    "router.place_decode": "kvrelay.request",
    "prefill": "kvrelay.request",
    "prefill.queue": "prefill",
    "prefill.compute": "prefill",
    "kv_handoff": "kvrelay.request",
    "decode.queue": "kv_handoff",
    "kv.read": "kv_handoff",
    "decode": "kvrelay.request",
}


@pytest.fixture(scope="module")
def sink() -> Iterator[OtlpSink]:
    sink = OtlpSink()
    yield sink
    sink.close()


@pytest.fixture(scope="module")
def stack(sink: OtlpSink) -> Iterator[ClusterHarness]:
    tracing.configure(sink.url, "kvrelay-router")  # this process is the router
    try:
        spec = cluster_spec(num_prefill=1, num_decode=1, otlp_endpoint=sink.url)
        harness = ClusterHarness(spec)
        try:
            yield harness
        finally:
            harness.stop()
    finally:
        tracing.shutdown()


def traceparent(trace_id: int, span_id: int = CLIENT_SPAN_ID) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-01"


def ids_of(value: str) -> tuple[int, int]:
    """(trace id, span id) of a W3C traceparent (of a sampled span)."""
    version, trace_id, span_id, flags = value.split("-")
    assert version == "00" and int(flags, 16) & 1
    return int(trace_id, 16), int(span_id, 16)


def whole(spans: list[ReadableSpan]) -> bool:
    return {s.name for s in spans} >= ROUTER_SPANS | set(WORKER_SPANS)


def check_tree(spans: list[ReadableSpan], root_span_id: int, parent_span_id: int) -> None:
    """One span of each name, each under its parent, from the process it names; the root under
    the client's span; the handoff read real bytes and the decode made the rest of the tokens."""
    by_name = {s.name: s for s in spans}
    assert len(by_name) == len(spans), sorted(s.name for s in spans)
    root = by_name["kvrelay.request"]
    assert root.context.span_id == root_span_id
    assert root.parent is not None and root.parent.span_id == parent_span_id
    for name, parent in PARENTS.items():
        under = by_name[name].parent
        assert under is not None and under.span_id == by_name[parent].context.span_id, name
    for name, service in WORKER_SPANS.items():
        assert by_name[name].resource.attributes["service.name"] == service, name
    assert root.resource.attributes["service.name"] == "kvrelay-router"
    assert root.attributes["kvrelay.completion_tokens"] == MAX_TOKENS
    prefill_worker = by_name["prefill"].resource.attributes["kvrelay.worker_id"]
    assert by_name["router.route"].attributes["kvrelay.worker_id"] == prefill_worker
    read = by_name["kv.read"].attributes
    assert read["kvrelay.kv.num_blocks"] >= 3 and read["kvrelay.kv.bytes"] > 0
    assert by_name["kv_handoff"].attributes["kvrelay.kv.recomputed"] is False
    assert by_name["prefill"].attributes["kvrelay.kv.num_blocks"] >= 3
    decode = by_name["decode"]
    assert decode.attributes["kvrelay.decode.num_tokens"] == MAX_TOKENS - 1  # the 1st: prefill's
    assert 1 <= decode.attributes["kvrelay.decode.num_steps"] <= MAX_TOKENS - 1
    assert [e.name for e in decode.events] == ["first_step"]
    assert decode.events[0].attributes["kvrelay.step_ms"] > 0  # that step's wall time
    assert [e.name for e in root.events] == ["first_token"]  # it left the router's stream


def test_http_request_is_one_span_tree_under_the_clients_traceparent(stack, sink):
    trace_id = 0x4BF92F3577B34DA6A3CE929D0E0E4736
    body = {
        "model": MODEL,
        "prompt": "(http) " + PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    headers = {"Content-Type": "application/json", "traceparent": traceparent(trace_id)}
    url = f"{stack.base_url}/v1/completions"
    request = urllib.request.Request(url, json.dumps(body).encode(), headers)
    with urllib.request.urlopen(request, timeout=120) as reply:
        answered = reply.headers["traceparent"]
        assert json.load(reply)["usage"]["completion_tokens"] == MAX_TOKENS
    answered_trace, root_span_id = ids_of(answered)
    assert answered_trace == trace_id and root_span_id != CLIENT_SPAN_ID
    check_tree(sink.wait_for(trace_id, whole), root_span_id, CLIENT_SPAN_ID)
    stack.wait_until_no_leaks()


def test_grpc_stream_is_traced_from_its_metadata(stack, sink):
    trace_id = 0x0AF7651916CD43DD8448EB211C80319C
    request = pb.GenerateRequest(
        model=MODEL,
        prompt="(grpc) " + PROMPT,
        sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
    )
    with grpc.insecure_channel(stack.grpc_target) as channel:
        call = pb_grpc.KVRelayStub(channel).Generate(
            request, timeout=120, metadata=(("traceparent", traceparent(trace_id)),)
        )
        responses = list(call)
        answered = dict(call.initial_metadata())["traceparent"]
    assert sum(len(r.token_ids) for r in responses) == MAX_TOKENS
    answered_trace, root_span_id = ids_of(answered)
    assert answered_trace == trace_id
    check_tree(sink.wait_for(trace_id, whole), root_span_id, CLIENT_SPAN_ID)
    stack.wait_until_no_leaks()


def test_a_request_without_traceparent_starts_its_own_trace(stack, sink):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    url = f"{stack.base_url}/v1/completions"
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        trace_id, root_span_id = ids_of(reply.headers["traceparent"])
    spans = sink.wait_for(trace_id, lambda spans: "kvrelay.request" in {s.name for s in spans})
    root = next(s for s in spans if s.name == "kvrelay.request")
    assert root.parent is None and root.context.span_id == root_span_id
    stack.wait_until_no_leaks()
