"""Structured outputs through the whole stack (router -> Ray prefill worker, which samples the
first token under the grammar -> NIXL -> Ray decode worker, which replays it and goes on): the
official openai client's json_schema outputs parse and validate; gRPC and refusals too.
n > 1 requests: the prompt prefilled once, its KV pulled once, the choices forked on the
decode worker. The workers speculate with a draft model (SmolLM2 drafting for itself):
requests with a grammar, penalties, logprobs or n > 1 step aside, and a plain greedy request
through the cluster is token-exact with its drafts accepted."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import openai
import pytest

from common.cluster_state import WorkerStats
from common.worker_stats import gather_stats
from engine.config import CacheConfig, EngineConfig, SpeculativeConfig
from router.pb import kvrelay_pb2 as pb
from router.pb import kvrelay_pb2_grpc as pb_grpc
from tests.integration.cluster_support import (
    NUM_BLOCKS,
    ClusterHarness,
    cluster_spec,
    greedy_output,
)

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
        # refused by the worker's compiler, named as this client sent it (the engine's name for
        # a JSON schema is response_format's)
        ({"extra_body": {"guided_json": {"$ref": "#/$defs/missing"}}}, "guided_json"),
        (
            {
                "response_format": {
                    **RESPONSE_FORMAT,
                    "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/missing"}},
                }
            },
            "response_format.json_schema.schema",
        ),
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
    # the worker's compiler refused it; the message names the gRPC field, not HTTP's
    assert info.value.details().startswith("sampling.structured.regex: "), info.value.details()


def test_draft_model_speculation_through_the_cluster_is_token_exact(stack, sampling_llm):
    """A free-text greedy request: the decode worker's draft model drafts, nearly every draft
    is accepted (it is the target model), and the text is the engine's without speculation."""
    messages = [{"role": "user", "content": "Write four lines about autumn."}]
    expected = greedy_output(sampling_llm, sampling_llm.chat_prompt(messages), MAX_TOKENS)
    kwargs = dict(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    reply = client(stack).chat.completions.create(**kwargs)
    assert reply.choices[0].message.content == expected.text
    accepted = reply.usage.model_extra["speculative_tokens_accepted"]
    assert accepted >= 0.6 * reply.usage.completion_tokens, reply.usage


# ---- n > 1: the prompt prefilled once, its KV pulled once, the choices forked on the decode
# worker ---------------------------------------------------------------------------------------
N3_MAX_TOKENS = 12


def worker_stats(stack: ClusterHarness) -> tuple[WorkerStats, WorkerStats]:
    """The (only) prefill worker's and decode worker's stats, read through their actors."""
    workers = stack.cluster.backend.workers
    (prefill,) = stack.run(gather_stats(workers.actors("prefill"))).values()
    (decode,) = stack.run(gather_stats(workers.actors("decode"))).values()
    return prefill, decode


def moves(stats: WorkerStats) -> dict[str, int]:
    return dict(stats.handoff_transitions)


def n3_texts(stack: ClusterHarness, question: str, chat: bool, stream: bool, **fields):
    """The texts of an n=3 request by choice index, and its usage."""
    api = client(stack).chat.completions if chat else client(stack).completions
    prompt = {"messages": [{"role": "user", "content": question}]} if chat else {"prompt": question}
    kwargs = dict(model=MODEL, n=3, **prompt, **fields)
    texts: dict[int, str] = {}
    if not stream:
        reply = api.create(**kwargs)
        for choice in reply.choices:
            texts[choice.index] = choice.message.content if chat else choice.text
        return texts, reply.usage
    usage = None
    for chunk in api.create(**kwargs, stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text = (choice.delta.content if chat else choice.text) or ""
            texts[choice.index] = texts.get(choice.index, "") + text
    return texts, usage


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("chat", [False, True])
def test_n3_greedy_prefills_once_pulls_once_and_gives_three_engine_outputs(
    stack, sampling_llm, chat, stream
):
    question = f"Name a river of Europe (chat={chat}, stream={stream}) and one city on it."
    if chat:
        prompt_ids = sampling_llm.chat_prompt([{"role": "user", "content": question}])
    else:
        prompt_ids = sampling_llm.engine.tokenizer.encode(question)
    want = greedy_output(sampling_llm, prompt_ids, N3_MAX_TOKENS, ignore_eos=True)
    prefill_before, decode_before = worker_stats(stack)
    texts, usage = n3_texts(
        stack, question, chat, stream, max_tokens=N3_MAX_TOKENS, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    stack.wait_until_no_leaks()
    prefill, decode = worker_stats(stack)
    assert texts == {i: want.text for i in range(3)}
    assert usage.prompt_tokens == len(prompt_ids)
    assert usage.completion_tokens == 3 * N3_MAX_TOKENS
    # Counted: the prompt computed once by the prefill worker, its blocks pulled once.
    num_prompt = prefill.num_prompt_tokens - prefill_before.num_prompt_tokens
    num_cached = prefill.num_cached_tokens - prefill_before.num_cached_tokens
    assert num_prompt == len(prompt_ids)
    computed = prefill.num_computed_tokens - prefill_before.num_computed_tokens
    assert computed == len(prompt_ids) - num_cached
    assert prefill.num_requests - prefill_before.num_requests == 1
    assert decode.num_requests - decode_before.num_requests == 1
    after, before = moves(decode), moves(decode_before)
    assert after["queued->reserved"] - before["queued->reserved"] == 1
    assert after["reading->committed"] - before["reading->committed"] == 1
    assert decode.num_transferred_blocks > decode_before.num_transferred_blocks
    assert decode.num_recomputed == decode_before.num_recomputed


def test_n3_seeded_choices_are_reproducible_and_differ(stack):
    fields = dict(max_tokens=8, temperature=1.0, seed=1234)
    first, _ = n3_texts(stack, "Invent a name for a cat.", chat=False, stream=False, **fields)
    second, _ = n3_texts(stack, "Invent a name for a cat.", chat=False, stream=True, **fields)
    assert first == second and sorted(first) == [0, 1, 2]
    assert len(set(first.values())) > 1, "choice i samples with seed + i"


def test_n3_that_ends_on_the_first_tokens_needs_no_decode(stack):
    _, decode_before = worker_stats(stack)
    reply = client(stack).completions.create(
        model=MODEL, prompt="Pick a letter:", n=3, max_tokens=1, temperature=0
    )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert {c.finish_reason for c in reply.choices} == {"length"}
    assert len({c.text for c in reply.choices}) == 1 and reply.usage.completion_tokens == 3
    stack.wait_until_no_leaks()
    assert worker_stats(stack)[1].num_requests == decode_before.num_requests


def test_grpc_n3_streams_each_choice_with_its_index(stack, sampling_llm):
    prompt_ids = sampling_llm.engine.tokenizer.encode("Three facts about owls, briefly:")
    want = greedy_output(sampling_llm, prompt_ids, N3_MAX_TOKENS, ignore_eos=True)
    sampling = pb.SamplingParams(max_tokens=N3_MAX_TOKENS, temperature=0, ignore_eos=True)
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt_ids), sampling=sampling, n=3)
    with grpc.insecure_channel(stack.grpc_target) as channel:
        responses = list(pb_grpc.KVRelayStub(channel).Generate(request, timeout=120))
    tokens: dict[int, list[int]] = {}
    for response in responses:
        tokens.setdefault(response.index, []).extend(response.token_ids)
    assert tokens == {i: want.token_ids for i in range(3)}
    assert responses[-1].HasField("usage")
