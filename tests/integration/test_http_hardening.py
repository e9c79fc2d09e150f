"""Issue 46's defects 1 and 7 on the router's real HTTP and gRPC servers over a real SmolLM2
engine: a body over the limit gets 413 naming it; a prompt that cannot fit is refused before it
is tokenized; tokenizing never holds the event loop (/health and gRPC Health answer while a
prompt is being tokenized); max_tokens beyond the context is refused naming the field, never
capped; /v1/models says when the model began being served; a slow body holds no request slot
and times out with 408."""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from router import http_server
from router.pb import kvrelay_pb2 as pb
from router.pb import kvrelay_pb2_grpc as pb_grpc
from router.request_size import MIB
from router.tokenizer import RouterTokenizer
from tests.conftest import build_engine
from tests.server_harness import ServerHarness, post, serving

MAX_MODEL_LEN = 128
MAX_BODY_MIB = 0.25
MAX_BODY_BYTES = int(MAX_BODY_MIB * MIB)
CHAT = [{"role": "user", "content": "Hi"}]
GATE_TIMEOUT_S = 60.0  # a closed gate opens by itself then, so a failing test cannot hang


class GatedTokenizer(RouterTokenizer):
    """The real tokenizer; each encode first says it started, then waits for the gate (open
    unless a test closes it), so a test holds a prompt mid-tokenization for as long as it
    likes."""

    def __init__(self, folder: str | Path):
        super().__init__(folder)
        self.gate = threading.Event()
        self.gate.set()
        self.started = threading.Event()
        self.num_encodes = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.num_encodes += 1
        self.started.set()
        self.gate.wait(GATE_TIMEOUT_S)
        return super().encode(text, add_special_tokens)


@pytest.fixture(scope="module")
def harness(smollm_model, smollm_dir) -> Iterator[ServerHarness]:
    engine = build_engine(smollm_model, num_blocks=64, max_model_len=MAX_MODEL_LEN)
    tokenizer = GatedTokenizer(smollm_dir)
    with serving(engine, smollm_dir, tokenizer=tokenizer, max_body_mib=MAX_BODY_MIB) as h:
        yield h


@pytest.fixture
def tokenizer(harness: ServerHarness) -> Iterator[GatedTokenizer]:
    tokenizer = harness.frontend.tokenizer
    assert isinstance(tokenizer, GatedTokenizer)
    yield tokenizer
    tokenizer.gate.set()


@pytest.fixture(autouse=True)
def no_leaks(harness: ServerHarness) -> Iterator[None]:
    yield
    harness.assert_no_leaks()


def get(harness: ServerHarness, path: str, timeout_s: float = 30) -> tuple[int, dict]:
    with urllib.request.urlopen(harness.base_url + path, timeout=timeout_s) as response:
        return response.status, json.loads(response.read())


def chat(harness: ServerHarness, **fields: object) -> dict:
    return {"model": harness.engine.model_id, "messages": CHAT, "max_tokens": 1, **fields}


def completion(harness: ServerHarness, prompt: str) -> dict:
    return {"model": harness.engine.model_id, "prompt": prompt, "max_tokens": 1}


def assert_refused(reply: tuple[int, dict], status: int, param: str | None, *texts: str) -> None:
    code, body = reply
    assert code == status, body
    error = body["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    for text in texts:
        assert text in error["message"], error


# ---- the body limit -----------------------------------------------------------------------
def test_a_body_over_the_limit_gets_413_naming_the_limit(harness: ServerHarness) -> None:
    big = chat(harness, messages=[{"role": "user", "content": "x" * MAX_BODY_BYTES}])
    reply = post(harness, "/v1/chat/completions", big)
    assert_refused(reply, 413, None, f"limit of {MAX_BODY_BYTES} bytes", "--max-body-mib")
    assert reply[1]["error"]["code"] == "request_too_large"
    for path in ("/v1/completions", "/tokenize", "/detokenize"):
        assert post(harness, path, b" " * (MAX_BODY_BYTES + 1))[0] == 413, path
    assert post(harness, "/v1/chat/completions", chat(harness))[0] == 200


def test_a_chunked_body_over_the_limit_gets_413_too(harness: ServerHarness) -> None:
    """No Content-Length: the limit is enforced while the body is read."""
    connection = http.client.HTTPConnection("127.0.0.1", harness.servers.http.port, timeout=60)
    body = json.dumps(completion(harness, "y" * MAX_BODY_BYTES)).encode()
    chunks = (body[i : i + 65536] for i in range(0, len(body), 65536))
    connection.request("POST", "/v1/completions", chunks, {"Content-Type": "application/json"})
    response = connection.getresponse()
    reply = json.loads(response.read())
    connection.close()
    assert response.status == 413, reply
    assert f"limit of {MAX_BODY_BYTES} bytes" in reply["error"]["message"]


def test_a_grpc_message_over_the_limit_is_refused_and_the_server_serves_on(
    harness: ServerHarness,
) -> None:
    with grpc.insecure_channel(harness.grpc_target) as channel:
        stub = pb_grpc.KVRelayStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(pb.GenerateRequest(prompt="z" * MAX_BODY_BYTES), timeout=30))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert str(MAX_BODY_BYTES) in info.value.details(), info.value.details()
        sampling = pb.SamplingParams(max_tokens=1)
        ok = list(stub.Generate(pb.GenerateRequest(prompt="Hi", sampling=sampling), timeout=60))
    assert ok[-1].finish_reason == pb.FINISH_REASON_LENGTH


