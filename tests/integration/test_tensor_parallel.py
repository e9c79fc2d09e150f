"""The engine at tensor-parallel size 2 (two ranks: this process and a follower process, gloo)
against size 1 and transformers on tiny random checkpoints (Llama, Qwen3, and Qwen3-MoE with its
experts split across the ranks): greedy, token for token, through
prefix-cache hits, a partly reused block and the host tier; dummy weights; a follower killed
mid-run."""

from __future__ import annotations

import random
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
    ("architecture", "num_kv_heads", "moe"),
    [
        ("llama", 2, {}),
        ("llama", 1, {}),
        ("qwen3", 2, {}),
        # a dense layer, then a sparse one whose 4 experts' columns are split across the ranks
        ("qwen3_moe", 2, {"mlp_only_layers": (0,), "norm_topk_prob": True}),
        # q/k/v bias split with their rows; a gated shared expert's columns split too
        ("qwen2_moe", 2, {}),
    ],
    ids=[
        "kv-split",
        "kv-replicated",
        "qwen3-qk-norm",
        "qwen3-moe-experts-split",
        "qwen2-moe-shared-expert-split",
    ],
)
def test_tp2_matches_tp1_and_transformers(tmp_path, architecture, num_kv_heads, moe):
    path = make_tiny_checkpoint(
        tmp_path, architecture=architecture, num_kv_heads=num_kv_heads, **moe
    )
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


def test_the_disk_tier_at_tp2_keeps_each_ranks_heads_and_checks_every_ranks_file(tmp_path):
    """The disk tier at TP 2: rank 0 keeps the bookkeeping, each rank writes its own heads of
    a block to its own file (rank 1 under disk_kv_path/rank1). A working set past the device
    and host pools hits from disk token-exact; after a clean stop and a restart every block
    comes back from disk, except where rank 1's file was corrupted: that block is checked
    on every rank, removed everywhere and recomputed, never loaded."""
    from kvtransfer.disk_blocks import SUFFIX

    path = make_tiny_checkpoint(tmp_path)  # 2 KV heads: one a rank
    rng = random.Random(4)
    batch = [[rng.randrange(1, 500) for _ in range(8 * 16 + 1)] for _ in range(5)]
    rank_block = 2 * 2 * 1 * 16 * 16 * 4  # layers x k|v x its head x positions x dim x fp32
    tiers = dict(
        num_blocks=10,
        host_kv_cache_bytes=2 * rank_block,
        max_num_seqs=1,
        disk_kv_cache_bytes=400 * (4096 + rank_block),
        disk_kv_path=str(tmp_path / "disk"),
    )
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)

    def serve(engine: Engine) -> tuple[list[list[int]], list[int]]:
        tokens, cached = [], []
        for i, prompt in enumerate(batch):
            engine.add_request(f"r{i}", prompt, params)
            got: list[int] = []
            while engine.has_unfinished_requests:
                for out in engine.step():
                    got.extend(out.new_token_ids)
                    if out.finished:
                        cached.append(out.num_cached_tokens)
            tokens.append(got)
        engine.check_integrity()
        engine.assert_no_leaks()
        return tokens, cached

    one = build_engine(model_path=str(path), num_blocks=64)
    want, _ = serve(one)
    engine = build_engine(model_path=str(path), tensor_parallel_size=2, **tiers)
    try:
        assert serve(engine)[0] == want
        again, cached = serve(engine)
        assert again == want
        disk = engine.kv.disk_tier
        assert disk is not None and disk.num_hit_blocks > 0 and cached[0] == 128
    finally:
        engine.shutdown()  # a clean stop: every cached block on disk, on both ranks
    rank0 = sorted(p.name for p in (tmp_path / "disk").glob(f"*/*{SUFFIX}"))
    rank1 = sorted((tmp_path / "disk" / "rank1").glob(f"*/*{SUFFIX}"))
    assert len(rank0) == 40 and [p.name for p in rank1] == rank0
    for file in rank1[::4]:  # a flipped payload byte in rank 1's heads only
        raw = bytearray(file.read_bytes())
        raw[-7] ^= 0x40
        file.write_bytes(bytes(raw))
    engine = build_engine(model_path=str(path), tensor_parallel_size=2, **tiers)
    try:
        got, cached = serve(engine)
        disk = engine.kv.disk_tier
        assert disk is not None
        assert got == want
        assert disk.num_bad_files > 0 and disk.num_hit_blocks > 0
        assert sum(cached) < 5 * 128  # the bad blocks and those after them recomputed
    finally:
        engine.shutdown()
    left = sorted(p.name for p in (tmp_path / "disk").glob(f"*/*{SUFFIX}"))
    assert sorted(p.name for p in (tmp_path / "disk" / "rank1").glob(f"*/*{SUFFIX}")) == left


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
