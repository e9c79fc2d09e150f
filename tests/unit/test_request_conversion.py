"""Both front ends convert a request's sampling fields straight into SamplingParams (one
conversion each: router/openai_schema.py, router/grpc_server.py): every field arrives, an unset
one takes SamplingParams' default, and max_tokens is the client's only where it set one."""

from __future__ import annotations

from dataclasses import fields

import pytest

from engine.sampling.sampling_params import SamplingParams, StructuredOutput
from router.errors import InvalidRequest
from router.grpc_server import sampling_from_proto, spec_from_proto
from router.openai_schema import ChatCompletionRequest, CompletionRequest
from router.pb import kvrelay_pb2 as pb
from router.traffic_class import KeyClass, TrafficClass, request_priority

# Every sampling field set to something other than its default.
EVERY_FIELD = SamplingParams(
    max_tokens=7,
    temperature=0.5,
    top_k=4,
    top_p=0.75,
    min_p=0.125,
    seed=11,
    n=3,
    stop=("end",),
    stop_token_ids=(2, 5),
    ignore_eos=True,
    logprobs=True,
    top_logprobs=2,
    presence_penalty=0.5,
    frequency_penalty=-0.5,
    repetition_penalty=1.25,
    logit_bias=((3, 1.5), (9, -100.0)),
    structured=StructuredOutput("regex", "[0-9]+"),
    speculative=False,
)


def test_every_sampling_field_is_set_in_the_example() -> None:
    defaults = SamplingParams()
    assert not [
        f.name
        for f in fields(SamplingParams)
        if getattr(EVERY_FIELD, f.name) == getattr(defaults, f.name)
    ]


def test_the_proto_converts_every_field() -> None:
    message = pb.SamplingParams(
        max_tokens=7,
        temperature=0.5,
        top_k=4,
        top_p=0.75,
        min_p=0.125,
        seed=11,
        stop=["end"],
        stop_token_ids=[2, 5],
        ignore_eos=True,
        logprobs=True,
        top_logprobs=2,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.25,
        logit_bias={9: -100.0, 3: 1.5},
        speculative=False,
        structured=pb.StructuredOutput(regex="[0-9]+"),
    )
    assert sampling_from_proto(message, n=3) == EVERY_FIELD
    request = pb.GenerateRequest(prompt="p", sampling=message, n=3)
    spec = spec_from_proto(request)
    assert (spec.sampling, spec.max_tokens, spec.max_tokens_param) == (EVERY_FIELD, 7, "max_tokens")


def test_an_unset_proto_field_takes_the_default() -> None:
    assert sampling_from_proto(pb.SamplingParams()) == SamplingParams()
    spec = spec_from_proto(pb.GenerateRequest(prompt="p", n=0))
    assert (spec.sampling, spec.max_tokens, spec.max_tokens_param) == (SamplingParams(), None, None)


def test_the_proto_mirrors_sampling_params() -> None:
    """A SamplingParams field the gRPC API cannot set is a decision, not an oversight (n is
    GenerateRequest's own field)."""
    proto_names = {f.name for f in pb.SamplingParams.DESCRIPTOR.fields}
    assert {f.name for f in fields(SamplingParams)} - proto_names == {"n"}


def test_openai_bodies_convert_every_field() -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 7,
        "temperature": 0.5,
        "top_k": 4,
        "top_p": 0.75,
        "min_p": 0.125,
        "seed": 11,
        "n": 3,
        "stop": ["end"],
        "stop_token_ids": [2, 5],
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 2,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.25,
        "logit_bias": {"3": 1.5, "9": -100},
        "guided_regex": "[0-9]+",
        "speculative": False,
    }
    spec = ChatCompletionRequest.model_validate(body).to_spec()
    assert (spec.sampling, spec.max_tokens_param) == (EVERY_FIELD, "max_completion_tokens")
    completion = {k: v for k, v in body.items() if k not in ("messages", "top_logprobs")}
    completion |= {"prompt": "p", "max_tokens": 7, "logprobs": 2}
    del completion["max_completion_tokens"]
    spec = CompletionRequest.model_validate(completion).to_spec()
    assert (spec.sampling, spec.max_tokens_param) == (EVERY_FIELD, "max_tokens")


def test_an_unset_openai_field_takes_the_default() -> None:
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    spec = chat.to_spec()
    assert (spec.sampling, spec.max_tokens, spec.max_tokens_param) == (SamplingParams(), None, None)
    spec = CompletionRequest(model="m", prompt="p", top_k=-1).to_spec()
    assert (spec.sampling, spec.max_tokens) == (SamplingParams(), None)
    assert sampling_from_proto(pb.SamplingParams(top_k=-1)) == SamplingParams()  # as HTTP
    assert sampling_from_proto(pb.SamplingParams(top_k=-2)).top_k == -2  # refused by the rules


def test_priority_and_deadline_reach_the_spec_from_both_front_ends() -> None:
    spec = spec_from_proto(pb.GenerateRequest(prompt="p", priority=-7, deadline_s=30.0))
    assert (spec.priority, spec.deadline_s) == (-7, 30.0)
    unset = spec_from_proto(pb.GenerateRequest(prompt="p"))
    assert (unset.priority, unset.deadline_s) == (None, None)
    body = {"model": "m", "prompt": "p", "priority": 3, "deadline_s": 2.5}
    http = CompletionRequest.model_validate(body).to_spec()
    assert (http.priority, http.deadline_s) == (3, 2.5)


def test_a_key_class_caps_priority_and_the_range_is_checked() -> None:
    batch = KeyClass(TrafficClass.BATCH)
    assert [request_priority(batch, p) for p in (None, 50, -5)] == [-1, -1, -5]
    assert [request_priority(KeyClass(), p) for p in (None, 50, -5)] == [0, 50, -5]
    with pytest.raises(InvalidRequest) as info:
        request_priority(KeyClass(), 1000)
    assert info.value.param == "priority"
