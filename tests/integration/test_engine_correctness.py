"""Greedy output of the engine equals transformers' greedy generate, token for token."""

from __future__ import annotations

import pytest

from engine.sampling.sampling_params import SamplingParams
from tests.conftest import run_to_completion
from tests.integration.oracle import NUM_NEW_TOKENS, hf_greedy, oracle_prompts

GREEDY = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return oracle_prompts(tokenizer)


@pytest.fixture(scope="module")
def expected(prompts) -> list[list[int]]:
    return [hf_greedy(p) for p in prompts]


def submit_all(engine, prompts, prefix="r"):
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{prefix}{i}", prompt, GREEDY)
    got = run_to_completion(engine)
    return [got[f"{prefix}{i}"] for i in range(len(prompts))]


def test_prompt_lengths_cover_range(prompts):
    lengths = [len(p) for p in prompts]
    assert len(prompts) >= 8 and min(lengths) == 1 and max(lengths) >= 600


def test_one_at_a_time(make_engine, prompts, expected):
    engine = make_engine()
    for i, prompt in enumerate(prompts):
        assert submit_all(engine, [prompt], prefix=f"single{i}-") == [expected[i]], f"prompt {i}"


def test_all_in_one_batch(make_engine, prompts, expected):
    engine = make_engine(max_num_batched_tokens=4096)
    assert submit_all(engine, prompts) == expected


def test_small_prefill_chunks(make_engine, prompts, expected):
    engine = make_engine(max_num_batched_tokens=32)
    assert submit_all(engine, prompts) == expected
    assert engine.stats.num_steps > sum(len(p) for p in prompts) // 32


def test_prefix_cache_warm_and_cold(make_engine, prompts, expected):
    cold = make_engine(enable_prefix_caching=False)
    assert submit_all(cold, prompts) == expected
    warm = make_engine()
    assert submit_all(warm, prompts, prefix="first") == expected
    computed_before = warm.stats.num_computed_tokens
    outputs = []
    for i, prompt in enumerate(prompts):
        warm.add_request(f"again{i}", prompt, GREEDY)
    while warm.has_unfinished_requests:
        outputs.extend(warm.step())
    got = {}
    cached = {}
    for out in outputs:
        got.setdefault(out.req_id, []).extend(out.new_token_ids)
        cached[out.req_id] = out.num_cached_tokens
    assert [got[f"again{i}"] for i in range(len(prompts))] == expected
    # Every full block of each prompt (but the one holding its last token) was reused, and that
    # one too in part when the first run's output filled it (partial reuse): all but the last
    # prompt token, which yields the first logits.
    for i, prompt in enumerate(prompts):
        num_computed_first = len(prompt) + len(expected[i]) - 1  # the last output is not fed
        last_block_full = ((len(prompt) - 1) // 16 + 1) * 16 <= num_computed_first
        want = len(prompt) - 1 if last_block_full else (len(prompt) - 1) // 16 * 16
        assert cached[f"again{i}"] == want, i
    recomputed = warm.stats.num_computed_tokens - computed_before
    assert recomputed < sum(len(p) for p in prompts) // 4


def test_memory_pressure_preempts_and_stays_exact(make_engine, prompts, expected):
    # 60 blocks of 16 = 960 tokens: the long prompt alone nearly fills the pool.
    engine = make_engine(num_blocks=60, max_num_batched_tokens=256)
    assert submit_all(engine, prompts) == expected
    assert engine.scheduler.num_preemptions > 0
