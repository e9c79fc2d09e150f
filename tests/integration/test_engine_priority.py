"""Priorities in the engine on a tiny random checkpoint: a higher-priority request preempts a
lower one for its blocks, and the preempted request resumes from the host tier (its full
blocks copied back, not recomputed), token for token the same as a run without preemption."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.engine import Engine
from engine.sampling.sampling_params import SamplingParams
from tests.conftest import build_engine, run_to_completion
from tests.factories import make_tiny_checkpoint

BLOCK = 16
BATCH_PROMPT = [i % 500 + 1 for i in range(150)]  # 10 full blocks with its first 10 outputs
CHAT_PROMPT = [(7 * i + 3) % 500 + 1 for i in range(250)]  # 16 blocks
BATCH = SamplingParams(max_tokens=24, temperature=0.0)
CHAT = SamplingParams(max_tokens=4, temperature=0.0)
FIRST = SamplingParams(max_tokens=1, temperature=0.0)  # a prefill worker's


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-prio"), seed=7)


@pytest.fixture
def make_tiny(checkpoint: Path) -> Iterator:
    engines: list[Engine] = []

    def factory(**overrides) -> Engine:
        engine = build_engine(model_path=str(checkpoint), **overrides)
        engines.append(engine)
        return engine

    yield factory
    for engine in engines:
        engine.assert_no_leaks()


def step_into(engine: Engine, got: dict[str, list[int]]) -> None:
    for out in engine.step():
        got.setdefault(out.req_id, []).extend(out.new_token_ids)


def test_a_preempted_request_resumes_token_exact_from_the_host_tier(make_tiny) -> None:
    reference = make_tiny(num_blocks=64)
    reference.add_request("batch", BATCH_PROMPT, BATCH)
    reference.add_request("chat", CHAT_PROMPT, CHAT)
    expected = run_to_completion(reference)

    # 20 blocks: the batch request holds 11 when chat (16) arrives, so chat preempts it and
    # its blocks evict the batch request's cached ones from the device.
    engine = make_tiny(num_blocks=20, host_kv_cache_bytes=16 << 20)
    batch = engine.add_request("batch", BATCH_PROMPT, BATCH, priority=-1)
    got: dict[str, list[int]] = {}
    while batch.num_output_tokens < 10:
        step_into(engine, got)
    num_full_blocks = batch.num_tokens // BLOCK  # in the prefix cache, so in the host tier too
    engine.add_request("chat", CHAT_PROMPT, CHAT, priority=5)
    while "chat" in engine.scheduler.requests:
        step_into(engine, got)
    assert engine.scheduler.num_priority_preemptions == 1 and batch.num_preemptions == 1
    snapshot = engine.snapshot()  # what status and /metrics report
    assert (snapshot.num_preemptions, snapshot.num_priority_preemptions) == (1, 1)
    assert len(got["batch"]) == 10  # chat ran alone until it finished
    host_hits_before = engine.kv.num_host_hit_blocks
    computed_before = engine.stats.num_computed_tokens
    while engine.has_unfinished_requests:
        step_into(engine, got)
    assert got == expected  # both, token for token
    host_hits = engine.kv.num_host_hit_blocks - host_hits_before
    # at most 5 of its blocks survive on the device beside chat's 15 cached full ones
    assert host_hits >= num_full_blocks - (20 - len(CHAT_PROMPT) // BLOCK) >= 5
    # resumed, not recomputed: only its last partial block and its new tokens were computed
    assert engine.stats.num_computed_tokens - computed_before < BLOCK + BATCH.max_tokens


def test_without_a_host_tier_the_preempted_request_is_recomputed_token_exact(make_tiny) -> None:
    engine = make_tiny(num_blocks=20)
    batch = engine.add_request("batch", BATCH_PROMPT, BATCH, priority=-1)
    got: dict[str, list[int]] = {}
    while batch.num_output_tokens < 10:
        step_into(engine, got)
    engine.add_request("chat", CHAT_PROMPT, CHAT, priority=5)
    while engine.has_unfinished_requests:
        step_into(engine, got)
    assert engine.scheduler.num_priority_preemptions == 1 and engine.kv.host_tier is None
    reference = make_tiny(num_blocks=64)
    reference.add_request("batch", BATCH_PROMPT, BATCH)
    reference.add_request("chat", CHAT_PROMPT, CHAT)
    assert got == run_to_completion(reference)


def prefill(engine: Engine, req_id: str, prompt: list[int]) -> tuple[int, list[int]]:
    """The prompt's first token and kept blocks, computed on a prefill engine."""
    engine.add_request(req_id, prompt, FIRST, keep_blocks=True)
    [out] = [o for o in run_steps(engine) if o.req_id == req_id]
    return out.new_token_ids[0], list(out.kept_block_ids)


