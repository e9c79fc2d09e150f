"""The whole stack as `kvrelay serve` runs it: HTTP/gRPC router -> Ray prefill worker -> NIXL ->
Ray decode worker, with a local redis-server. Outputs must equal the engine's greedy output.
The decode worker speculates (n-gram drafts; `kvrelay serve --speculative ngram`): every
greedy test here is also a test that speculation leaves the output unchanged."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.placement_rules import SloTargets
from engine.config import CacheConfig, EngineConfig, SpeculativeConfig
from engine.llm import LLM
from engine.sampling.sampling_params import SamplingParams
from router.pb import kvrelay_pb2 as pb
from router.pb import kvrelay_pb2_grpc as pb_grpc
from tests.conftest import build_engine
from tests.integration.cluster_support import (
    NUM_BLOCKS,
    ClusterHarness,
    cluster_spec,
    greedy_output,
)

MAX_TOKENS = 12
MODEL = "SmolLM2-135M-Instruct"
QUESTIONS = [f"Give me a short fact about the number {i}." for i in range(16)]


SPECULATIVE = SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=False)
PARAGRAPH = (
    "The old lighthouse keeper climbed the spiral stairs every evening, lit the great lamp, "
    "and watched the ships pass safely through the narrow channel below the cliffs."
)


@pytest.fixture(scope="module")
def stack() -> Iterator[ClusterHarness]:
    engine = EngineConfig(cache=CacheConfig(num_blocks=NUM_BLOCKS), speculative=SPECULATIVE)
    harness = ClusterHarness(cluster_spec(num_prefill=1, num_decode=1, engine=engine))
    try:
        yield harness
    finally:
        harness.stop()


@pytest.fixture(autouse=True)
def no_leaks(stack: ClusterHarness) -> Iterator[None]:
    yield
    stack.wait_until_no_leaks()


@pytest.fixture(scope="module")
def reference(smollm_model):
    """Greedy token ids and text of every question, from the engine alone."""
    llm = LLM(engine=build_engine(smollm_model))
    prompts = [llm.chat_prompt([{"role": "user", "content": q}]) for q in QUESTIONS]
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    llm.engine.assert_no_leaks()
    return [(p, o.token_ids, o.text) for p, o in zip(prompts, outs, strict=True)]


def client(stack: ClusterHarness) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)


def chat_text(stack: ClusterHarness, question: str, stream: bool) -> str:
    messages = [{"role": "user", "content": question}]
    kwargs = dict(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    if not stream:
        return client(stack).chat.completions.create(**kwargs).choices[0].message.content
    chunks = client(stack).chat.completions.create(**kwargs, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def completion_text(stack: ClusterHarness, prompt_ids: list[int], stream: bool) -> str:
    kwargs = dict(model=MODEL, prompt=prompt_ids, max_tokens=MAX_TOKENS, temperature=0)
    if not stream:
        return client(stack).completions.create(**kwargs).choices[0].text
    chunks = client(stack).completions.create(**kwargs, stream=True)
    return "".join(c.choices[0].text for c in chunks if c.choices)


def test_openai_client_16_concurrent_requests_match_engine(stack, reference):
    def run(i: int) -> str:
        prompt_ids, _, _ = reference[i]
        if i % 4 < 2:
            return chat_text(stack, QUESTIONS[i], stream=i % 2 == 1)
        return completion_text(stack, prompt_ids, stream=i % 2 == 1)

    # One request of each kind first: the openai client builds its pydantic response models
    # lazily, and building them from 16 threads at once can fail inside the client.
    warmup = [run(i) for i in range(4)]
    with ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(run, range(16)))
    assert warmup == [text for _, _, text in reference[:4]]
    assert texts == [text for _, _, text in reference]


def test_grpc_concurrent_streams_are_token_exact(stack, reference):
    def run(i: int) -> list[int]:
        prompt_ids, _, _ = reference[i]
        request = pb.GenerateRequest(
            model=MODEL,
            token_ids=pb.TokenIds(ids=prompt_ids),
            sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0),
        )
        with grpc.insecure_channel(stack.grpc_target) as channel:
            responses = list(pb_grpc.KVRelayStub(channel).Generate(request, timeout=120))
        assert responses[-1].HasField("usage")
        return [t for r in responses for t in r.token_ids]

    with ThreadPoolExecutor(16) as pool:
        tokens = list(pool.map(run, range(16)))
    assert tokens == [ids for _, ids, _ in reference]


def test_speculative_decoding_through_the_cluster_is_token_exact_and_reported(stack, sampling_llm):
    """An answer that repeats its prompt: the decode worker's drafts are accepted, the output
    equals the engine's without speculation, usage and /metrics count the accepted tokens;
    the same request with speculative=false (an extra field) accepts none."""
    messages = [{"role": "user", "content": f"Repeat this paragraph word for word: {PARAGRAPH}"}]
    greedy = SamplingParams(max_tokens=40, temperature=0)
    expected = sampling_llm.generate([sampling_llm.chat_prompt(messages)], greedy)
    body = dict(model=MODEL, messages=messages, max_tokens=40, temperature=0)
    reply = client(stack).chat.completions.create(**body)
    assert reply.choices[0].message.content == expected[0].text
    accepted = reply.usage.model_extra["speculative_tokens_accepted"]
    assert 10 <= accepted < reply.usage.completion_tokens, reply.usage
    plain = client(stack).chat.completions.create(**body, extra_body={"speculative": False})
    assert plain.choices[0].message.content == expected[0].text
    assert plain.usage.model_extra["speculative_tokens_accepted"] == 0
    stack.wait_until_no_leaks()

    def decode_accepted() -> float:
        with urllib.request.urlopen(stack.base_url + "/metrics", timeout=30) as response:
            text = response.read().decode()
        families = {f.name: f for f in text_string_to_metric_families(text)}
        family = families["kvrelay_spec_accepted_tokens"]
        return sum(s.value for s in family.samples if s.labels["role"] == "decode")

    for _ in range(100):  # the workers' figures reach the router with their next report
        if decode_accepted() >= accepted:
            break
        time.sleep(0.1)
    assert decode_accepted() >= accepted


def test_repeated_prompt_reports_cached_tokens(stack, reference):
    prompt_ids, _, _ = reference[0]
    body = dict(model=MODEL, prompt=prompt_ids, max_tokens=2, temperature=0)
    client(stack).completions.create(**body)
    usage = client(stack).completions.create(**body).usage
    assert usage.prompt_tokens_details.cached_tokens == (len(prompt_ids) - 1) // 16 * 16


def test_metrics_export_each_workers_kv_handoff_figures(stack, reference):
    prompt_ids, _, _ = reference[1]
    client(stack).completions.create(model=MODEL, prompt=prompt_ids, max_tokens=2)
    stack.wait_until_no_leaks()
    with urllib.request.urlopen(stack.base_url + "/metrics", timeout=30) as response:
        families = {f.name: f for f in text_string_to_metric_families(response.read().decode())}

    def samples(name: str) -> dict[tuple, float]:
        return {tuple(sorted(s.labels.items())): s.value for s in families[name].samples}

    known = stack.cluster.backend.workers
    workers = {(role, i) for role in ("prefill", "decode") for i in known.actors(role)}
    stranded = samples("kvrelay_kv_stranded_blocks")
    assert {(dict(k)["role"], dict(k)["worker_id"]) for k in stranded} == workers
    assert set(stranded.values()) == {0}
    blocks = samples("kvrelay_kv_handoff_blocks")
    states = {(dict(k)["role"], dict(k)["state"]) for k in blocks}
    assert states == {
        ("prefill", "held"), ("prefill", "being_read"), ("decode", "reserved"),
        ("decode", "reading"),
    }  # fmt: skip
    assert set(blocks.values()) == {0}, "idle: no block in a handoff"
    moves = {
        (dict(k)["role"], dict(k)["transition"]): v
        for k, v in samples("kvrelay_kv_handoff_transitions").items()
    }
    assert moves["prefill", "new->held"] >= 1 and moves["prefill", "being_read->released"] >= 1
    assert moves["decode", "reading->committed"] >= 1
    assert samples("kvrelay_kv_expired_leases") and samples("kvrelay_kv_refused_handshakes")


def test_http_disconnect_mid_stream_frees_both_workers(stack):
    stream = client(stack).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me a very long story."}],
        max_tokens=400,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    # the autouse fixture then waits until both workers are back to their full free count


def test_grpc_cancel_frees_both_workers(stack):
    sampling = pb.SamplingParams(max_tokens=400, ignore_eos=True)
    request = pb.GenerateRequest(
        request_id="cancel-me", prompt="Count to a thousand.", sampling=sampling
    )
    with grpc.insecure_channel(stack.grpc_target) as channel:
        call = pb_grpc.KVRelayStub(channel).Generate(request, timeout=60)
        next(call)
        next(call)
        call.cancel()


def post(stack: ClusterHarness, path: str, body: bytes | dict) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(stack.base_url + path, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"model": "x", "messages": [', "JSON"),
        ({"model": MODEL}, "Field required"),
        ({**CHAT, "max_tokens": "ten"}, "integer"),
        ({**CHAT, "max_tokens": -5}, "positive"),
        ({**CHAT, "model": "gpt-9"}, "not served"),
        ({**CHAT, "messages": [{"role": "user", "content": "hi " * 5000}]}, "context length"),
    ],
)
def test_bad_http_input_is_400_and_serving_continues(stack, body, message):
    status, reply = post(stack, "/v1/chat/completions", body)
    assert status == 400 and message in reply["error"]["message"], reply
    status, reply = post(stack, "/v1/chat/completions", CHAT)
    assert status == 200 and reply["usage"]["completion_tokens"] == 2


def test_bad_grpc_input_is_invalid_argument(stack):
    bad = [
        pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=-3)),
        pb.GenerateRequest(model="gpt-9", prompt="hi"),
        pb.GenerateRequest(prompt="hi " * 5000),
    ]
    with grpc.insecure_channel(stack.grpc_target) as channel:
        stub = pb_grpc.KVRelayStub(channel)
        for request in bad:
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(request, timeout=30))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert info.value.details()
        ok = list(
            stub.Generate(
                pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=2)),
                timeout=60,
            )
        )
    assert sum(len(r.token_ids) for r in ok) == 2


async def until_decode_steps_are_published(backend, timeout_s: float = 60.0) -> None:
    """The decode workers' step times reach the index with their next load update."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not all(w.load.step_us for w in (await backend.index.view("decode", [])).workers):
        assert asyncio.get_running_loop().time() < deadline, "no step time published"
        await asyncio.sleep(0.1)


