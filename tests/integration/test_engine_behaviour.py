"""Engine behaviour on SmolLM2: prefix reuse, salts, bad input, aborts, stops, seeds, events."""

from __future__ import annotations

import pytest

from engine.config import CacheConfig, EngineConfig
from engine.engine import Engine
from engine.kv_cache.block_pool import BlockStored
from engine.kv_cache.retention import RetentionRange
from engine.sampling.sampling_params import SamplingParams
from tests.conftest import run_to_completion

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def system_prompt_request(tokenizer, question: str) -> list[int]:
    system = " ".join(f"Guideline {i}: stay accurate and kind." for i in range(1, 40))
    return tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": question}]
    )


def test_shared_system_prompt_computes_only_suffix(make_engine, tokenizer):
    engine = make_engine()
    first = system_prompt_request(tokenizer, "What is two plus two?")
    second = system_prompt_request(tokenizer, "Name a color of the sky, please.")
    shared = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    assert shared >= 256
    engine.add_request("first", first, GREEDY)
    run_to_completion(engine)
    before = engine.stats.num_computed_tokens
    req = engine.add_request("second", second, GREEDY)
    run_to_completion(engine)
    computed = engine.stats.num_computed_tokens - before
    assert shared % 16, "the prompts diverge inside a block"
    assert req.num_cached_tokens == shared  # full blocks + the diverging block's first tokens
    assert engine.kv.num_partial_reused_tokens == shared % 16
    # Prompt suffix + one token per decode step after the first sampled token.
    assert computed == len(second) - req.num_cached_tokens + GREEDY.max_tokens - 1


def test_partial_block_reuse_is_token_exact_and_can_be_turned_off(make_engine, tokenizer):
    """The copied block's matching tokens give the same greedy output as computing them."""
    first = system_prompt_request(tokenizer, "What is two plus two?")
    second = system_prompt_request(tokenizer, "Name a color of the sky, please.")
    shared = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    outputs = {}
    for min_tokens in (1, 0):
        engine = make_engine(partial_reuse_min_tokens=min_tokens)
        engine.add_request("first", first, GREEDY)
        run_to_completion(engine)
        req = engine.add_request("second", second, GREEDY)
        outputs[min_tokens] = run_to_completion(engine)["second"]
        reused = shared if min_tokens else shared // 16 * 16
        assert req.num_cached_tokens == reused, min_tokens
    fresh = make_engine(enable_prefix_caching=False)
    fresh.add_request("second", second, GREEDY)
    assert outputs[1] == outputs[0] == run_to_completion(fresh)["second"]


def test_cache_salt_isolates(make_engine, tokenizer):
    engine = make_engine()
    prompt = system_prompt_request(tokenizer, "Hi")
    engine.add_request("a", prompt, GREEDY, cache_salt="tenant-a")
    run_to_completion(engine)
    other = engine.add_request("b", prompt, GREEDY, cache_salt="tenant-b")
    same = engine.add_request("c", prompt, GREEDY, cache_salt="tenant-a")
    got = run_to_completion(engine)
    assert other.num_cached_tokens == 0
    # "a"'s output filled the block its prompt ends in, so "c" reuses that block in part too:
    # everything but the last prompt token (which yields the first logits).
    assert len(prompt) % 16 + GREEDY.max_tokens - 1 >= 16
    assert same.num_cached_tokens == len(prompt) - 1
    assert got["b"] == got["c"], "isolation must not change the output"


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], GREEDY, "prompt is empty"),
        ("", GREEDY, "prompt is empty"),
        ([1] * 5000, GREEDY, "max_model_len"),
        ([1, 2], SamplingParams(temperature=-0.5), "temperature"),
        ([1, 2], SamplingParams(top_p=0.0), "top_p"),
        ([1, 2], SamplingParams(top_p=1.5), "top_p"),
        ([1, 2], SamplingParams(max_tokens=0), "max_tokens"),
        ([1, 2], SamplingParams(max_tokens=-3), "max_tokens"),
        ([1, 10**9], GREEDY, "outside the vocabulary"),
        ([1, -1], GREEDY, "outside the vocabulary"),
        ([1, 2], SamplingParams(stop_token_ids=(10**9,)), "stop_token_ids"),
    ],
)
def test_bad_input_rejected_and_engine_keeps_serving(make_engine, prompt, params, message):
    engine = make_engine(max_model_len=4096)
    good = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    engine.add_request("good", [1, 2, 3], good)
    first = [t for out in engine.step() for t in out.new_token_ids]
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, params)
    assert "bad" not in engine.scheduler.requests
    assert len(first + run_to_completion(engine)["good"]) == good.max_tokens