def run_steps(engine: Engine) -> list:
    return [o for _ in range(100) if engine.has_unfinished_requests for o in engine.step()]


def hand_off(
    prefill_engine: Engine, decode: Engine, req_id: str, prompt: list[int], params, priority: int
) -> int | None:
    """One prefilled request's way into the decode engine (the KV copied as NIXL would read
    it); its first token, or None when the decode engine has no room for it now."""
    first, remote = prefill(prefill_engine, req_id, prompt)
    plan = decode.add_prefilled_request(req_id, prompt, first, params, priority=priority)
    if plan is not None:
        decode.kv_cache[list(plan.local_block_ids)] = prefill_engine.kv_cache[remote]
        decode.commit_kv(req_id)
    assert prefill_engine.release_blocks(req_id)
    return None if plan is None else first


@pytest.mark.parametrize("overlap", [False, True])
def test_a_prefilled_request_preempts_a_lower_one_that_resumes_from_the_host_tier(
    make_tiny, overlap: bool
) -> None:
    reference = make_tiny(num_blocks=64)
    reference.add_request("batch", BATCH_PROMPT, BATCH)
    reference.add_request("chat", CHAT_PROMPT, CHAT)
    expected = run_to_completion(reference)

    prefill_engine = make_tiny(num_blocks=64)
    # as in the test above; overlap: a step runs ahead of each one read
    decode = make_tiny(num_blocks=20, host_kv_cache_bytes=16 << 20, async_scheduling=overlap)
    got = {"batch": [hand_off(prefill_engine, decode, "batch", BATCH_PROMPT, BATCH, -1)]}
    batch = decode.scheduler.requests["batch"]
    while batch.num_output_tokens < 10:
        step_into(decode, got)
    num_full_blocks = batch.num_computed_tokens // BLOCK  # cached, so in the host tier too
    if overlap:  # batch's next step is in flight: chat waits for it, and no step runs ahead
        assert decode.run_ahead.in_flight is not None and decode.stats.num_steps_ahead > 5
        assert hand_off(prefill_engine, decode, "chat", CHAT_PROMPT, CHAT, 5) is None
        assert batch.num_preemptions == 0
        step_into(decode, got)
        assert decode.run_ahead.in_flight is None
        num_full_blocks = batch.num_computed_tokens // BLOCK
    # chat's 16 blocks do not fit beside batch's 11: batch is preempted for them at once
    got["chat"] = [hand_off(prefill_engine, decode, "chat", CHAT_PROMPT, CHAT, 5)]
    assert decode.loader.num_preemptions == 1 and batch.num_preemptions == 1
    assert decode.scheduler.num_priority_preemptions == 1
    host_hits_before = decode.kv.num_host_hit_blocks
    computed_before = decode.stats.num_computed_tokens
    while decode.has_unfinished_requests:
        step_into(decode, got)
    assert got == expected  # both, token for token
    # chat's 16 blocks leave 4 of batch's cached ones on the device: the rest come back
    assert decode.kv.num_host_hit_blocks - host_hits_before >= num_full_blocks - 4 >= 5
    # resumed, not recomputed: its last partial block, then decodes (chat's and its own)
    computed = decode.stats.num_computed_tokens - computed_before
    assert computed < BLOCK + BATCH.max_tokens + CHAT.max_tokens


def test_a_prefilled_request_preempts_no_equal_one_nor_in_vain(make_tiny) -> None:
    prefill_engine = make_tiny(num_blocks=64)
    decode = make_tiny(num_blocks=20, host_kv_cache_bytes=16 << 20)
    assert hand_off(prefill_engine, decode, "batch", BATCH_PROMPT, BATCH, 0) is not None
    for _ in range(10):
        decode.step()
    assert hand_off(prefill_engine, decode, "same", CHAT_PROMPT, CHAT, 0) is None  # equal
    long_prompt = [(3 * i + 1) % 500 + 1 for i in range(315)]  # all 20 blocks
    decode.add_request("pinned", [1, 2, 3], CHAT, priority=9)  # a block batch cannot free
    decode.step()
    assert hand_off(prefill_engine, decode, "long", long_prompt, CHAT, 5) is None  # in vain
    assert decode.loader.num_preemptions == 0 and decode.scheduler.num_preemptions == 0
    assert not decode.loader.loading and len(decode.scheduler.running) == 2
    run_to_completion(decode)
