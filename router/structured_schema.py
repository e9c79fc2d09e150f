"""Structured-output request fields (OpenAI's response_format, vLLM's guided_json,
guided_choice, guided_regex and guided_grammar, the gRPC StructuredOutput) turned into one
StructuredOutput; stateless.

The router checks what it can without the engine (a JSON schema against the JSON Schema
meta-schema, a regex's syntax); the engine's grammar compiler has the last word.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal, NamedTuple

import jsonschema
from pydantic import BaseModel, ConfigDict, Field

from engine.sampling.sampling_params import StructuredOutput
from router.errors import InvalidRequest


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class JsonSchemaFormat(_Body):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the schema is always enforced


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredFields(NamedTuple):
    """A body's structured-output fields: OpenAI's response_format, vLLM's guided_*."""

    response_format: ResponseFormat | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_choice: list[str] | None = None

    def output(self) -> StructuredOutput | None:
        """The one grammar the fields ask for (None: free text); InvalidRequest naming the
        field for a bad spec or for more than one of them."""
        given = {
            "response_format": _from_response_format(self.response_format),
            "guided_json": _from_guided_json(self.guided_json),
            "guided_choice": _from_guided_choice(self.guided_choice),
            "guided_regex": _spec_of("regex", self.guided_regex),
            "guided_grammar": _spec_of("grammar", self.guided_grammar),
        }
        asked = {name: spec for name, spec in given.items() if spec is not None}
        if len(asked) > 1:
            raise InvalidRequest(
                f"give at most one of {', '.join(asked)} (each constrains the whole output)",
                next(iter(asked)),
            )
        if not asked:
            return None
        name, spec = next(iter(asked.items()))
        check_spec(spec, None if name == "response_format" else name)
        return spec

    def param(self) -> str | None:
        """The field a (checked) structured output came from, to name in a worker's refusal."""
        response_format = self.response_format
        if response_format is not None and response_format.type == "json_schema":
            return "response_format.json_schema.schema"
        if response_format is not None and response_format.type == "json_object":
            return "response_format"
        names = ("guided_json", "guided_choice", "guided_regex", "guided_grammar")
        return next((name for name in names if getattr(self, name) is not None), None)


def _spec_of(kind: str, spec: str | None) -> StructuredOutput | None:
    return None if spec is None else StructuredOutput(kind, spec)


def _from_guided_json(guided_json: dict[str, Any] | str | None) -> StructuredOutput | None:
    """vLLM's guided_json: a JSON schema, as an object or as JSON text."""
    if guided_json is None:
        return None
    text = guided_json if isinstance(guided_json, str) else json.dumps(guided_json)
    return StructuredOutput("json_schema", text)


def _from_guided_choice(choices: list[str] | None) -> StructuredOutput | None:
    """vLLM's guided_choice: the output is exactly one of the strings (an EBNF alternation of
    string literals, so no character of a choice needs regex escaping)."""
    if choices is None:
        return None
    if not choices or any(not c for c in choices):
        raise InvalidRequest("guided_choice must be a list of non-empty strings", "guided_choice")
    return StructuredOutput("grammar", "root ::= " + " | ".join(map(_ebnf_literal, choices)))


def _ebnf_literal(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    escaped = escaped.replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")
    return f'"{escaped}"'


def _from_response_format(response_format: ResponseFormat | None) -> StructuredOutput | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return StructuredOutput("json_object")
    json_schema = response_format.json_schema
    if json_schema is None or json_schema.schema_ is None:
        raise InvalidRequest(
            "response_format.json_schema.schema is required with type json_schema",
            "response_format.json_schema.schema",
        )
    return StructuredOutput("json_schema", json.dumps(json_schema.schema_))


_PARAMS = {
    "json_schema": "response_format.json_schema.schema",
    "regex": "guided_regex",
    "grammar": "guided_grammar",
}


def check_spec(spec: StructuredOutput, param: str | None = None) -> None:
    """What the router can check of a spec; param: the field to name (default: HTTP's)."""
    param = param or _PARAMS.get(spec.kind, "response_format")
    try:
        _check_spec(spec, param)
    except RecursionError:  # ~100 levels: the JSON parser and the checkers recurse per level
        raise InvalidRequest(f"{param}: nested too deeply", param) from None


def _check_spec(spec: StructuredOutput, param: str) -> None:
    if spec.kind == "json_schema":
        try:
            schema = json.loads(spec.spec)
        except ValueError as e:
            raise InvalidRequest(f"{param}: the schema is not valid JSON ({e})", param) from None
        if not isinstance(schema, dict):
            raise InvalidRequest(f"{param}: the schema must be a JSON object", param)
        try:
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except jsonschema.SchemaError as e:
            raise InvalidRequest(f"{param}: not a valid JSON schema: {e.message}", param) from None
    elif spec.kind == "regex":
        try:
            re.compile(spec.spec)
        except re.error as e:
            raise InvalidRequest(f"{param}: not a valid regex: {e}", param) from None
    if spec.kind != "json_object" and not spec.spec.strip():
        raise InvalidRequest(f"{param} must not be empty", param)


def structured_from_proto(message: Any) -> StructuredOutput | None:
    """A gRPC SamplingParams.structured (kvrelay.v1.StructuredOutput) as a StructuredOutput;
    unset: None. InvalidRequest names `sampling.structured.<kind>`."""
    kind = message.WhichOneof("kind")
    if kind is None or (kind == "json_object" and not message.json_object):
        return None
    spec = (
        StructuredOutput(kind)
        if kind == "json_object"
        else StructuredOutput(kind, getattr(message, kind))
    )
    check_spec(spec, f"sampling.structured.{kind}")
    return spec