def test_requests_predicted_to_miss_the_objectives_get_503_and_resource_exhausted(stack, reference):
    """While a long stream runs on the decode worker, a TPOT objective its measured steps
    cannot meet (1 us) refuses new requests before anything is sent, on every front end
    ("shed"); "place" serves them token-exact; the long stream is not harmed."""
    backend = stack.cluster.backend
    prompt_ids, _, text = reference[2]

    def request(max_tokens: int) -> pb.GenerateRequest:
        return pb.GenerateRequest(
            model=MODEL,
            token_ids=pb.TokenIds(ids=prompt_ids),
            sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
        )

    refused_before = backend.placer.num_slo_refused
    with grpc.insecure_channel(stack.grpc_target) as channel:
        stub = pb_grpc.KVRelayStub(channel)
        long_stream = stub.Generate(request(2000), timeout=300)
        next(long_stream)  # it runs on the decode worker now (placed there by this router)
        stack.run(until_decode_steps_are_published(backend))
        backend.placer.slo = SloTargets(tpot_ms=0.001, overload="shed")
        try:
            for stream in (False, True):
                with pytest.raises(openai.APIStatusError) as refused:
                    completion_text(stack, prompt_ids, stream=stream)
                assert refused.value.status_code == 503
                assert "over the TPOT objective" in str(refused.value)
            with pytest.raises(grpc.RpcError) as status:
                list(stub.Generate(request(MAX_TOKENS), timeout=120))
            assert status.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert backend.placer.num_slo_refused == refused_before + 3
            backend.placer.slo = SloTargets(tpot_ms=0.001, overload="place")
            assert completion_text(stack, prompt_ids, stream=True) == text
        finally:
            backend.placer.slo = SloTargets()
        assert len(next(long_stream).token_ids) >= 1  # still streaming
        long_stream.cancel()
    with urllib.request.urlopen(stack.base_url + "/metrics", timeout=30) as response:
        families = {f.name: f for f in text_string_to_metric_families(response.read().decode())}
    assert families["kvrelay_slo_refused"].samples[0].value == refused_before + 3


