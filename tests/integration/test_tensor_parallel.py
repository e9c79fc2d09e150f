"""The engine at tensor-parallel size 2 (two ranks: this process and a follower process, gloo)
against size 1 and transformers on tiny random checkpoints: greedy, token for token, through
prefix-cache hits, a partly reused block and the host tier; dummy weights; a follower killed
mid-run."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from engine.config import CacheConfig, EngineConfig, SpeculativeConfig
from engine.engine import Engine
from engine.llm import LLM
from engine.parallel.leader import RankLost
from engine.sampling.sampling_params import SamplingParams
from tests.conftest import build_engine, run_to_completion
from tests.factories import make_tiny_checkpoint, transformers_greedy

NEW_TOKENS = 8
PARAMS = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
LONG = [(7 * i + 3) % 500 + 1 for i in range(40)]  # 3 blocks of 16 with its output
# Waves run one after the other: the second evicts the first's cached blocks (into the host
# tier), the third hits them there, the fourth reuses part of a cached block (a block copy).
WAVES = [
    [[5, 17, 300, 42], LONG, [7]],
    [list(range(200, 380))],  # with its output, every block of the pool
    [[*LONG[:35], 1, 2, 3]],
    [[*LONG[:24], 9, 9, 9, 9]],
]
POOL = dict(num_blocks=12, max_num_batched_tokens=32, host_kv_cache_bytes=64 * 8192)


def run_waves(engine: Engine) -> tuple[list[list[int]], list[int]]:
    """Each wave's requests to completion; their tokens and cached prompt tokens, in order."""
    tokens, cached = [], []
    for w, wave in enumerate(WAVES):
        for i, prompt in enumerate(wave):
            engine.add_request(f"w{w}-{i}", prompt, PARAMS)
        done: dict[str, int] = {}
        got: dict[str, list[int]] = {}
        while engine.has_unfinished_requests:
            for out in engine.step():
                got.setdefault(out.req_id, []).extend(out.new_token_ids)
                done[out.req_id] = out.num_cached_tokens
        tokens += [got[f"w{w}-{i}"] for i in range(len(wave))]
        cached += [done[f"w{w}-{i}"] for i in range(len(wave))]
    return tokens, cached


@pytest.mark.parametrize(
    ("architecture", "num_kv_heads"),
    [("llama", 2), ("llama", 1), ("qwen3", 2)],
    ids=["kv-split", "kv-replicated", "qwen3-qk-norm"],
)
def test_tp2_matches_tp1_and_transformers(tmp_path, architecture, num_kv_heads):
    path = make_tiny_checkpoint(tmp_path, architecture=architecture, num_kv_heads=num_kv_heads)
    expected = transformers_greedy(path, [prompt for wave in WAVES for prompt in wave], NEW_TOKENS)
    results = {}
    for size in (1, 2):
        engine = build_engine(model_path=str(path), tensor_parallel_size=size, **POOL)
        try:
            results[size] = run_waves(engine)
            snapshot = engine.snapshot()
            engine.assert_no_leaks()
        finally:
            engine.shutdown()
        assert snapshot.num_host_hit_blocks > 0, size  # the third wave onloaded blocks
        assert snapshot.num_partial_reused_tokens > 0, size  # and copied a partial block
    tokens, cached = results[2]
    assert tokens == expected
    assert results[1] == results[2]
    assert cached[-2] >= 32  # the third wave's prompt: two full blocks from the host tier
    assert cached[-1] > 16  # the fourth's: a full block and part of the next


def test_dummy_weights_match_across_sizes(tmp_path):
    """Every rank draws the full random tensors and keeps its slices: the same model."""
    path = make_tiny_checkpoint(tmp_path, weights=False)
    cache = CacheConfig(num_blocks=64)
    config = EngineConfig(model=str(path), load_format="dummy", cache=cache)
    prompts = WAVES[0]
    one = LLM(config).generate(prompts, PARAMS)
    llm = LLM(config, tensor_parallel_size=2)
    try:
        two = llm.generate(prompts, PARAMS)
        llm.engine.assert_no_leaks()
    finally:
        llm.shutdown()
    assert [c.token_ids for c in two] == [c.token_ids for c in one]
    assert all(len(c.token_ids) == NEW_TOKENS for c in two)


def test_size_that_does_not_divide_the_heads_is_refused(tmp_path):
    path = make_tiny_checkpoint(tmp_path, weights=False)  # 4 heads, 2 KV heads
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 must divide .*num_heads 4"):
        Engine(EngineConfig(model=str(path), load_format="dummy", tensor_parallel_size=3))


