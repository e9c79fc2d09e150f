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