def test_routers_report_slo_attainment_to_the_controller(stack, reference):
    """The router's recent requests, judged against its objectives, reach the controller with
    its membership sync: every one met a 10-minute TTFT, none a 1 us TPOT."""
    backend = stack.cluster.backend
    controller = stack.cluster.controller
    backend.placer.slo = SloTargets(ttft_ms=600_000, tpot_ms=0.001, overload="place")
    try:
        completion_text(stack, reference[3][0], stream=False)

        async def reported() -> tuple[float | None, float | None]:
            deadline = asyncio.get_running_loop().time() + 60
            while True:
                got = (
                    await controller.slo_attainment.remote("prefill"),
                    await controller.slo_attainment.remote("decode"),
                )
                if got == (1.0, 0.0) or asyncio.get_running_loop().time() > deadline:
                    return got
                await asyncio.sleep(0.2)

        assert stack.run(reported()) == (1.0, 0.0)
    finally:
        backend.placer.slo = SloTargets()


# ---- sampling: penalties, logit_bias, top logprobs, echo (prefill samples the first token,
# the decode worker the rest) ------------------------------------------------------------
SAMPLING_PROMPT = "List the days of the week, then list them again:"


def engine_output(llm: LLM, prompt: list[int], **fields):
    return greedy_output(llm, prompt, MAX_TOKENS, **fields)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_top_logprobs_equal_the_engines(stack, sampling_llm, stream):
    messages = [{"role": "user", "content": SAMPLING_PROMPT}]
    want = engine_output(
        sampling_llm, sampling_llm.chat_prompt(messages), logprobs=True, top_logprobs=3
    )
    kwargs = dict(
        model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0, logprobs=True,
        top_logprobs=3,
    )  # fmt: skip
    if stream:
        chunks = client(stack).chat.completions.create(**kwargs, stream=True)
        choices = [chunk.choices[0] for chunk in chunks if chunk.choices]
        content = [item for c in choices if c.logprobs for item in c.logprobs.content]
    else:
        content = client(stack).chat.completions.create(**kwargs).choices[0].logprobs.content
    tokenizer = sampling_llm.engine.tokenizer
    assert len(content) == len(want.token_ids) == MAX_TOKENS
    for item, top, logprob in zip(content, want.top_logprobs, want.logprobs, strict=True):
        assert [t.token for t in item.top_logprobs] == [tokenizer.decode([i]) for i, _ in top]
        assert [t.logprob for t in item.top_logprobs] == pytest.approx(
            [lp for _, lp in top], abs=1e-3
        )
        assert item.logprob == pytest.approx(logprob, abs=1e-3)
        assert item.top_logprobs[0].token == item.token  # greedy: the most likely one
        assert bytes(item.top_logprobs[0].bytes) == item.token.encode()


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_n_and_echo(stack, sampling_llm, stream):
    tokenizer = sampling_llm.engine.tokenizer
    # a special token in the ids: echo repeats the prompt as sent, it too
    (im_start,) = tokenizer.encode("<|im_start|>", add_special_tokens=False)
    prompt_ids = [im_start, *tokenizer.encode(SAMPLING_PROMPT)]
    want = engine_output(sampling_llm, prompt_ids, logprobs=True, top_logprobs=2)
    kwargs = dict(model=MODEL, prompt=prompt_ids, max_tokens=MAX_TOKENS, temperature=0)
    api = client(stack).completions
    if stream:
        chunks = [c.choices[0] for c in api.create(**kwargs, logprobs=2, stream=True) if c.choices]
        text = "".join(c.text for c in chunks)
        tokens = [t for c in chunks if c.logprobs for t in c.logprobs.tokens]
        tops = [t for c in chunks if c.logprobs for t in c.logprobs.top_logprobs]
        offsets = [o for c in chunks if c.logprobs for o in c.logprobs.text_offset]
        echoed = "".join(
            c.choices[0].text for c in api.create(**kwargs, echo=True, stream=True) if c.choices
        )
    else:
        choice = api.create(**kwargs, logprobs=2).choices[0]
        text, tokens = choice.text, choice.logprobs.tokens
        tops, offsets = choice.logprobs.top_logprobs, choice.logprobs.text_offset
        assert choice.logprobs.token_logprobs == pytest.approx(want.logprobs, abs=1e-3)
        echoed = api.create(**kwargs, echo=True).choices[0].text
    assert text == want.text and "".join(tokens) == text
    assert offsets == [sum(map(len, tokens[:i])) for i in range(len(tokens))]
    decode = tokenizer.decode
    for top, pairs in zip(tops, want.top_logprobs, strict=True):
        assert top == pytest.approx({decode([i]): lp for i, lp in pairs}, abs=1e-3)
    assert echoed == "<|im_start|>" + decode(prompt_ids) + want.text