def test_killed_follower_fails_the_engine_and_frees_its_blocks(tmp_path):
    path = make_tiny_checkpoint(tmp_path)
    engine = build_engine(
        model_path=str(path), tensor_parallel_size=2, tensor_parallel_timeout_s=20.0, num_blocks=64
    )
    try:
        engine.add_request("a", WAVES[0][1], PARAMS)
        engine.add_request("b", WAVES[0][0], PARAMS)
        assert engine.step()  # the prompts' first chunks run on both ranks
        assert engine.snapshot().num_free_blocks < 64
        assert engine.leader is not None
        follower = engine.leader.followers[0]
        follower.process.send_signal(signal.SIGKILL)
        follower.process.wait()
        with pytest.raises(RankLost, match=r"rank 1 \(exit code -9\) exited"):
            run_to_completion(engine)
        engine.assert_no_leaks()  # every request aborted, its blocks back
        engine.add_request("c", [1, 2, 3], PARAMS)
        with pytest.raises(RankLost, match="failed earlier"):
            engine.step()
        engine.assert_no_leaks()
    finally:
        engine.shutdown()


def test_ngram_verify_steps_match_across_sizes(tmp_path):
    """Speculative verify steps (several logits rows a request) run the same at TP 2."""
    path = make_tiny_checkpoint(tmp_path, vocab_size=64, seed=5)
    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=4, ngram_min=1, adaptive=False)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    results, accepted = {}, {}
    for size in (1, 2):
        engine = build_engine(
            model_path=str(path), tensor_parallel_size=size, speculative=ngram, num_blocks=64
        )
        try:
            engine.add_request("r", [9, 9, 9, 9, 9, 9], params)
            results[size] = run_to_completion(engine)
            accepted[size] = engine.snapshot().num_spec_accepted_tokens
            engine.assert_no_leaks()
        finally:
            engine.shutdown()
    assert results[2] == results[1]
    assert accepted[2] == accepted[1] > 0


def test_a_draft_model_drafts_on_rank_0_and_matches_across_sizes(tmp_path):
    """Draft-model speculation at TP 2: the draft (here the target's own checkpoint) runs on
    rank 0 alone at one rank, from its full weights (not rank 0's shard): its greedy drafts
    are the target's, so every one is accepted, and the tokens equal TP 1's."""
    path = make_tiny_checkpoint(tmp_path, vocab_size=64, seed=5)
    draft = SpeculativeConfig(
        method="draft", draft_model=str(path), num_speculative_tokens=3, adaptive=False
    )
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    results, counts = {}, {}
    for size in (1, 2):
        engine = build_engine(
            model_path=str(path), tensor_parallel_size=size, speculative=draft, num_blocks=64
        )
        try:
            engine.add_request("r", [9, 4, 33, 9, 4], params)
            results[size] = run_to_completion(engine)
            spec = engine.speculator
            counts[size] = (spec.num_drafted_tokens, spec.num_accepted_tokens)
            engine.assert_no_leaks()
            assert spec.draft_model is not None
            spec.draft_model.engine.assert_no_leaks()
            assert spec.draft_model.engine.config.tensor_parallel_size == 1
        finally:
            engine.shutdown()
    assert results[2] == results[1]
    assert counts[2] == counts[1]
    assert counts[2][0] == counts[2][1] > 0  # every draft accepted: it is the target's


def test_generate_cli_passes_tp_to_the_engine(tmp_path):
    path = make_tiny_checkpoint(tmp_path, weights=False)
    command = [sys.executable, "-m", "deploy.cli", "generate", "--model", str(path), "--tp", "3"]
    result = subprocess.run([*command, "hi"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert "tensor_parallel_size 3 must divide the model's num_heads 4" in result.stderr


def test_stuck_follower_fails_the_engine_after_the_timeout(tmp_path):
    """A rank that stops answering (SIGSTOP: alive, sockets open) fails the next collective
    once tensor_parallel_timeout_s has passed, not never."""
    path = make_tiny_checkpoint(tmp_path)
    engine = build_engine(
        model_path=str(path), tensor_parallel_size=2, tensor_parallel_timeout_s=3.0, num_blocks=64
    )
    try:
        assert engine.leader is not None
        follower = engine.leader.followers[0]
        follower.process.send_signal(signal.SIGSTOP)
        engine.add_request("a", WAVES[0][0], PARAMS)
        with pytest.raises(RankLost, match="no rank exited: one is stuck"):
            run_to_completion(engine)
        engine.assert_no_leaks()
    finally:
        engine.shutdown()  # kills it (a stopped process ends on SIGKILL)
    assert follower.exit_description() == "exit code -9"
