"""The workers' spans, each module alone (prefill_worker/traces.py, decode_worker/traces.py), fed
the values their worker hands them, read with the SDK's InMemorySpanExporter: the paths the
cluster test does not take (a recomputed prompt, a refused or aborted request, a queued prefill,
n > 1), and untraced requests leave nothing."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from common import tracing
from common.messages import GenerateRequest, KVHandle, TransferStats
from decode_worker.kv_puller import Arrival, PullerStep, Refused
from decode_worker.traces import DecodeTraces
from engine.finish_reason import FinishReason
from engine.sampling.sampling_params import SamplingParams
from engine.step.request import Request, RequestStatus
from engine.step.step_types import RequestOutput
from prefill_worker.traces import PrefillTraces

ROUTER_SPAN = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    tracing.configure(None, "kvrelay-test", exporter=exporter)
    yield exporter
    tracing.shutdown()


def request(req_id: str = "r", traced: bool = True) -> GenerateRequest:
    params = SamplingParams(max_tokens=4)
    return GenerateRequest(req_id, (1, 2, 3), params, traceparent=ROUTER_SPAN if traced else None)


def handle(req_id: str = "r") -> KVHandle:
    return KVHandle(req_id, "p0", "p0", "p0-nixl", (4, 5), 3, 9, 1, 7, 30.0)


def output(req_id: str, finished: bool = False, index: int = 0) -> RequestOutput:
    reason = FinishReason.LENGTH if finished else None
    return RequestOutput(req_id, [1], "", finished, reason, 3, 0, index=index)


def by_name(exporter: InMemorySpanExporter) -> dict[str, ReadableSpan]:
    spans = exporter.get_finished_spans()
    named = {s.name: s for s in spans}
    assert len(named) == len(spans)
    return named


def test_a_recomputed_prompt_has_no_read_span_and_says_so(spans) -> None:
    traces = DecodeTraces("d0")
    traces.submitted(request(), handle(), 0.0)
    traces.puller_step(PullerStep([], [Arrival("r", TransferStats(recomputed=True))]))
    traces.on_outputs([output("r")], lambda req_id: True, 0.25)
    traces.on_outputs([output("r", finished=True)], lambda req_id: False, 0.5)
    named = by_name(spans)
    assert set(named) == {"kv_handoff", "decode.queue", "decode"}
    [first_step] = named["decode"].events  # the first step's, with that step's wall time
    assert first_step.name == "first_step" and first_step.attributes["kvrelay.step_ms"] == 250
    assert named["kv_handoff"].attributes["kvrelay.kv.recomputed"] is True
    assert named["kv_handoff"].attributes["kvrelay.prefill_worker_id"] == "p0"
    assert named["decode"].attributes["kvrelay.decode.num_steps"] == 2
    assert named["decode.queue"].parent.span_id == named["kv_handoff"].context.span_id


def test_n_choices_count_one_step_a_batch_and_end_with_the_last_choice(spans) -> None:
    traces = DecodeTraces("d0")
    traces.submitted(request(), handle(), 0.0)
    traces.puller_step(PullerStep([], [Arrival("r", TransferStats(2, 2048, 0.001))]))
    traces.on_outputs([output("r", True, 0), output("r", False, 1)], lambda req_id: True)
    assert "decode" not in by_name(spans)  # choice 1 goes on
    traces.on_outputs([output("r", True, 1)], lambda req_id: False)
    decode = by_name(spans)["decode"].attributes
    assert decode["kvrelay.decode.num_steps"] == 2 and decode["kvrelay.decode.num_tokens"] == 3
    assert by_name(spans)["kv.read"].attributes["kvrelay.kv.bytes"] == 2048


def test_a_refused_handoff_is_an_error_and_an_aborted_decode_is_marked(spans) -> None:
    traces = DecodeTraces("d0")
    traces.submitted(request("a"), handle("a"), 0.0)
    traces.submitted(request("b"), handle("b"), 0.0)
    traces.puller_step(PullerStep([Refused("a", "no room")], [Arrival("b", TransferStats())]))
    traces.abort("b")
    traces.abort("unknown")
    (refused,) = [
        s for s in spans.get_finished_spans() if s.attributes.get("kvrelay.request_id") == "a"
    ]
    assert (
        refused.status.status_code is StatusCode.ERROR and refused.status.description == "no room"
    )
    (decode,) = [s for s in spans.get_finished_spans() if s.name == "decode"]
    assert decode.attributes["kvrelay.aborted"] is True


def test_a_local_prefill_has_a_decode_span_only(spans) -> None:
    traces = DecodeTraces("d0")
    traces.prefilled_here(request())
    traces.on_outputs([output("r", finished=True)], lambda req_id: False)
    assert by_name(spans)["decode"].attributes["kvrelay.prefilled_here"] is True


def test_a_prefill_queued_for_steps_then_computed(spans) -> None:
    traces = PrefillTraces("p0")
    engine_request = Request("r", [1, 2, 3])
    traces.begin(request(), engine_request)
    traces.tick()  # waiting: still queued
    traces.tick()
    assert not spans.get_finished_spans()
    engine_request.status = RequestStatus.RUNNING  # admitted by the step after that tick
    traces.tick()
    assert set(by_name(spans)) == {"prefill.queue"}
    traces.handed(handle())
    named = by_name(spans)
    assert set(named) == {"prefill", "prefill.queue", "prefill.compute"}
    for name in ("prefill.queue", "prefill.compute"):
        assert named[name].parent.span_id == named["prefill"].context.span_id
    assert named["prefill"].attributes["kvrelay.lease.epoch"] == 7
    assert named["prefill"].attributes["kvrelay.kv.num_blocks"] == 2


def test_an_aborted_prefill_and_untraced_requests(spans) -> None:
    traces = PrefillTraces("p0")
    traces.begin(request(), Request("r", [1, 2, 3]))
    traces.begin(request("u", traced=False), Request("u", [1]))
    traces.abort("r")
    traces.handed(handle("u"))
    decode = DecodeTraces("d0")
    decode.submitted(request("u", traced=False), handle("u"), 0.0)
    decode.puller_step(PullerStep([], [Arrival("u", TransferStats())]))
    named = by_name(spans)
    assert set(named) == {"prefill", "prefill.queue"}
    assert named["prefill"].attributes["kvrelay.aborted"] is True