def test_penalties_and_logit_bias_change_the_output_as_the_engine_does(stack, sampling_llm):
    prompt_ids = sampling_llm.engine.tokenizer.encode(SAMPLING_PROMPT)
    plain = engine_output(sampling_llm, prompt_ids).token_ids
    api = client(stack).completions
    base = dict(model=MODEL, prompt=prompt_ids, max_tokens=MAX_TOKENS, temperature=0)
    for fields in (
        dict(presence_penalty=1.5, frequency_penalty=1.0),
        dict(repetition_penalty=1.5),
        dict(logit_bias={plain[0]: -100.0}),
    ):
        want = engine_output(sampling_llm, prompt_ids, **fields)
        assert want.token_ids != plain, fields
        bias = {str(k): v for k, v in fields.get("logit_bias", {}).items()}
        body = {**fields, "logit_bias": bias}
        official = {k: body.pop(k) for k in ("presence_penalty", "frequency_penalty") if k in body}
        got = api.create(**base, **official, extra_body=body)
        assert got.choices[0].text == want.text, fields
        streamed = api.create(**base, **official, extra_body=body, stream=True)
        assert "".join(c.choices[0].text for c in streamed if c.choices) == want.text
    (dot,) = sampling_llm.engine.tokenizer.encode(".")
    forced = api.create(**base, logit_bias={str(dot): 100})
    assert forced.choices[0].text == "." * MAX_TOKENS


