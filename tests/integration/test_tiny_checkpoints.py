"""Tiny random HF checkpoints (Llama with llama3 rope, Qwen2 with qkv bias, Qwen3 with q/k norms
tied and untied, Mistral, sparse-MoE Qwen3-MoE with and without renormalized top-k weights,
Qwen2-MoE with its gated shared expert, and Mixtral, Gemma 3 with sliding-window layers) load
and run through the same path, and match transformers greedy token for token, in one engine
(then again through a prefix hit) and (dense Qwen3; Qwen3-MoE with a dense layer: Qwen3's
attention and MLP beside a sparse layer; Mixtral; Gemma 3) through a prefill worker, NIXL and a
decode worker."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from common.messages import GenerateRequest
from deploy.local_cluster import LocalCluster
from engine.config import CacheConfig, EngineConfig
from engine.sampling.sampling_params import SamplingParams
from tests.conftest import build_engine, run_to_completion
from tests.factories import make_tiny_checkpoint, transformers_greedy
from tests.integration.cluster_support import (
    cluster_spec,
    collect,
    tokens_of,
    wait_until_no_leaks,
)

VOCAB_SIZE = 512
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
CHECKPOINTS = {
    "llama3": dict(architecture="llama", rope_scaling=LLAMA3_ROPE),
    "qwen2": dict(architecture="qwen2", tie_embeddings=True),
    "mistral": dict(architecture="mistral"),
    # head_dim 32 with 4 heads: q is 128 wide over a hidden size of 64
    "qwen3": dict(architecture="qwen3", tie_embeddings=True, head_dim=32),
    "qwen3-untied": dict(architecture="qwen3", head_dim=32, seed=1),
    # sparse MoE (4 experts, top-2): layer 0 dense (mlp_only_layers), layer 1 sparse
    "qwen3-moe": dict(
        architecture="qwen3_moe", head_dim=32, norm_topk_prob=True, mlp_only_layers=(0,)
    ),
    "qwen3-moe-unnormed": dict(architecture="qwen3_moe", tie_embeddings=True, seed=2),
    "mixtral": dict(architecture="mixtral", seed=3),
    # a gated shared expert beside 4 routed ones (top-2, not renormalized), q/k/v bias; layer 0
    # dense
    "qwen2-moe": dict(architecture="qwen2_moe", mlp_only_layers=(0,), seed=4),
    # untied head, a window of 5, layers sliding, sliding, full (more below: GEMMA3)
    "gemma3-untied": dict(
        architecture="gemma3", num_layers=3, sliding_window=5, init_std=0.1, seed=1
    ),
}
# Gemma 3: layers sliding, sliding, full, sliding (the real 5:1 pattern shrunk); a window of 12
# (not a block's 16) that 40+ token prompts cross; the full layers' RoPE linearly scaled.
# init_std 0.1, not 0.3: with 0.3 the logits are so peaked that transformers' greedy tokens for
# these prompts are the same with windows 11, 12, 13 or none (an off-by-one would pass); with
# 0.1 each of those changes them, and the top-2 logit margin stays above 0.04 (no near-ties).
GEMMA3 = dict(
    architecture="gemma3",
    num_layers=4,
    sliding_window=12,
    init_std=0.1,
    tie_embeddings=True,
    rope_scaling={"rope_type": "linear", "factor": 8.0},
)
PROMPTS = [[5, 17, 300, 42], list(range(1, 200, 3)), [7]]
NEW_TOKENS = 12


@pytest.mark.parametrize("kind", list(CHECKPOINTS))
def test_tiny_random_checkpoint_matches_transformers(tmp_path, kind):
    make_tiny_checkpoint(tmp_path, **CHECKPOINTS[kind])
    assert (tmp_path / "config.json").is_file()
    prompts, new_tokens = PROMPTS, NEW_TOKENS
    again = [*prompts[1][:48], 9, 8, 7, 6, 5]  # the long prompt's first 3 blocks, then its own
    *expected, expected_again = transformers_greedy(tmp_path, [*prompts, again], new_tokens)
    engine = build_engine(model_path=str(tmp_path), num_blocks=64, max_num_batched_tokens=32)
    assert engine.tokenizer is None
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"t{i}", p, params)
    got = run_to_completion(engine)
    assert [got[f"t{i}"] for i in range(len(prompts))] == expected
    # then a prefix hit: the shared blocks come from the cache, the tokens stay exact
    engine.add_request("again", again, params)
    tokens, cached = [], 0
    while engine.has_unfinished_requests:
        for out in engine.step():
            tokens += out.new_token_ids
            cached = out.num_cached_tokens
    assert cached >= 48 and tokens == expected_again
    engine.assert_no_leaks()


@pytest.fixture(scope="module")
def gemma3_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("gemma3"), **GEMMA3)


GEMMA3_FIRST = list(range(1, 200, 3))  # 67 tokens
GEMMA3_PROMPTS = [GEMMA3_FIRST, [*GEMMA3_FIRST[:48], 9, 8, 7, 6, 5], [5, 17, 300, 42], [7]]
GEMMA3_NEW_TOKENS = 24


@pytest.fixture(scope="module")
def gemma3_expected(gemma3_checkpoint: Path) -> list[list[int]]:
    return transformers_greedy(gemma3_checkpoint, GEMMA3_PROMPTS, GEMMA3_NEW_TOKENS)


@pytest.mark.parametrize("chunk", [8, 32, 1024])
def test_gemma3_sliding_window_matches_transformers(
    gemma3_checkpoint: Path, gemma3_expected: list[list[int]], chunk: int
) -> None:
    """Gemma 3 through one engine: prefill chunks shorter than the window (8), longer (32) and
    whole prompts, decode 24 tokens past it, token-exact against transformers; the second
    prompt shares the first's leading blocks (a prefix hit, its chunks start past the window)."""
    prompts, new_tokens, expected = GEMMA3_PROMPTS, GEMMA3_NEW_TOKENS, gemma3_expected
    engine = build_engine(
        model_path=str(gemma3_checkpoint), num_blocks=64, max_num_batched_tokens=chunk
    )
    assert engine.model_config.layer_windows == (12, 12, None, 12)
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    engine.add_request("g0", prompts[0], params)
    assert run_to_completion(engine)["g0"] == expected[0]
    for i, p in enumerate(prompts[1:], start=1):
        engine.add_request(f"g{i}", p, params)
    got: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    while engine.has_unfinished_requests:
        for out in engine.step():
            got.setdefault(out.req_id, []).extend(out.new_token_ids)
            cached[out.req_id] = max(cached.get(out.req_id, 0), out.num_cached_tokens or 0)
    assert [got[f"g{i}"] for i in range(1, len(prompts))] == expected[1:]
    assert cached["g1"] >= 48  # the first prompt's 3 full blocks
    engine.assert_no_leaks()


