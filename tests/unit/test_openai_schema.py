"""OpenAI request bodies -> RequestSpec, and their refusals (no model, no server)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from router.errors import InvalidRequest
from router.frontend import ChatMessage
from router.openai_schema import ChatCompletionRequest, CompletionRequest, invalid_from_validation

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def parse_error(schema: type, body: dict | bytes) -> InvalidRequest:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(ValidationError) as info:
        schema.model_validate_json(raw)
    return invalid_from_validation(info.value)


def test_chat_body_maps_to_a_spec() -> None:
    body = {
        **CHAT,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}],
        "max_completion_tokens": 5,
        "max_tokens": 9,
        "stop": "x",
        "top_k": -1,
        "seed": 3,
        "cache_salt": "tenant",
    }
    spec = ChatCompletionRequest.model_validate_json(json.dumps(body)).to_spec()
    assert spec.messages == (ChatMessage("user", "a"),)
    assert (spec.max_tokens, spec.sampling.stop, spec.sampling.top_k, spec.sampling.seed) == (
        5, ("x",), 0, 3,
    )  # fmt: skip
    assert (spec.id_prefix, spec.cache_salt) == ("chatcmpl", "tenant")
    assert spec.sampling.temperature == 1.0
    assert spec.req_id is None  # no client id over HTTP: the router makes one


def test_completion_prompt_forms() -> None:
    for prompt, text, ids in [("a", "a", None), ([1, 2], None, (1, 2)), (["b"], "b", None)]:
        spec = CompletionRequest(model="m", prompt=prompt).to_spec()
        assert (spec.prompt, spec.prompt_token_ids) == (text, ids)
    with pytest.raises(InvalidRequest, match="one prompt"):
        CompletionRequest(model="m", prompt=["a", "b"]).to_spec()


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({**CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
        ({**CHAT, "structured_outputs": {"json": {"type": "object"}}}, "structured_outputs"),
        ({**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({**CHAT, "tool_choice": "auto"}, "tool_choice"),
        ({**CHAT, "include_stop_str_in_output": True}, "include_stop_str_in_output"),
        ({**CHAT, "chat_template_kwargs": {"enable_thinking": True}}, "chat_template_kwargs"),
    ],
)
def test_unsupported_options_are_refused(body: dict, param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        ChatCompletionRequest.model_validate_json(json.dumps(body)).to_spec()
    assert info.value.param == param


def test_validation_errors_name_the_field() -> None:
    assert parse_error(ChatCompletionRequest, b"{not json").code == "invalid_json"
    assert parse_error(ChatCompletionRequest, {"model": "m"}).param == "messages"
    assert parse_error(ChatCompletionRequest, {**CHAT, "max_tokens": "5"}).param == "max_tokens"
    assert parse_error(ChatCompletionRequest, {**CHAT, "messages": []}).param == "messages"
    error = parse_error(ChatCompletionRequest, {**CHAT, "messages": [{"content": "x"}]})
    assert error.param == "messages.0.role" and "Field required" in error.message
    error = parse_error(CompletionRequest, {"model": "m", "prompt": 5})
    assert error.param == "prompt" and "str or list[int]" in error.message, error.message
    error = parse_error(ChatCompletionRequest, {**CHAT, "messages": [{"role": "u", "content": 1}]})
    assert error.param == "messages.0.content", error.message


@pytest.mark.parametrize(
    ("body", "param", "said"),
    [
        ({**CHAT, "max_tokns": 5}, "max_tokns", "field max_tokns (did you mean 'max_tokens'?)"),
        ({**CHAT, "temprature": 0}, "temprature", "did you mean 'temperature'?"),
        ({**CHAT, "foo": 1}, "foo", "unrecognized request field foo;"),
        ({**CHAT, "": 1}, '""', 'unrecognized request field "";'),
        ({**CHAT, "stream": True, "stream_options": {"foo": 1}}, "stream_options.foo", "Extra"),
        ({**CHAT, "kv_retention": [{"start": 0, "priority": 9, "ttl": 1}]}, "kv_retention.0.ttl",
         "Extra"),
    ],
)  # fmt: skip
def test_an_unknown_or_misspelt_field_is_refused_naming_it(body: dict, param: str, said: str):
    """A misspelt field was ignored (`max_tokns`: the request ran to the context's end)."""
    try:
        ChatCompletionRequest.model_validate_json(json.dumps(body)).to_spec()
    except ValidationError as e:
        error = invalid_from_validation(e)
    except InvalidRequest as e:
        error = e
    else:
        raise AssertionError(f"{body} was taken")
    assert error.param == param and said in error.message, error.message


@pytest.mark.parametrize(
    "extra",
    [
        {"response_format": {"type": "text"}},
        {"tools": [], "tool_choice": "none", "logit_bias": {}},
        {"user": "u", "metadata": {"k": "v"}, "store": False, "service_tier": "auto"},
    ],
)
def test_fields_that_change_nothing_pass(extra: dict) -> None:
    """OpenAI's fields that change no output are taken and ignored."""
    spec = ChatCompletionRequest.model_validate_json(json.dumps({**CHAT, **extra})).to_spec()
    assert spec.messages == (ChatMessage("user", "hi"),)


def test_sampling_fields_map_to_the_spec() -> None:
    body = {
        **CHAT,
        "presence_penalty": 0.5,
        "frequency_penalty": -1,
        "repetition_penalty": 1.2,
        "logit_bias": {"7": 1, "9": -100},
        "logprobs": True,
        "top_logprobs": 3,
    }
    spec = ChatCompletionRequest.model_validate_json(json.dumps(body)).to_spec().sampling
    assert (spec.presence_penalty, spec.frequency_penalty, spec.repetition_penalty) == (
        0.5, -1.0, 1.2,
    )  # fmt: skip
    assert spec.logit_bias == ((7, 1.0), (9, -100.0))
    assert (spec.logprobs, spec.top_logprobs) == (True, 3)
    plain = ChatCompletionRequest.model_validate_json(json.dumps(CHAT)).to_spec().sampling
    assert (plain.presence_penalty, plain.repetition_penalty, plain.logit_bias) == (0, 1, ())


def test_completion_logprobs_n_is_top_logprobs() -> None:
    spec = CompletionRequest(model="m", prompt="a", logprobs=2).to_spec().sampling
    assert (spec.logprobs, spec.top_logprobs) == (True, 2)
    spec = CompletionRequest(model="m", prompt="a", logprobs=0).to_spec().sampling
    assert (spec.logprobs, spec.top_logprobs) == (True, 0)
    assert CompletionRequest(model="m", prompt="a", echo=True).to_spec().prompt == "a"
    assert CompletionRequest(model="m", prompt=["b"], echo=True).prompt_text() == "b"


def test_bad_sampling_values_name_the_field() -> None:
    with pytest.raises(InvalidRequest) as info:
        CompletionRequest(model="m", prompt="a", echo=True, logprobs=1).to_spec()
    assert info.value.param == "echo"
    with pytest.raises(InvalidRequest) as info:
        ChatCompletionRequest(**CHAT, logit_bias={"x": 1.0}).to_spec()
    assert info.value.param == "logit_bias"
    assert parse_error(CompletionRequest, {"model": "m", "prompt": "a", "logprobs": 21}).param == (
        "logprobs"
    )
    assert parse_error(ChatCompletionRequest, {**CHAT, "top_logprobs": 21}).param == (
        "top_logprobs"
    )
    assert parse_error(ChatCompletionRequest, {**CHAT, "logit_bias": {"1": "a"}}).param == (
        "logit_bias.1"
    )