def test_fp8_kv_cache_is_refused_without_flashinfer(smollm_model):
    config = EngineConfig(cache=CacheConfig(num_blocks=64, kv_cache_dtype="fp8"), device="cpu")
    with pytest.raises(ValueError, match="kv_cache_dtype fp8 needs the flashinfer"):
        Engine(config, model=smollm_model)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        CacheConfig(kv_cache_dtype="int4")


def test_duplicate_request_id_rejected(make_engine):
    engine = make_engine()
    engine.add_request("same", [1, 2, 3], GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("same", [4, 5], GREEDY)
    run_to_completion(engine)


def test_abort_mid_run_frees_blocks_and_spares_others(make_engine, tokenizer):
    engine = make_engine(max_num_batched_tokens=64)
    prompts = [tokenizer.encode(f"Story number {i}: once upon a time") for i in range(3)]
    solo = make_engine()
    for i, p in enumerate(prompts):
        solo.add_request(f"s{i}", p, SamplingParams(max_tokens=12, temperature=0))
    expected = run_to_completion(solo)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=12, temperature=0))
    got: dict[str, list[int]] = {}
    for _ in range(3):
        for out in engine.step():
            got.setdefault(out.req_id, []).extend(out.new_token_ids)
    assert engine.abort("r1")
    assert not engine.abort("r1"), "a second abort is a no-op"
    engine.check_integrity()
    for req_id, tokens in run_to_completion(engine).items():
        got.setdefault(req_id, []).extend(tokens)
    assert got["r0"] == expected["s0"] and got["r2"] == expected["s2"]


def test_stop_string_cuts_text(make_engine, tokenizer):
    engine = make_engine(detokenize=True)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    engine.add_request("s", prompt, SamplingParams(max_tokens=20, temperature=0, stop=("Paris",)))
    text, reason = "", None
    while engine.has_unfinished_requests:
        for out in engine.step():
            text += out.new_text
            reason = out.finish_reason or reason
    assert reason == "stop"
    assert text == "The capital of France is "


def test_stop_token_ignore_eos_and_max_tokens(make_engine, tokenizer):
    engine = make_engine()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Say hello."}])
    engine.add_request("eos", prompt, SamplingParams(max_tokens=64, temperature=0))
    greedy = run_to_completion(engine)["eos"]
    assert greedy[-1] in engine.eos_token_ids and len(greedy) < 64
    engine.add_request("ign", prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    assert len(run_to_completion(engine)["ign"]) == 40
    stop_id = greedy[2]
    engine.add_request(
        "tok", prompt, SamplingParams(max_tokens=64, temperature=0, stop_token_ids=(stop_id,))
    )
    assert run_to_completion(engine)["tok"] == greedy[: greedy.index(stop_id) + 1]


def test_seed_reproducible_whatever_the_batch(make_engine, tokenizer):
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    prompt = tokenizer.encode("In a distant galaxy")
    alone = make_engine()
    alone.add_request("x", prompt, params)
    expected = run_to_completion(alone)["x"]
    crowded = make_engine()
    for i in range(5):
        crowded.add_request(
            f"noise{i}",
            tokenizer.encode(f"Noise {i}"),
            SamplingParams(max_tokens=10, temperature=1.0),
        )
    crowded.add_request("x", prompt, params)
    assert run_to_completion(crowded)["x"] == expected
    other = make_engine()
    other.add_request("y", prompt, SamplingParams(**{**params.__dict__, "seed": 99}))
    assert run_to_completion(other)["y"] != expected


def test_logprobs_of_chosen_tokens(make_engine, tokenizer):
    engine = make_engine()
    engine.add_request(
        "lp",
        tokenizer.encode("One, two, three,"),
        SamplingParams(max_tokens=5, temperature=0, logprobs=True),
    )
    logprobs = []
    while engine.has_unfinished_requests:
        for out in engine.step():
            logprobs.extend(out.new_logprobs or [])
    assert len(logprobs) == 5 and all(lp <= 0.0 for lp in logprobs)
    assert max(logprobs) > -2.0, "greedy tokens of a counting prompt are likely"


def test_kv_events_stored_in_chain_order(make_engine, tokenizer):
    engine = make_engine(record_kv_events=True)
    prompt = tokenizer.encode("word " * 70)
    req = engine.add_request("e", prompt, GREEDY)
    run_to_completion(engine)
    events = engine.kv.pool.drain_events()
    stored = [e for e in events if isinstance(e, BlockStored)]
    hashes = [e.block_hashes[0] for e in stored]
    assert hashes == req.block_hashes[: len(hashes)]
    assert len(hashes) >= len(prompt) // 16
    assert stored[0].parent_hash is None and stored[1].parent_hash == hashes[0]


def test_token_range_retention_keeps_a_system_prompt_through_pool_pressure(make_engine, tokenizer):
    """A system prompt given priority 90 survives three unrelated prompts that evict by LRU; the
    same engine without the range loses it."""
    first = system_prompt_request(tokenizer, "What is two plus two?")
    later = system_prompt_request(tokenizer, "Name a color of the sky, please.")
    shared = next(i for i, (a, b) in enumerate(zip(first, later, strict=False)) if a != b)
    others = [
        tokenizer.apply_chat_template(
            [
                {"role": "system", "content": " ".join(f"Rule {j} of set {i}." for j in range(60))},
                {"role": "user", "content": "Hello"},
            ]
        )
        for i in range(3)
    ]
    cached = {}
    for keep in (True, False):
        engine = make_engine(num_blocks=64)  # 1,024 tokens: room for two of these prompts
        ranges = [RetentionRange(0, shared, 90)] if keep else []
        engine.add_request("first", first, GREEDY, kv_retention=ranges)
        run_to_completion(engine)
        for i, prompt in enumerate(others):
            engine.add_request(f"other{i}", prompt, GREEDY)
            run_to_completion(engine)
        req = engine.add_request("later", later, GREEDY)
        run_to_completion(engine)
        cached[keep] = req.num_cached_tokens
    assert sum(len(p) + GREEDY.max_tokens for p in others) > 64 * 16 - len(first)  # pressure
    assert cached[True] == shared  # every block of the system prompt, the diverging one in part
    assert cached[False] < shared // 16 * 16, cached


def test_bad_retention_ranges_are_refused_naming_the_field(make_engine, tokenizer):
    engine = make_engine()
    with pytest.raises(ValueError, match=r"kv_retention\[0\]\.priority"):
        engine.add_request("r", [1, 2, 3], GREEDY, kv_retention=[RetentionRange(0, 2, 101)])
    assert not engine.has_unfinished_requests


def system_prompt_rounds(tokenizer, num_rules: int) -> list[list[int]]:
    """Four system prompts of num_rules rules (~9.5 tokens each), asked in turn three times."""
    systems = [
        " ".join(f"Set {s} rule {j}: answer well." for j in range(num_rules)) for s in range(4)
    ]
    return [
        tokenizer.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": f"Q{r}?"}]
        )
        for r in range(3)
        for system in systems
    ]


