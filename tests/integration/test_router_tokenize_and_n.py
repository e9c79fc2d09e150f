"""The router's /tokenize, /detokenize (HTTP and gRPC) and n > 1 choices on real servers over a
real SmolLM2 engine."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from router.pb import kvrelay_pb2 as pb
from router.pb import kvrelay_pb2_grpc as pb_grpc
from router.tokenizer import RouterTokenizer
from tests.conftest import build_engine
from tests.server_harness import ServerHarness, post, post_with_headers, serving

MAX_MODEL_LEN = 256
CHAT = [{"role": "user", "content": "Name three rivers."}]
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def harness(smollm_model, smollm_dir) -> Iterator[ServerHarness]:
    engine = build_engine(smollm_model, num_blocks=64, max_model_len=MAX_MODEL_LEN)
    with serving(engine, smollm_dir) as harness:
        yield harness


@pytest.fixture(scope="module")
def router_tokenizer(smollm_dir) -> RouterTokenizer:
    return RouterTokenizer(smollm_dir)


@pytest.fixture(autouse=True)
def no_leaks(harness: ServerHarness) -> Iterator[None]:
    yield
    harness.assert_no_leaks()


# ---- /tokenize, /detokenize ---------------------------------------------------------------
def test_tokenize_a_prompt_and_a_chat_as_generation_sees_them(
    harness: ServerHarness, router_tokenizer: RouterTokenizer
) -> None:
    status, reply = post(harness, "/tokenize", {"prompt": PROMPT})
    assert status == 200, reply
    assert reply["tokens"] == router_tokenizer.encode(PROMPT)
    assert reply["count"] == len(reply["tokens"]) and reply["max_model_len"] == MAX_MODEL_LEN

    status, reply = post(harness, "/tokenize", {"model": harness.engine.model_id, "messages": CHAT})
    assert status == 200, reply
    assert reply["tokens"] == router_tokenizer.apply_chat_template(CHAT)
    # The chat's count is the prompt_tokens a chat completion reports for it.
    status, completion = post(
        harness, "/v1/chat/completions", {"model": "m", "messages": CHAT, "max_tokens": 1}
    )
    assert status == 400  # "m" is not the served model: the same check as /tokenize's
    body = {"model": harness.engine.model_id, "messages": CHAT, "max_tokens": 1}
    status, completion = post(harness, "/v1/chat/completions", body)
    assert completion["usage"]["prompt_tokens"] == reply["count"]


def test_tokenize_a_chat_without_the_generation_prompt(
    harness: ServerHarness, router_tokenizer: RouterTokenizer
) -> None:
    status, reply = post(harness, "/tokenize", {"messages": CHAT, "add_generation_prompt": False})
    assert status == 200, reply
    text = router_tokenizer.render_chat(CHAT, add_generation_prompt=False)
    assert reply["tokens"] == router_tokenizer.encode(text, add_special_tokens=False)
    assert reply["tokens"] != router_tokenizer.apply_chat_template(CHAT)  # it was ignored


def test_a_chat_history_as_an_sdk_sends_it_back_and_no_model(harness: ServerHarness) -> None:
    """An assistant reply appended as the SDK returned it (refusal, annotations, null
    tool_calls) is taken; a name goes to the template; `model` left out serves the model."""
    reply = {"role": "assistant", "content": "The Nile.", "refusal": None, "tool_calls": None}
    history = [
        *CHAT,
        {**reply, "annotations": []},
        {"role": "user", "content": "More", "name": "a"},
    ]
    status, body = post(harness, "/v1/chat/completions", {"messages": history, "max_tokens": 1})
    assert status == 200 and body["model"] == harness.engine.model_id, body


def test_a_model_is_retrieved_and_refusals_have_openais_shape(harness: ServerHarness) -> None:
    model = harness.engine.model_id
    status, _, card = post_with_headers(harness, f"/v1/models/{model}", None, "GET")
    assert status == 200 and card["id"] == model and card["object"] == "model", card
    status, _, reply = post_with_headers(harness, "/v1/models/gpt-9", None, "GET")
    assert status == 404 and reply["error"]["param"] == "model", reply
    status, headers, reply = post_with_headers(harness, "/v1/chat/completions", None, "GET")
    assert status == 405 and "POST" in headers["Allow"], headers
    assert reply["error"]["code"] == "method_not_allowed", reply  # a string, as OpenAI's
    status, _, reply = post_with_headers(harness, "/v2/nothing", None, "GET")
    assert status == 404 and reply["error"]["code"] == "not_found", reply


def test_detokenize_round_trips_tokenize(harness: ServerHarness) -> None:
    status, tokens = post(harness, "/tokenize", {"messages": CHAT})
    assert status == 200
    status, reply = post(harness, "/detokenize", {"tokens": tokens["tokens"]})
    assert status == 200, reply
    again = post(harness, "/tokenize", {"prompt": reply["prompt"], "add_special_tokens": False})
    assert again[1]["tokens"] == tokens["tokens"]
    assert "Name three rivers." in reply["prompt"]


BAD_TOKENIZE = [
    ("/tokenize", {}, "prompt", "exactly one of a prompt or chat messages"),
    ("/tokenize", {"prompt": "a", "messages": CHAT}, "prompt", "exactly one"),
    ("/tokenize", {"prompt": 5}, "prompt", "prompt"),
    ("/tokenize", {"messages": []}, "messages", "must not be empty"),
    ("/tokenize", {"prompt": "a", "model": "gpt-9"}, "model", "not served"),
    ("/tokenize", b"{not json", None, "not valid JSON"),
    ("/tokenize", {"prompt": "a", "add_generation_promt": False}, "add_generation_promt", ""),
    ("/tokenize", {"messages": [{"role": "bogus", "content": "a"}]}, "messages.0.role", "one of"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "robot", "content": "a"}]},
        "messages.0.role",
        "one of",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": None}]},
        "messages.0.content",
        "needs content",
    ),
    (
        "/v1/chat/completions",
        {"messages": [*CHAT, {"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}]},
        "messages.1.tool_calls",
        "not supported",
    ),
    ("/detokenize", {"tokens": [1, -1]}, "tokens", "not a token id"),
    ("/detokenize", {"tokens": [10**9]}, "tokens", "not a token id"),
    ("/detokenize", {"tokens": "abc"}, "tokens", "tokens"),
    ("/detokenize", {"tokens": [1], "model": "gpt-9"}, "model", "not served"),
]


@pytest.mark.parametrize(("path", "body", "param", "message"), BAD_TOKENIZE)
def test_bad_tokenize_input_is_400_naming_the_field(
    harness: ServerHarness, path: str, body: bytes | dict, param: str | None, message: str
) -> None:
    status, reply = post(harness, path, body)
    assert status == 400, reply
    error = reply["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert message in error["message"], error


def test_grpc_tokenize_and_detokenize(
    harness: ServerHarness, router_tokenizer: RouterTokenizer
) -> None:
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=CHAT[0]["content"])])
    with grpc.insecure_channel(harness.grpc_target) as channel:
        stub = pb_grpc.KVRelayStub(channel)
        reply = stub.Tokenize(pb.TokenizeRequest(prompt=PROMPT), timeout=30)
        assert list(reply.tokens) == router_tokenizer.encode(PROMPT)
        assert reply.count == len(reply.tokens) and reply.max_model_len == MAX_MODEL_LEN
        no_special = pb.TokenizeRequest(prompt=PROMPT, add_special_tokens=False)
        assert list(stub.Tokenize(no_special, timeout=30).tokens) == router_tokenizer.encode(
            PROMPT, add_special_tokens=False
        )
        reply = stub.Tokenize(pb.TokenizeRequest(chat=chat), timeout=30)
        assert list(reply.tokens) == router_tokenizer.apply_chat_template(CHAT)
        text = stub.Detokenize(pb.DetokenizeRequest(tokens=reply.tokens), timeout=30).prompt
        assert text == router_tokenizer.decode(reply.tokens, skip_special_tokens=False)
        for bad, field in [
            (pb.TokenizeRequest(), "prompt"),
            (pb.TokenizeRequest(model="gpt-9", prompt="a"), "not served"),
        ]:
            with pytest.raises(grpc.RpcError) as info:
                stub.Tokenize(bad, timeout=30)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert field in info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            stub.Detokenize(pb.DetokenizeRequest(tokens=[-5]), timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "tokens" in info.value.details()
