"""The serving features CPU tests cover, on the CUDA path (FlashInfer, decode CUDA graphs,
overlapped steps, pinned host tier): SmolLM2's json_schema outputs validate, n=3 greedy choices
equal the single greedy output with the prompt computed once, logit_bias reaches the device
logits, and the host tier copies back exactly what a device-pool hit would have read."""

from __future__ import annotations

import json

import pytest
import torch

from engine.engine import Engine
from engine.sampling.sampling_params import SamplingParams, StructuredOutput
from tests.conftest import build_engine, run_to_completion
from tests.integration.test_engine_behaviour import system_prompt_rounds
from tests.integration.test_engine_fork import run_choices

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def cuda_engine(smollm_dir, **overrides) -> Engine:
    return build_engine(model_path=str(smollm_dir), device="cuda", **overrides)


def chat(engine: Engine, text: str) -> list[int]:
    assert engine.tokenizer is not None
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def test_json_schema_outputs_validate_on_cuda(smollm_dir) -> None:
    engine = cuda_engine(smollm_dir)
    schema = StructuredOutput("json_schema", json.dumps(PERSON))
    params = SamplingParams(max_tokens=48, temperature=0.8, seed=3, structured=schema)
    for i in range(8):
        engine.add_request(f"p{i}", chat(engine, f"Make up person number {i} as JSON."), params)
    engine.add_request("free", chat(engine, "Say hello."), SamplingParams(max_tokens=8))
    outputs = run_to_completion(engine)
    assert engine.tokenizer is not None
    for i in range(8):
        person = json.loads(engine.tokenizer.decode(outputs[f"p{i}"]))
        assert set(person) == {"name", "age"}, person
        assert isinstance(person["name"], str) and len(person["name"]) <= 16
        assert isinstance(person["age"], int) and 0 <= person["age"] <= 120
    assert outputs["free"]
    engine.assert_no_leaks()


def test_n3_greedy_choices_equal_the_single_output_and_the_prompt_is_computed_once(
    smollm_dir,
) -> None:
    engine = cuda_engine(smollm_dir)
    prompt = chat(engine, "Name three rivers.")
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    engine.add_request("one", prompt, greedy)
    single = run_choices(engine)[("one", 0)]
    engine.kv.pool.evict_all_cached()
    before = engine.stats.num_computed_tokens
    engine.add_request("three", prompt, SamplingParams(**{**greedy.__dict__, "n": 3}))
    assert run_choices(engine) == {("three", i): single for i in range(3)}
    assert engine.stats.num_computed_tokens - before == len(prompt) + 3 * (8 - 1)
    engine.assert_no_leaks()


def test_logit_bias_reaches_the_device_logits(smollm_dir) -> None:
    engine = cuda_engine(smollm_dir)
    prompt = chat(engine, "Count to ten.")
    forced = 1234
    bias = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logit_bias={forced: 100})
    engine.add_request("biased", prompt, bias)
    engine.add_request("plain", prompt, SamplingParams(max_tokens=6, temperature=0))
    outputs = run_to_completion(engine)
    assert outputs["biased"] == [forced] * 6
    assert outputs["plain"] != outputs["biased"]
    engine.assert_no_leaks()


def test_host_tier_copies_back_what_a_device_hit_reads(smollm_dir, tokenizer) -> None:
    """Four system prompts asked in turn three times: over a pool that holds two, with the
    host tier, against a pool that holds all four (every later round a device hit). The same
    cached KV either way, so the same tokens; the small pool really went through the tier."""
    prompts = system_prompt_rounds(tokenizer, 45)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outputs = {}
    for num_blocks, host_bytes in ((512, 0), (64, 256 << 20)):
        engine = cuda_engine(
            smollm_dir,
            num_blocks=num_blocks,
            host_kv_cache_bytes=host_bytes,
            partial_reuse_min_tokens=0,  # the same chunks computed either way
        )
        got = []
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params)
            got.append(run_to_completion(engine)[f"r{i}"])
        outputs[host_bytes] = got
        if host_bytes:
            assert engine.kv.num_host_hit_blocks > 0
        engine.assert_no_leaks()
    assert outputs[256 << 20] == outputs[0]


def test_host_tier_copies_back_beside_the_step_in_flight(smollm_dir, tokenizer) -> None:
    """Host hits arriving while two long decodes run: their copies back go on the copy-back
    stream beside the step in flight. Every output (the hits' and the decodes') equals a run
    with every copy on the step's stream, and a run on a pool that holds it all (no tier)."""
    prompts = system_prompt_rounds(tokenizer, 45)
    hit_params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    long_params = SamplingParams(max_tokens=8 * len(prompts) + 8, temperature=0.0, ignore_eos=True)
    runs: dict[str, dict[str, list[int]]] = {}
    for name, num_blocks, host_bytes, ahead in (
        ("device pool", 512, 0, True),
        ("ahead", 96, 256 << 20, True),
        ("in step", 96, 256 << 20, False),
    ):
        engine = cuda_engine(
            smollm_dir,
            num_blocks=num_blocks,
            host_kv_cache_bytes=host_bytes,
            partial_reuse_min_tokens=0,
        )
        engine.copies.copy_back_ahead = ahead
        for j, text in enumerate(("Count from one to a hundred.", "Name every month, slowly.")):
            engine.add_request(f"long{j}", chat(engine, text), long_params)
        tokens: dict[str, list[int]] = {}
        num_steps = 0
        while engine.has_unfinished_requests:
            if num_steps % 8 == 0 and num_steps // 8 < len(prompts):  # one hit at a time
                engine.add_request(f"r{num_steps // 8}", prompts[num_steps // 8], hit_params)
            for out in engine.step():
                tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
            num_steps += 1
        runs[name] = tokens
        if host_bytes:
            assert engine.kv.num_host_hit_blocks > 0
            copies = engine.copies
            assert (copies.num_copies_ahead > 0) is ahead, copies.num_copies_in_step
        engine.assert_no_leaks()
    assert runs["ahead"] == runs["in step"] == runs["device pool"]


def test_ngram_speculation_keeps_greedy_output_on_cuda(smollm_dir, tokenizer) -> None:
    """Verify steps on the CUDA path (each verified token a decode row, the step replayed
    from a decode graph): greedy SmolLM2 output with n-gram drafting equals the output
    without, drafts are accepted, the verify steps ran as graphs, and no block leaks."""
    from engine.config import SpeculativeConfig

    paragraph = (
        "The old lighthouse keeper climbed the spiral stairs every evening, lit the great lamp, "
        "and watched the ships pass safely through the narrow channel below the cliffs."
    )
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Repeat this paragraph word for word: {paragraph}"}]
        ),
        tokenizer.apply_chat_template([{"role": "user", "content": "Name three rivers."}]),
    ]
    params = SamplingParams(max_tokens=48, temperature=0.0)
    outputs = []
    for speculative in (SpeculativeConfig(), SpeculativeConfig(method="ngram", adaptive=False)):
        engine = cuda_engine(smollm_dir, speculative=speculative)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params)
        outputs.append(run_to_completion(engine))
        engine.assert_no_leaks()
    assert engine.speculator.num_accepted_tokens > 10
    # every step but the prompts' prefill replayed a graph, verify steps included
    assert engine.runner.num_graph_steps >= engine.stats.num_steps - len(prompts) > 0
    assert outputs[1] == outputs[0]
