"""Overload: a router bounded to 2 requests, over a real SmolLM2 engine behind a backend that holds
requests at its door, refuses the third at once (HTTP 503 + Retry-After, gRPC
RESOURCE_EXHAUSTED) without the backend seeing it, counts it, and serves again once a slot frees.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest

from router.pb import kvrelay_pb2 as pb
from router.pb import kvrelay_pb2_grpc as pb_grpc
from tests.conftest import build_engine
from tests.held_backend import HeldBackend
from tests.server_harness import ServerHarness, post_with_headers, serving

MAX_QUEUED = 2
MAX_TOKENS = 6
PROMPT = "The quick brown fox"
BODY = {
    "model": "SmolLM2-135M-Instruct",
    "prompt": PROMPT,
    "max_tokens": MAX_TOKENS,
    "temperature": 0,
}


@pytest.fixture(scope="module")
def harness(smollm_model, smollm_dir) -> Iterator[ServerHarness]:
    engine = build_engine(smollm_model, num_blocks=64, max_model_len=256)
    with serving(engine, smollm_dir, held=True, max_queued_requests=MAX_QUEUED) as harness:
        try:
            yield harness
        finally:
            harness.run(held(harness).release())


@pytest.fixture(autouse=True)
def no_leaks(harness: ServerHarness) -> Iterator[None]:
    yield
    harness.run(held(harness).release())
    harness.assert_no_leaks()
    harness.run(harness.frontend.admission.drained())  # every slot given back


def held(harness: ServerHarness) -> HeldBackend:
    assert harness.held is not None
    return harness.held


def metric(harness: ServerHarness, name: str) -> float:
    with urllib.request.urlopen(harness.base_url + "/metrics", timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


def grpc_request(request_id: str) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    return pb.GenerateRequest(request_id=request_id, prompt=PROMPT, sampling=sampling)


def test_a_full_router_refuses_at_once_and_serves_again_when_a_slot_frees(
    harness: ServerHarness,
) -> None:
    backend = held(harness)
    calls_before, refused_before = (
        backend.num_calls,
        metric(harness, "kvrelay_overloaded_requests_total"),
    )
    harness.run(backend.hold())
    client = openai.OpenAI(base_url=f"{harness.base_url}/v1", api_key="x", max_retries=0)
    with grpc.insecure_channel(harness.grpc_target) as channel, ThreadPoolExecutor(1) as pool:
        stub = pb_grpc.KVRelayStub(channel)
        # Two requests fill the router: one over HTTP, one over gRPC, both held by the backend.
        http_held = pool.submit(post_with_headers, harness, "/v1/completions", BODY)
        grpc_held = stub.Generate(grpc_request("held-grpc"), timeout=120)
        backend.wait_until(lambda b: b.num_held == MAX_QUEUED)
        assert metric(harness, "kvrelay_admitted_requests") == MAX_QUEUED

        status, headers, reply = post_with_headers(harness, "/v1/completions", BODY)
        assert status == 503, reply
        assert headers["Retry-After"] == "1"
        assert reply["error"]["type"] == "server_error"
        assert reply["error"]["code"] == "overloaded"
        assert f"limit of {MAX_QUEUED} requests" in reply["error"]["message"]

        with pytest.raises(openai.InternalServerError) as info:
            client.chat.completions.create(
                model=harness.engine.model_id, messages=[{"role": "user", "content": "hi"}]
            )
        assert info.value.status_code == 503
        assert info.value.response.headers["retry-after"] == "1"

        with pytest.raises(grpc.RpcError) as grpc_info:
            list(stub.Generate(grpc_request("refused-grpc"), timeout=30))
        assert grpc_info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "limit of 2 requests" in grpc_info.value.details()
        assert ("grpc-retry-pushback-ms", "1000") in tuple(grpc_info.value.trailing_metadata())

        # Refused before the backend: it saw only the two held requests. Probes stay open.
        assert backend.num_calls - calls_before == MAX_QUEUED
        assert metric(harness, "kvrelay_overloaded_requests_total") - refused_before == 3
        with urllib.request.urlopen(harness.base_url + "/ready", timeout=10) as response:
            assert response.status == 200

        harness.run(backend.release())
        status, _, reply = http_held.result(timeout=120)
        grpc_responses = list(grpc_held)
    assert status == 200 and reply["usage"]["completion_tokens"] == MAX_TOKENS
    assert sum(len(r.token_ids) for r in grpc_responses) == MAX_TOKENS
    assert "".join(r.text for r in grpc_responses) == reply["choices"][0]["text"]

    harness.run(harness.frontend.admission.drained())
    status, _, again = post_with_headers(harness, "/v1/completions", BODY)
    assert status == 200 and again["choices"][0]["text"] == reply["choices"][0]["text"]


def test_a_queued_request_whose_client_leaves_gives_its_slot_back(harness: ServerHarness) -> None:
    backend = held(harness)
    calls_before = backend.num_calls
    harness.run(backend.hold())
    with grpc.insecure_channel(harness.grpc_target) as channel:
        stub = pb_grpc.KVRelayStub(channel)
        calls = [stub.Generate(grpc_request(f"leaving-{i}"), timeout=120) for i in range(2)]
        backend.wait_until(lambda b: b.num_calls - calls_before == 2 and b.num_held == 2)
        for call in calls:
            call.cancel()
        backend.wait_until(lambda b: b.num_held == 0)
        harness.run(harness.frontend.admission.drained())
        harness.run(backend.release())
        # Both slots are free again: two requests at once are served.
        with ThreadPoolExecutor(2) as pool:
            replies = list(
                pool.map(lambda _: post_with_headers(harness, "/v1/completions", BODY), range(2))
            )
    assert [status for status, _, _ in replies] == [200, 200]
    assert all(r["usage"]["completion_tokens"] == MAX_TOKENS for _, _, r in replies)
