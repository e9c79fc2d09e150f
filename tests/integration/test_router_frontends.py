"""The router's HTTP (OpenAI) and gRPC front ends on real servers over a real SmolLM2 engine."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import openai
import pytest

from engine.llm import LLM
from engine.sampling.sampling_params import SamplingParams
from router.pb import kvrelay_pb2 as pb
from router.pb import kvrelay_pb2_grpc as pb_grpc
from tests.conftest import build_engine
from tests.server_harness import ServerHarness, serving

MAX_TOKENS = 8
MAX_MODEL_LEN = 256
CHAT = [{"role": "user", "content": "Name three rivers."}]
PROMPT = "Once upon a time"


@dataclass
class Served:
    harness: ServerHarness
    model: str
    chat_ids: list[int]
    chat_ref: list[int]  # greedy tokens the engine alone gives for CHAT
    chat_text: str
    prompt_ref: list[int]
    prompt_text: str

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.harness.base_url}/v1", api_key="x", max_retries=0)

    def stub(self, channel: grpc.Channel) -> pb_grpc.KVRelayStub:
        return pb_grpc.KVRelayStub(channel)


@pytest.fixture(scope="module")
def served(smollm_model, smollm_dir) -> Iterator[Served]:
    engine = build_engine(smollm_model, num_blocks=64, max_model_len=MAX_MODEL_LEN)
    llm = LLM(engine=engine)  # references first, before the engine thread owns the engine
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    chat_ids = llm.chat_prompt(CHAT)
    chat = llm.generate([chat_ids], greedy)[0]
    prompt = llm.generate([PROMPT], greedy)[0]
    with serving(engine, smollm_dir) as harness:
        yield Served(
            harness, engine.model_id, chat_ids, chat.token_ids, chat.text, prompt.token_ids,
            prompt.text,
        )  # fmt: skip


@pytest.fixture(autouse=True)
def no_leaks(served: Served) -> Iterator[None]:
    yield
    served.harness.assert_no_leaks()


def post(served: Served, path: str, body: bytes | dict) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        served.harness.base_url + path, data, {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


# ---- OpenAI client ------------------------------------------------------------------------
def test_openai_chat_matches_engine_greedy(served: Served) -> None:
    client = served.client()
    args = {"model": served.model, "messages": CHAT, "max_tokens": MAX_TOKENS, "temperature": 0}
    reply = client.chat.completions.create(**args)
    assert reply.choices[0].message.content == served.chat_text
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.prompt_tokens == len(served.chat_ids)
    assert reply.usage.completion_tokens == len(served.chat_ref) == MAX_TOKENS
    # The references left the prompt's full blocks in the engine's prefix cache.
    assert reply.usage.prompt_tokens_details.cached_tokens >= 16

    stream = client.chat.completions.create(
        **args, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all("usage" in c.model_fields_set for c in chunks)  # null but in the last, as OpenAI
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == served.chat_text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_openai_completions_matches_engine_greedy(served: Served) -> None:
    client = served.client()
    args = {"model": served.model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    reply = client.completions.create(**args, logprobs=0)
    assert reply.choices[0].text == served.prompt_text
    assert len(reply.choices[0].logprobs.token_logprobs) == MAX_TOKENS
    assert reply.usage.completion_tokens == MAX_TOKENS

    chunks = list(client.completions.create(**args, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == served.prompt_text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_string_is_cut_router_side_and_the_engine_request_ends(served: Served) -> None:
    words = served.prompt_text.split()
    stop = " " + words[len(words) // 2]
    reply = served.client().completions.create(
        model=served.model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stop=[stop]
    )
    assert reply.choices[0].text == served.prompt_text[: served.prompt_text.index(stop)]
    assert reply.choices[0].finish_reason == "stop"


def test_models_health_and_metrics(served: Served) -> None:
    assert [m.id for m in served.client().models.list()] == [served.model]
    base = served.harness.base_url
    with urllib.request.urlopen(base + "/health", timeout=10) as response:
        assert json.loads(response.read())["ok"] is True
    with urllib.request.urlopen(base + "/live", timeout=10) as response:  # liveness probes
        assert json.loads(response.read()) == {"live": True}
    with urllib.request.urlopen(base + "/metrics", timeout=10) as response:
        text = response.read().decode()
    for name in (
        "kvrelay_time_to_first_token_seconds_bucket",
        "kvrelay_inter_token_latency_seconds_bucket",
        "kvrelay_queue_time_seconds_bucket",
        "kvrelay_cached_prompt_tokens_total",
        'kvrelay_requests_total{finish_reason="length"}',
    ):
        assert name in text, name


# ---- gRPC ---------------------------------------------------------------------------------
def test_grpc_generate_streams_the_engine_greedy_tokens(served: Served) -> None:
    chat = pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in CHAT])
    request = pb.GenerateRequest(
        model=served.model,
        chat=chat,
        sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=True),
    )
    with grpc.insecure_channel(served.harness.grpc_target) as channel:
        stub = served.stub(channel)
        responses = list(stub.Generate(request, timeout=60))
        models = stub.ListModels(pb.ListModelsRequest(), timeout=10).models
        assert stub.Health(pb.HealthRequest(), timeout=10).ok
    assert [t for r in responses for t in r.token_ids] == served.chat_ref
    assert "".join(r.text for r in responses) == served.chat_text
    assert sum(len(r.logprobs) for r in responses) == MAX_TOKENS
    last = responses[-1]
    assert last.finish_reason == pb.FINISH_REASON_LENGTH and last.HasField("usage")
    assert last.usage.prompt_tokens == len(served.chat_ids)
    assert last.usage.completion_tokens == MAX_TOKENS
    assert [m.id for m in models] == [served.model]


# ---- bad input ----------------------------------------------------------------------------
LONG_PROMPT = "hello " * (MAX_MODEL_LEN + 10)
BAD_SCHEMA = {"type": "json_schema", "json_schema": {"name": "city", "schema": {"type": 12}}}
SCHEMA_PARAM = "response_format.json_schema.schema"
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CHAT_BODY = {"model": "SmolLM2-135M-Instruct", "messages": CHAT, "max_tokens": 1}
COMPLETION_BODY = {"model": "SmolLM2-135M-Instruct", "max_tokens": 1}
BAD_HTTP = [
    ("/v1/chat/completions", b'{"model": "x", "messages": [', None, "JSON"),
    ("/v1/chat/completions", {"model": "SmolLM2-135M-Instruct"}, "messages", "Field required"),
    ("/v1/chat/completions", {**CHAT_BODY, "messages": "hi"}, "messages", "valid array"),
    ("/v1/chat/completions", {**CHAT_BODY, "max_tokens": "ten"}, "max_tokens", "integer"),
    ("/v1/chat/completions", {**CHAT_BODY, "max_tokens": -1}, "max_tokens", "positive"),
    ("/v1/chat/completions", {**CHAT_BODY, "temperature": -1}, "temperature", "greater"),
    ("/v1/chat/completions", {**CHAT_BODY, "model": "gpt-9"}, "model", "not served"),
    ("/v1/completions", {**COMPLETION_BODY, "prompt": LONG_PROMPT}, "prompt", "context length"),
    ("/v1/completions", {**COMPLETION_BODY, "prompt": [1, 10**6]}, "prompt", "vocabulary"),
    ("/v1/completions", {**COMPLETION_BODY, "prompt": "hi", "n": 17}, "n", "[1, 16]"),
    # Fields that would change the output but are not built: refused, never ignored.
    (
        "/v1/chat/completions",
        {**CHAT_BODY, "structured_outputs": {"json": {}}},
        "structured_outputs",
        "not supported",
    ),
    # Structured outputs that are built, with a bad schema.
    ("/v1/chat/completions", {**CHAT_BODY, "response_format": BAD_SCHEMA}, SCHEMA_PARAM, "valid"),
    ("/v1/chat/completions", {**CHAT_BODY, "tools": [TOOL]}, "tools", "not supported"),
    ("/v1/chat/completions", {**CHAT_BODY, "tool_choice": "required"}, "tool_choice", ""),
    # Sampling fields that are built, with bad values.
    ("/v1/chat/completions", {**CHAT_BODY, "logit_bias": {"42": 101}}, "logit_bias", "[-100"),
    (
        "/v1/completions",
        {**COMPLETION_BODY, "prompt": "hi", "logit_bias": {str(10**7): 5}},
        "logit_bias",
        "vocabulary",
    ),
    ("/v1/completions", {**COMPLETION_BODY, "prompt": "hi", "logprobs": 30}, "logprobs", "20"),
    # Scheduling extras (router/traffic_class.py).
    ("/v1/completions", {**COMPLETION_BODY, "prompt": "hi", "priority": 101}, "priority", "[-100"),
    ("/v1/completions", {**COMPLETION_BODY, "prompt": "hi", "deadline_s": 0}, "deadline_s", "(0,"),
]


@pytest.mark.parametrize(("path", "body", "param", "message"), BAD_HTTP)
def test_bad_http_input_is_400_with_a_message(
    served: Served, path: str, body: bytes | dict, param: str | None, message: str
) -> None:
    status, reply = post(served, path, body)
    assert status == 400, reply
    error = reply["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert message in error["message"], error


def test_openai_client_gets_400_for_a_bad_json_schema_and_text_passes(served: Served) -> None:
    client = served.client()
    with pytest.raises(openai.BadRequestError, match="response_format") as info:
        client.chat.completions.create(
            model=served.model, messages=CHAT, max_tokens=1, response_format=BAD_SCHEMA
        )
    assert info.value.status_code == 400
    reply = client.chat.completions.create(
        model=served.model, messages=CHAT, max_tokens=1, response_format={"type": "text"}
    )
    assert reply.usage.completion_tokens == 1


def test_server_keeps_serving_after_bad_input(served: Served) -> None:
    client = served.client()
    with pytest.raises(openai.BadRequestError, match="not served"):
        client.chat.completions.create(model="gpt-9", messages=CHAT)
    status, reply = post(served, "/v1/chat/completions", CHAT_BODY)
    assert status == 200 and reply["usage"]["completion_tokens"] == 1


BAD_GRPC = [
    (pb.GenerateRequest(), "prompt, chat or token_ids"),
    (pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=-3)), "max_tokens"),
    (pb.GenerateRequest(model="gpt-9", prompt="hi"), "not served"),
    (pb.GenerateRequest(prompt=LONG_PROMPT), "context length"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, -1])), "vocabulary"),
    (pb.GenerateRequest(chat=pb.ChatMessages()), "messages"),
    (pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(top_p=2)), "top_p"),
    (pb.GenerateRequest(prompt="hi", priority=-101), "priority"),
    (pb.GenerateRequest(prompt="hi", deadline_s=-1.0), "deadline_s"),
]


def test_bad_grpc_input_is_invalid_argument_and_the_server_keeps_serving(served: Served) -> None:
    with grpc.insecure_channel(served.harness.grpc_target) as channel:
        stub = served.stub(channel)
        for request, message in BAD_GRPC:
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(request, timeout=30))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, request
            assert message in info.value.details(), info.value.details()
        raw = channel.unary_stream("/kvrelay.v1.KVRelay/Generate")  # bytes in, bytes out
        with pytest.raises(grpc.RpcError) as info:
            list(raw(b"\xff\xff\xff not a message", timeout=30))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid GenerateRequest" in info.value.details()
        for method in ("Tokenize", "Detokenize", "ListModels", "Health"):  # UNKNOWN before
            unary = channel.unary_unary(f"/kvrelay.v1.KVRelay/{method}")
            with pytest.raises(grpc.RpcError) as info:
                unary(b"\xff\xff\xff not a message", timeout=30)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
            assert f"not a valid {method}Request" in info.value.details()
        sampling = pb.SamplingParams(max_tokens=1)
        ok = list(stub.Generate(pb.GenerateRequest(prompt="hi", sampling=sampling), timeout=60))
    assert ok[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED


# ---- client gone --------------------------------------------------------------------------
def test_http_client_disconnect_mid_stream_aborts_the_request(served: Served) -> None:
    stream = served.client().chat.completions.create(
        model=served.model,
        messages=CHAT,
        max_tokens=MAX_MODEL_LEN // 2,  # long enough to be cut; the prompt leaves room
        stream=True,
        extra_body={"ignore_eos": True},
    )
    req_id = None
    for i, chunk in enumerate(stream):
        req_id = chunk.id
        if i == 2:
            break
    stream.close()
    served.harness.assert_no_leaks()  # waits for the cleanup, then checks the engine
    assert req_id in served.harness.backend.aborted


def test_grpc_cancel_aborts_the_request(served: Served) -> None:
    sampling = pb.SamplingParams(max_tokens=MAX_MODEL_LEN // 2, ignore_eos=True)
    request = pb.GenerateRequest(request_id="grpc-cancel", prompt=PROMPT, sampling=sampling)
    with grpc.insecure_channel(served.harness.grpc_target) as channel:
        call = served.stub(channel).Generate(request, timeout=60)
        assert next(call).request_id == "grpc-cancel"
        call.cancel()
    served.harness.assert_no_leaks()
    # the cluster's id: the client's with a suffix of its own (router/frontend.py)
    assert [i for i in served.harness.backend.aborted if i.startswith("grpc-cancel-")]


def test_http_client_gone_during_a_non_streaming_request_aborts_it(served: Served) -> None:
    backend = served.harness.backend
    started, aborted_before = backend.num_started, set(backend.aborted)
    body = json.dumps({**CHAT_BODY, "max_tokens": MAX_MODEL_LEN // 2, "ignore_eos": True}).encode()
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
    with socket.create_connection(("127.0.0.1", served.harness.servers.http.port)) as sock:
        sock.sendall(head.encode() + b"Content-Type: application/json\r\n\r\n" + body)
        backend.wait_until(lambda b: b.num_started > started)
    served.harness.assert_no_leaks()
    [aborted] = set(backend.aborted) - aborted_before
    assert aborted.startswith("chatcmpl-")