def test_host_tier_is_token_exact_and_saves_recomputing_evicted_prefixes(make_engine, tokenizer):
    """Four system prompts, asked in turn three times over a device pool that holds two: the
    host tier keeps what the device evicts and copies it back, token for token the same."""
    prompts = system_prompt_rounds(tokenizer, 22)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    outputs, computed = {}, {}
    for host_bytes in (0, 256 << 20):
        engine = make_engine(num_blocks=32, host_kv_cache_bytes=host_bytes)
        before = engine.stats.num_computed_tokens
        got = []
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params)
            got.append(run_to_completion(engine)[f"r{i}"])
        outputs[host_bytes] = got
        computed[host_bytes] = engine.stats.num_computed_tokens - before
        if host_bytes:
            assert engine.kv.host_tier is not None and engine.kv.num_host_hit_blocks > 0
    assert outputs[256 << 20] == outputs[0]
    assert computed[256 << 20] < 0.6 * computed[0], computed


def test_snapshot_counts_load_and_drains_to_nothing(make_engine, tokenizer):
    engine = make_engine()
    idle = engine.snapshot()
    assert (idle.num_running, idle.num_waiting, idle.num_requests) == (0, 0, 0)
    assert idle.num_free_blocks == idle.num_total_blocks == engine.kv.num_blocks
    prompt = tokenizer.encode("The quick brown fox jumps over the lazy dog")
    engine.add_request("a", prompt, GREEDY)
    engine.add_request("b", prompt[:5], GREEDY)
    queued = engine.snapshot()
    assert (queued.num_waiting, queued.num_requests) == (2, 2)
    assert queued.num_queued_tokens == len(prompt) + 5
    engine.step()
    running = engine.snapshot()
    assert running.num_running == 2 and running.num_waiting == 0
    assert running.num_free_blocks < running.num_total_blocks
    assert running.tokens_per_s > 0 and running.step_s > 0
    run_to_completion(engine)
    done = engine.snapshot()
    assert (done.num_running, done.num_requests, done.num_kept_requests) == (0, 0, 0)
    assert done.num_queued_tokens == 0
