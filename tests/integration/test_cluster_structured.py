"""Structured outputs through the whole stack (router -> Ray prefill worker, which samples the
first token under the grammar -> NIXL -> Ray decode worker, which replays it and goes on): the
official openai client's json_schema outputs parse and validate; gRPC and refusals too.
The workers speculate with a draft model (SmolLM2 drafting for itself): requests with a
grammar, penalties, logprobs or n > 1 step aside, and a plain greedy request through the
cluster is token-exact with its drafts accepted."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import openai
import pytest

from engine.config import CacheConfig, EngineConfig, SpeculativeConfig
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from router.pb import kvrelay_pb2 as pb
from router.pb import kvrelay_pb2_grpc as pb_grpc
from tests.conftest import build_engine
from tests.integration.cluster_support import NUM_BLOCKS, ClusterHarness, cluster_spec

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 64
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 12},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
PROMPTS = [f"Invent person number {i} and describe them as JSON." for i in range(20)]


DRAFT = SpeculativeConfig(method="draft", draft_model="default", adaptive=False)


@pytest.fixture(scope="module")
def stack() -> Iterator[ClusterHarness]:
    engine = EngineConfig(cache=CacheConfig(num_blocks=NUM_BLOCKS), speculative=DRAFT)
    harness = ClusterHarness(cluster_spec(num_prefill=1, num_decode=1, engine=engine))
    try:
        yield harness
    finally:
        harness.stop()


@pytest.fixture(autouse=True)
def no_leaks(stack: ClusterHarness) -> Iterator[None]:
    yield
    stack.wait_until_no_leaks()


def client(stack: ClusterHarness) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)


def person(stack: ClusterHarness, prompt: str, stream: bool) -> tuple[str, str | None]:
    """The reply's text and finish reason."""
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        response_format=RESPONSE_FORMAT,
    )
    if not stream:
        choice = client(stack).chat.completions.create(**kwargs).choices[0]
        return choice.message.content or "", choice.finish_reason
    text, reason = "", None
    for chunk in client(stack).chat.completions.create(**kwargs, stream=True):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
    return text, reason


@pytest.mark.parametrize("stream", [False, True])
def test_openai_json_schema_outputs_parse_and_validate_on_20_prompts(stack, stream):
    person(stack, PROMPTS[0], stream)  # the client builds its response models lazily
    with ThreadPoolExecutor(10) as pool:
        replies = list(pool.map(lambda p: person(stack, p, stream), PROMPTS))
    for text, reason in replies:
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), PERSON)


def test_grpc_regex_and_json_object(stack):
    pattern = r"[A-Z][a-z]{1,10} is [0-9]{1,2}"
    structured = [pb.StructuredOutput(regex=pattern), pb.StructuredOutput(json_object=True)]
    with grpc.insecure_channel(stack.grpc_target) as channel:
        stub = pb_grpc.KVRelayStub(channel)
        texts = []
        for spec in structured:
            sampling = pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0, structured=spec)
            chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Who is 30?")])
            request = pb.GenerateRequest(chat=chat, sampling=sampling)
            responses = list(stub.Generate(request, timeout=120))
            assert responses[-1].finish_reason == pb.FINISH_REASON_STOP
            texts.append("".join(r.text for r in responses))
    assert re.fullmatch(pattern, texts[0])
    assert isinstance(json.loads(texts[1]), dict)


def test_vllm_guided_json_and_guided_choice_extras(stack):
    """vLLM's extras through the official client's extra_body, over the cluster."""
    choices = ["yes", "no", 'it "depends"']
    for extra in ({"guided_choice": choices}, {"guided_json": PERSON}):
        reply = client(stack).chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Is the sky blue? Describe someone."}],
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body=extra,
        )
        text = reply.choices[0].message.content or ""
        if "guided_choice" in extra:
            assert text in choices, text
        else:
            jsonschema.validate(json.loads(text), PERSON)


def post(stack: ClusterHarness, body: dict) -> tuple[int, dict]:
    messages = [{"role": "user", "content": "hi"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 4, **body}
    try:
        reply = client(stack).chat.completions.with_raw_response.create(**body)
        return reply.status_code, json.loads(reply.text)
    except openai.APIStatusError as e:
        return e.status_code, e.response.json()


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        # refused by the router (JSON Schema's meta-schema, Python's regex syntax)
        (
            {
                "response_format": {
                    **RESPONSE_FORMAT,
                    "json_schema": {"name": "x", "schema": {"type": 3}},
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"extra_body": {"guided_regex": "(["}}, "guided_regex"),
        # refused by the prefill worker's grammar compiler
        ({"extra_body": {"guided_regex": "(?<=a)b"}}, "guided_regex"),
        ({"extra_body": {"guided_grammar": "root ::= nowhere"}}, "guided_grammar"),
        ({"extra_body": {"guided_json": {"type": "objekt"}}}, "guided_json"),
    ],
)
def test_bad_specs_are_400_naming_the_field(stack, fields, param):
    status, reply = post(stack, fields)
    assert status == 400 and reply["error"]["param"] == param, reply


def test_bad_grpc_spec_is_invalid_argument(stack):
    sampling = pb.SamplingParams(max_tokens=4, structured=pb.StructuredOutput(regex="(?<=a)b"))
    request = pb.GenerateRequest(prompt="hi", sampling=sampling)
    with grpc.insecure_channel(stack.grpc_target) as channel, pytest.raises(grpc.RpcError) as info:
        list(pb_grpc.KVRelayStub(channel).Generate(request, timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "regex" in info.value.details()


def test_draft_model_speculation_through_the_cluster_is_token_exact(stack, smollm_model):
    """A free-text greedy request: the decode worker's draft model drafts, nearly every draft
    is accepted (it is the target model), and the text is the engine's without speculation."""
    messages = [{"role": "user", "content": "Write four lines about autumn."}]
    llm = LLM(engine=build_engine(smollm_model))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    expected = llm.generate([llm.chat_prompt(messages)], params)[0]
    kwargs = dict(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    reply = client(stack).chat.completions.create(**kwargs)
    assert reply.choices[0].message.content == expected.text
    accepted = reply.usage.model_extra["speculative_tokens_accepted"]
    assert accepted >= 0.6 * reply.usage.completion_tokens, reply.usage