def test_dummy_load_format_needs_only_config_json(tmp_path):
    """load_format="dummy" builds random weights of config.json's shape (speed runs)."""
    make_tiny_checkpoint(tmp_path, vocab_size=VOCAB_SIZE, weights=False)
    assert not list(tmp_path.glob("*.safetensors"))
    with pytest.raises(FileNotFoundError):
        build_engine(model_path=str(tmp_path), num_blocks=64)
    engine = build_engine(model_path=str(tmp_path), num_blocks=64, load_format="dummy")
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    engine.add_request("a", [5, 17, 300, 42], params)
    engine.add_request("b", [5, 17, 300, 42], params)
    got = run_to_completion(engine)
    assert len(got["a"]) == 5 and got["a"] == got["b"]
    assert all(0 <= t < VOCAB_SIZE for t in got["a"])
    engine.assert_no_leaks()
    with pytest.raises(ValueError, match="load_format"):
        build_engine(model_path=str(tmp_path), num_blocks=64, load_format="npz")


@pytest.fixture(scope="module")
def qwen3_moe_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3-MoE whose layer 0 is dense: Qwen3's q/k-normed attention and dense MLP, then a
    sparse MoE layer (both Qwen3 families in one cluster)."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), **CHECKPOINTS["qwen3-moe"])


@pytest.fixture(scope="module")
def qwen3_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Dense Qwen3 (Qwen3ForCausalLM), tied embeddings."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3-dense"), **CHECKPOINTS["qwen3"])


@pytest.fixture(scope="module")
def mixtral_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("mixtral"), **CHECKPOINTS["mixtral"])


def start_cluster(checkpoint: Path, loop: asyncio.AbstractEventLoop) -> LocalCluster:
    """One prefill and one decode worker of a tiny checkpoint (CPU, the embedded Ray)."""
    engine = EngineConfig(model=str(checkpoint), cache=CacheConfig(num_blocks=64))
    spec = cluster_spec(engine=engine, num_prefill=1, num_decode=1)
    return loop.run_until_complete(LocalCluster(spec).start(progress=lambda m: None))


def check_cluster_matches_transformers(
    checkpoint: Path, cluster: LocalCluster, loop: asyncio.AbstractEventLoop, name: str
) -> None:
    """Prefill worker -> NIXL -> decode worker, token-exact against transformers; a second
    prompt sharing the first's leading blocks finds them cached on the decode worker (fewer
    blocks pulled); no worker leaks a block."""
    first = list(range(1, 200, 3))  # 67 tokens: 4 full blocks of 16
    second = [*first[:48], 9, 8, 7, 6, 5]  # the first 3 blocks shared
    expected = transformers_greedy(checkpoint, [first, second], NEW_TOKENS)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)

    async def run() -> list[list]:
        runs = []
        for i, prompt in enumerate((first, second)):  # in turn: the second reuses the first's
            request = GenerateRequest(f"{name}-{i}", tuple(prompt), params)
            runs.append(await collect(cluster.backend, request))
        return runs

    runs = loop.run_until_complete(run())
    assert [tokens_of(deltas) for deltas in runs] == expected
    pulled = [next(d.transfer for d in deltas if d.transfer is not None) for deltas in runs]
    assert not any(t.recomputed for t in pulled)
    assert pulled[0].num_blocks >= len(first) // 16
    assert pulled[1].num_blocks < pulled[0].num_blocks  # the shared blocks were not pulled again
    loop.run_until_complete(wait_until_no_leaks(cluster))


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe", "mixtral", "gemma3"])
def test_through_the_cluster_matches_transformers(
    request: pytest.FixtureRequest, name: str, loop: asyncio.AbstractEventLoop
) -> None:
    """Dense Qwen3, Qwen3-MoE (with a dense layer), Mixtral, and Gemma 3's windowed layers
    across the transfer: the decode worker attends the pulled blocks with the same windows
    (prompts of 67 and 53 tokens, a window of 12). One cluster at a time (one controller per Ray
    cluster)."""
    checkpoint = request.getfixturevalue(f"{name}_checkpoint")
    cluster = start_cluster(checkpoint, loop)
    try:
        check_cluster_matches_transformers(checkpoint, cluster, loop, name)
    finally:
        loop.run_until_complete(cluster.close())