def test_grpc_sampling_fields(stack, sampling_llm):
    prompt_ids = sampling_llm.engine.tokenizer.encode(SAMPLING_PROMPT)
    fields = dict(presence_penalty=1.0, repetition_penalty=1.3, logit_bias={17: 3.0})
    want = engine_output(sampling_llm, prompt_ids, logprobs=True, top_logprobs=2, **fields)
    sampling = pb.SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0, logprobs=True, top_logprobs=2, **fields
    )
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt_ids), sampling=sampling)
    with grpc.insecure_channel(stack.grpc_target) as channel:
        responses = list(pb_grpc.KVRelayStub(channel).Generate(request, timeout=120))
    assert [t for r in responses for t in r.token_ids] == want.token_ids
    tops = [top for r in responses for top in r.top_logprobs]
    assert [list(top.token_ids) for top in tops] == [[t for t, _ in p] for p in want.top_logprobs]
    for top, pairs in zip(tops, want.top_logprobs, strict=True):
        assert list(top.logprobs) == pytest.approx([lp for _, lp in pairs], abs=1e-3)


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        ("/v1/chat/completions", {"presence_penalty": 2.5}, "presence_penalty"),
        ("/v1/chat/completions", {"frequency_penalty": -3}, "frequency_penalty"),
        ("/v1/chat/completions", {"repetition_penalty": 0}, "repetition_penalty"),
        ("/v1/chat/completions", {"logit_bias": {"9999999": 1}}, "logit_bias"),
        ("/v1/chat/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),  # needs logprobs
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt": "hi", "echo": True, "logprobs": 1}, "echo"),
    ],
)
def test_bad_sampling_values_are_400_naming_the_field(stack, path, fields, param):
    status, reply = post(stack, path, {**CHAT, **fields})
    assert status == 400 and reply["error"]["param"] == param, reply


def test_bad_grpc_sampling_values_are_invalid_argument(stack):
    bad = [
        pb.SamplingParams(max_tokens=2, repetition_penalty=0),
        pb.SamplingParams(max_tokens=2, presence_penalty=3),
        pb.SamplingParams(max_tokens=2, logit_bias={10**7: 1.0}),
        pb.SamplingParams(max_tokens=2, logprobs=True, top_logprobs=21),
    ]
    with grpc.insecure_channel(stack.grpc_target) as channel:
        stub = pb_grpc.KVRelayStub(channel)
        for sampling in bad:
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(pb.GenerateRequest(prompt="hi", sampling=sampling), timeout=30))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert any(name in info.value.details() for name in (
                "repetition_penalty", "presence_penalty", "logit_bias", "top_logprobs",
            ))  # fmt: skip
