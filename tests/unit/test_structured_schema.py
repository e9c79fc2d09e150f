"""Structured-output request fields: OpenAI's response_format, vLLM's guided_json,
guided_choice, guided_regex and guided_grammar, the gRPC StructuredOutput, and what stays
refused; torch-free."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from engine.sampling.sampling_params import SamplingParams, StructuredOutput
from engine.sampling.validation import InvalidField, check_structured
from router.errors import InvalidRequest
from router.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    invalid_from_validation,
)
from router.pb import kvrelay_pb2 as pb
from router.structured_schema import structured_from_proto

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def nested(depth: int) -> dict:
    """An object schema `depth` levels deep."""
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def chat_sampling(**fields: object):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return ChatCompletionRequest.model_validate(body).to_spec().sampling


def refusal(**fields: object) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as refused:
        chat_sampling(**fields)
    return refused.value


def test_text_or_no_response_format_is_free_text():
    assert chat_sampling().structured is None
    assert chat_sampling(response_format={"type": "text"}).structured is None


def test_json_object_and_json_schema():
    spec = chat_sampling(response_format={"type": "json_object"}).structured
    assert spec == StructuredOutput("json_object")
    body = {"name": "thing", "schema": SCHEMA, "strict": True}
    spec = chat_sampling(response_format={"type": "json_schema", "json_schema": body}).structured
    assert spec is not None and spec.kind == "json_schema"
    assert json.loads(spec.spec) == SCHEMA


def test_completions_take_the_same_fields():
    body = {"model": "m", "prompt": "x", "guided_regex": "[0-9]+"}
    spec = CompletionRequest.model_validate(body).to_spec().sampling.structured
    assert spec == StructuredOutput("regex", "[0-9]+")


def test_regex_and_grammar_extras():
    assert chat_sampling(guided_regex="a|b").structured == StructuredOutput("regex", "a|b")
    grammar = 'root ::= "x"'
    assert chat_sampling(guided_grammar=grammar).structured == StructuredOutput("grammar", grammar)


def test_guided_json_and_guided_choice_extras():
    as_object = chat_sampling(guided_json=SCHEMA).structured
    assert as_object is not None and as_object.kind == "json_schema"
    assert json.loads(as_object.spec) == SCHEMA
    as_text = chat_sampling(guided_json=json.dumps(SCHEMA)).structured
    assert as_text == StructuredOutput("json_schema", json.dumps(SCHEMA))
    choice = chat_sampling(guided_choice=["yes", 'say "no"', "a\\b\nc"]).structured
    assert choice == StructuredOutput("grammar", 'root ::= "yes" | "say \\"no\\"" | "a\\\\b\\nc"')
    assert choice is not None
    check_structured(SamplingParams(structured=choice))  # xgrammar compiles it


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"guided_json": {"type": "objekt"}}, "guided_json"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_choice": ["a", ""]}, "guided_choice"),
        ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema.schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "objekt"}},
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"guided_regex": "(["}, "guided_regex"),
        ({"guided_json": nested(200)}, "guided_json"),  # a RecursionError gave HTTP 500
        ({"guided_json": "[" * 100_000}, "guided_json"),  # in the JSON parser
        ({"guided_regex": "(" * 2000 + ")" * 2000}, "guided_regex"),
        ({"guided_regex": ""}, "guided_regex"),
        ({"guided_grammar": "  "}, "guided_grammar"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_bad_specs_are_refused_naming_the_field(fields, param):
    assert refusal(**fields).param == param


@pytest.mark.parametrize(
    "fields",
    [
        {"structured_outputs": {"regex": "a"}},
        {"guided_decoding_backend": "outlines"},
    ],
)
def test_what_is_not_built_stays_refused(fields):
    assert refusal(**fields).param == next(iter(fields))


def test_an_unknown_response_format_type_names_it():
    body = {"model": "m", "messages": [], "response_format": {"type": "xml"}}
    body["messages"] = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValidationError) as error:
        ChatCompletionRequest.model_validate(body)
    assert invalid_from_validation(error.value).param == "response_format.type"


def test_grpc_structured_output():
    def spec(**kind: object) -> StructuredOutput | None:
        return structured_from_proto(pb.StructuredOutput(**kind))

    assert spec() is None
    assert spec(json_object=True) == StructuredOutput("json_object")
    assert spec(json_schema=json.dumps(SCHEMA)) == StructuredOutput(
        "json_schema", json.dumps(SCHEMA)
    )
    assert spec(regex="a+") == StructuredOutput("regex", "a+")
    assert spec(grammar='root ::= "a"') == StructuredOutput("grammar", 'root ::= "a"')
    with pytest.raises(InvalidRequest) as refused:
        spec(json_schema="[1, 2]")
    assert refused.value.param == "sampling.structured.json_schema"


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (StructuredOutput("xml", "x"), "response_format"),
        (StructuredOutput("regex", ""), "guided_regex"),
        (StructuredOutput("json_schema", "{not json"), "response_format"),
        (StructuredOutput("json_schema", "[]"), "response_format"),
    ],
)
def test_the_engine_rules_refuse_malformed_specs(spec, field):
    with pytest.raises(InvalidField) as refused:
        check_structured(SamplingParams(structured=spec))
    assert refused.value.field == field
