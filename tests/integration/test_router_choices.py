"""n > 1 through the router's HTTP (official openai client) and gRPC front ends over a real
SmolLM2 engine: choices 0..n-1 with their own finish, the prompt computed once (counted)."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import openai
import pytest

from router.pb import kvrelay_pb2 as pb
from router.pb import kvrelay_pb2_grpc as pb_grpc
from tests.conftest import build_engine
from tests.server_harness import ServerHarness, serving

PROMPT = "The three largest rivers of Europe are"
CHAT = [{"role": "user", "content": "Name three rivers."}]
MAX_TOKENS = 6
GREEDY = {"temperature": 0, "max_tokens": MAX_TOKENS, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def harness(smollm_model, smollm_dir) -> Iterator[ServerHarness]:
    engine = build_engine(smollm_model, num_blocks=64, max_model_len=256)
    with serving(engine, smollm_dir) as harness:
        yield harness


@pytest.fixture(autouse=True)
def no_leaks(harness: ServerHarness) -> Iterator[None]:
    yield
    harness.assert_no_leaks()


@pytest.fixture
def client(harness: ServerHarness) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{harness.base_url}/v1", api_key="unused", max_retries=0)


def computed_tokens(harness: ServerHarness, evict: bool = False) -> int:
    """The engine's computed-token count (evict: first empty its prefix cache)."""

    def read(engine) -> int:
        if evict:
            engine.kv.pool.evict_all_cached()
        return engine.stats.num_computed_tokens

    return harness.run(harness.backend.call(read))


def test_greedy_completion_choices_are_the_single_output_and_the_prompt_is_computed_once(
    harness: ServerHarness, client: openai.OpenAI
) -> None:
    model = harness.engine.model_id
    single = client.completions.create(model=model, prompt=PROMPT, **GREEDY)
    before = computed_tokens(harness, evict=True)
    reply = client.completions.create(model=model, prompt=PROMPT, n=3, **GREEDY)
    computed = computed_tokens(harness) - before
    num_prompt = reply.usage.prompt_tokens
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert {c.text for c in reply.choices} == {single.choices[0].text}
    assert {c.finish_reason for c in reply.choices} == {"length"}
    # The prompt once, then each choice's decodes (its first token came from the prompt).
    assert computed == num_prompt + 3 * (MAX_TOKENS - 1)
    assert reply.usage.completion_tokens == 3 * MAX_TOKENS
    assert num_prompt == single.usage.prompt_tokens


def test_greedy_chat_choices_with_logprobs_each(
    harness: ServerHarness, client: openai.OpenAI
) -> None:
    model = harness.engine.model_id
    single = client.chat.completions.create(model=model, messages=CHAT, logprobs=True, **GREEDY)
    reply = client.chat.completions.create(
        model=model, messages=CHAT, n=3, logprobs=True, top_logprobs=2, **GREEDY
    )
    want = single.choices[0]
    assert [c.index for c in reply.choices] == [0, 1, 2]
    for choice in reply.choices:
        assert choice.message.content == want.message.content
        assert choice.finish_reason == "length"
        assert len(choice.logprobs.content) == MAX_TOKENS
        assert [e.token for e in choice.logprobs.content] == [
            e.token for e in want.logprobs.content
        ]
        assert all(len(e.top_logprobs) == 2 for e in choice.logprobs.content)
    assert reply.usage.completion_tokens == 3 * MAX_TOKENS


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_choices_name_their_index_and_end_on_their_own(
    harness: ServerHarness, client: openai.OpenAI, chat: bool
) -> None:
    model = harness.engine.model_id
    options = {**GREEDY, "n": 3, "stream": True, "stream_options": {"include_usage": True}}
    if chat:
        stream = client.chat.completions.create(model=model, messages=CHAT, **options)
        single = client.chat.completions.create(model=model, messages=CHAT, **GREEDY)
        want = single.choices[0].message.content
    else:
        stream = client.completions.create(model=model, prompt=PROMPT, **options)
        want = client.completions.create(model=model, prompt=PROMPT, **GREEDY).choices[0].text
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            assert choice.index not in finish, "a choice's chunk after its finish"
            piece = choice.delta.content if chat else choice.text
            texts[choice.index] = texts.get(choice.index, "") + (piece or "")
            if choice.finish_reason is not None:
                finish[choice.index] = choice.finish_reason
    assert texts == {i: want for i in range(3)}
    assert finish == {i: "length" for i in range(3)}
    assert usage is not None and usage.completion_tokens == 3 * MAX_TOKENS


def test_seeded_choices_are_reproducible_and_differ(
    harness: ServerHarness, client: openai.OpenAI
) -> None:
    model = harness.engine.model_id
    options = {"temperature": 1.0, "max_tokens": 8, "seed": 1234, "n": 3}

    def texts() -> list[str]:
        reply = client.completions.create(model=model, prompt=PROMPT, **options)
        return [c.text for c in reply.choices]

    first = texts()
    assert texts() == first
    assert len(set(first)) == 3, first


def test_grpc_choices_carry_their_index(harness: ServerHarness) -> None:
    request = pb.GenerateRequest(
        prompt=PROMPT,
        n=3,
        sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
    )
    with grpc.insecure_channel(harness.grpc_target) as channel:
        stub = pb_grpc.KVRelayStub(channel)
        responses = list(stub.Generate(request, timeout=60))
        single = list(stub.Generate(pb.GenerateRequest(prompt=PROMPT, sampling=request.sampling)))
    tokens: dict[int, list[int]] = {}
    ended = set()
    for response in responses:
        assert response.index not in ended
        tokens.setdefault(response.index, []).extend(response.token_ids)
        if response.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            ended.add(response.index)
    want = [t for r in single for t in r.token_ids]
    assert tokens == {i: want for i in range(3)} and ended == {0, 1, 2}
    assert responses[-1].HasField("usage") and responses[-1].usage.completion_tokens == 18
    assert sum(r.HasField("usage") for r in responses) == 1


@pytest.mark.parametrize("n", [0, 17])
def test_n_out_of_range_is_a_400_naming_n(client: openai.OpenAI, harness: ServerHarness, n: int):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=harness.engine.model_id, prompt=PROMPT, n=n)
    assert info.value.body["param"] == "n"


def test_a_backend_serving_one_choice_refuses_n_naming_it(
    harness: ServerHarness, client: openai.OpenAI
) -> None:
    """A backend that serves fewer choices (max_choices) refuses a larger n with a 400 naming n."""
    harness.backend.max_choices = 1
    try:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=harness.engine.model_id, prompt=PROMPT, n=2)
        assert info.value.body["param"] == "n"
        assert "n=2" in info.value.body["message"]
    finally:
        del harness.backend.max_choices