# ---- a prompt that cannot fit is refused before it is tokenized ----------------------------
def test_a_prompt_longer_than_the_context_is_refused_without_tokenizing_it(
    harness: ServerHarness, tokenizer: GatedTokenizer
) -> None:
    # Under the body limit, but more bytes than MAX_MODEL_LEN tokens can cover.
    text = "word " * (MAX_BODY_BYTES // 6)
    assert tokenizer.min_num_tokens(text) >= MAX_MODEL_LEN
    before = tokenizer.num_encodes
    reply = post(harness, "/v1/completions", completion(harness, text))
    assert_refused(reply, 400, "prompt", "at least", f"is {MAX_MODEL_LEN} tokens")
    assert reply[1]["error"]["code"] == "context_length_exceeded"
    long_chat = chat(harness, messages=[{"role": "user", "content": text}])
    assert_refused(post(harness, "/v1/chat/completions", long_chat), 400, "messages", "at least")
    channel = grpc.insecure_channel(harness.grpc_target)
    with channel, pytest.raises(grpc.RpcError) as info:
        list(pb_grpc.KVRelayStub(channel).Generate(pb.GenerateRequest(prompt=text), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "context length" in info.value.details()
    assert tokenizer.num_encodes == before  # none of the three was tokenized


# ---- tokenizing never holds the event loop -------------------------------------------------
def _while_tokenizing(tokenizer: GatedTokenizer, send: Future, check: Sequence[object]) -> None:
    """With `send` held mid-tokenization, each of `check` already answered; then let it go."""
    assert tokenizer.started.wait(GATE_TIMEOUT_S), "the request never reached the tokenizer"
    assert not send.done() and not tokenizer.gate.is_set()
    assert all(check)


def test_health_answers_while_a_prompt_is_being_tokenized(
    harness: ServerHarness, tokenizer: GatedTokenizer
) -> None:
    """Ordering, not timing: with the tokenizer held (the loop would be held too if it ran
    there), /health, /v1/models and gRPC Health still answer; the request finishes after."""
    tokenizer.gate.clear()
    tokenizer.started.clear()
    with ThreadPoolExecutor(2) as pool:
        sent = pool.submit(post, harness, "/v1/chat/completions", chat(harness))
        held_tokenize = pool.submit(post, harness, "/tokenize", {"prompt": "Hi there"})
        try:
            assert tokenizer.started.wait(GATE_TIMEOUT_S)
            health = get(harness, "/health", timeout_s=30)
            models = get(harness, "/v1/models", timeout_s=30)
            with grpc.insecure_channel(harness.grpc_target) as channel:
                grpc_ok = pb_grpc.KVRelayStub(channel).Health(pb.HealthRequest(), timeout=30).ok
            _while_tokenizing(tokenizer, sent, [health[0] == 200, models[0] == 200, grpc_ok])
        finally:
            tokenizer.gate.set()
        assert sent.result(60)[0] == 200
        status, body = held_tokenize.result(60)
    assert status == 200 and body["count"] == len(body["tokens"]) > 0


def test_a_grpc_generate_is_tokenized_off_the_loop_too(
    harness: ServerHarness, tokenizer: GatedTokenizer
) -> None:
    tokenizer.gate.clear()
    tokenizer.started.clear()
    request = pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingParams(max_tokens=1))
    with grpc.insecure_channel(harness.grpc_target) as channel, ThreadPoolExecutor(1) as pool:
        stub = pb_grpc.KVRelayStub(channel)
        sent = pool.submit(lambda: list(stub.Generate(request, timeout=60)))
        try:
            _while_tokenizing(tokenizer, sent, [get(harness, "/health", timeout_s=30)[0] == 200])
        finally:
            tokenizer.gate.set()
        assert sent.result(60)[-1].finish_reason == pb.FINISH_REASON_LENGTH


# ---- max_tokens beyond the context: refused, never capped ----------------------------------
def test_max_tokens_beyond_what_the_context_leaves_is_refused_naming_the_field(
    harness: ServerHarness,
) -> None:
    prompt = [42] * (MAX_MODEL_LEN - 8)  # leaves room for 8 tokens
    body = {"model": harness.engine.model_id, "prompt": prompt, "ignore_eos": True}
    reply = post(harness, "/v1/completions", {**body, "max_tokens": 9})
    texts = ("max_tokens=9", f"is {MAX_MODEL_LEN}", "prompt has 120", "at most 8")
    assert_refused(reply, 400, "max_tokens", *texts)
    status, ok = post(harness, "/v1/completions", {**body, "max_tokens": 8})
    assert status == 200 and ok["usage"]["completion_tokens"] == 8, ok
    status, ok = post(harness, "/v1/completions", body)  # left out: up to the context
    assert status == 200 and ok["usage"]["completion_tokens"] == 8, ok

    huge = 10 * MAX_MODEL_LEN
    for field in ("max_tokens", "max_completion_tokens"):
        reply = post(harness, "/v1/chat/completions", chat(harness, **{field: huge}))
        assert_refused(reply, 400, field, f"{field}={huge}", "prompt has")
    with grpc.insecure_channel(harness.grpc_target) as channel:
        sampling = pb.SamplingParams(max_tokens=huge)
        with pytest.raises(grpc.RpcError) as info:
            stub = pb_grpc.KVRelayStub(channel)
            list(stub.Generate(pb.GenerateRequest(prompt="Hi", sampling=sampling), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"max_tokens={huge}" in info.value.details()


def test_models_report_when_the_model_began_being_served(harness: ServerHarness) -> None:
    status, body = get(harness, "/v1/models")
    [model] = body["data"]
    assert status == 200 and model["id"] == harness.engine.model_id
    assert 0 < model["created"] <= time.time()
    assert model["created"] == harness.frontend.created


def test_the_openapi_document_is_served(harness: ServerHarness) -> None:
    status, document = get(harness, "/openapi.json")
    assert status == 200 and document["openapi"].startswith("3.1")
    assert "ChatCompletionRequest" in document["components"]["schemas"]


# ---- a slow body ----------------------------------------------------------------------------
def test_a_slow_body_holds_no_request_slot_and_gets_408(harness: ServerHarness, monkeypatch):
    """A client that sends its headers and part of its body, then stops: while the router
    awaits the rest it holds none of its request slots (a new user's probe: 1,024 such sockets
    held every slot, so every other request got 503), and after BODY_TIMEOUT_S it gets 408."""
    reading = threading.Event()
    read_body = http_server.read_body

    async def watched(request: object) -> bytes:
        reading.set()
        return await read_body(request)

    monkeypatch.setattr(http_server, "read_body", watched)
    monkeypatch.setattr(http_server, "BODY_TIMEOUT_S", 1.0)
    with socket.create_connection(("127.0.0.1", harness.servers.http.port), timeout=60) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: kvrelay\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"model":'
        )
        assert reading.wait(60), "the request never reached its handler"
        assert harness.frontend.admission.num_admitted == 0  # no slot while the body is awaited
        received = b""
        while chunk := sock.recv(65536):  # until the router closes the connection
            received += chunk
        reply = received.decode()
    assert reply.startswith("HTTP/1.1 408"), reply
    assert '"code": "request_timeout"' in reply or '"code":"request_timeout"' in reply, reply
    assert post(harness, "/v1/chat/completions", chat(harness))[0] == 200


def test_a_client_that_leaves_mid_body_is_no_server_error(
    harness: ServerHarness, caplog: pytest.LogCaptureFixture
) -> None:
    """A client closing its connection while its body was read logged an ERROR with a traceback
    ("unhandled error serving"), as if the server had failed; it is logged at debug."""
    with caplog.at_level(logging.DEBUG, logger="router.http_middleware"):
        for _ in range(2):
            with socket.create_connection(("127.0.0.1", harness.servers.http.port)) as sock:
                sock.sendall(
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                    b"\r\nContent-Length: 200\r\n\r\n" + b'{"prompt": "hi'
                )
        deadline = time.monotonic() + 30
        while caplog.text.count("client left during POST /v1/completions") < 2:
            assert time.monotonic() < deadline, caplog.text
            time.sleep(0.05)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert get(harness, "/health")[0] == 200
