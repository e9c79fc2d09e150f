"""Tensor-parallel sharding (engine/parallel/): the sizes refused and why, each rank's heads,
sharded projections equal to the full ones on random inputs, and the whole sharded model over
two real gloo ranks (two threads) equal to the unsharded one."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from engine.attention.base import AttentionMetadata, SeqSpan
from engine.attention.torch_backend import TorchAttention
from engine.config import CacheConfig, EngineConfig, ModelConfig, SpeculativeConfig
from engine.models.loader import random_model
from engine.parallel.ranks import free_address, join_group
from engine.parallel.sharding import shard_weights
from engine.parallel.tensor_parallel import (
    TensorParallel,
    check_tensor_parallel,
    rank_engine_config,
    rank_model_config,
    rank_shard,
)
from tests.factories import make_model_config


def tiny_config(**overrides) -> ModelConfig:
    # vocab_size odd: the last rank's vocabulary range is padded
    return make_model_config(**{"vocab_size": 511, "max_position_embeddings": 64, **overrides})


def offline_rank(rank: int, size: int = 2) -> TensorParallel:
    """A rank's place for the pure slicing functions, which run no collective (the groups
    stand in as plain objects)."""
    return TensorParallel(rank, size, group=object(), control=object())


@pytest.mark.parametrize(
    ("overrides", "size", "message"),
    [
        ({}, 3, "tensor_parallel_size 3 must divide the model's num_heads 4"),
        (
            {"num_heads": 6, "num_kv_heads": 3},
            2,
            "tensor_parallel_size 2 and the model's num_kv_heads 3",
        ),
        ({"intermediate_size": 130}, 4, "intermediate_size 130"),
        ({}, 0, "must be >= 1, got 0"),
        (
            {
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_layers": (0,),
                "moe_intermediate_size": 30,
            },
            4,
            "must divide the model's moe_intermediate_size 30",
        ),
        ({"architecture": "Gemma3ForCausalLM"}, 2, "Gemma 3 is not split"),
    ],
)
def test_sizes_that_cannot_split_the_model_are_refused(overrides, size, message):
    with pytest.raises(ValueError, match=message):
        check_tensor_parallel(tiny_config(**overrides), size)


def test_kv_heads_are_split_or_replicated():
    config = tiny_config()
    assert [rank_shard(config, offline_rank(r)).kv_heads for r in (0, 1)] == [
        range(0, 1),
        range(1, 2),
    ]
    one_kv = tiny_config(num_kv_heads=1)
    shards = [rank_shard(one_kv, offline_rank(r, 4)) for r in range(4)]
    assert [s.q_heads for s in shards] == [range(r, r + 1) for r in range(4)]
    assert [s.kv_heads for s in shards] == [range(0, 1)] * 4  # replicated on every rank
    local = rank_model_config(one_kv, offline_rank(3, 4))
    assert (local.num_heads, local.num_kv_heads) == (1, 1)


def full_weights(config: ModelConfig) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    shapes = {
        "layers.0.self_attn.qkv_proj.weight": (q + 2 * kv, h),
        "layers.0.self_attn.qkv_proj.bias": (q + 2 * kv,),
        "layers.0.self_attn.o_proj.weight": (h, q),
        "layers.0.self_attn.o_proj.bias": (h,),
        "layers.0.mlp.gate_up_proj.weight": (2 * i, h),
        "layers.0.mlp.down_proj.weight": (h, i),
        "layers.0.input_layernorm.weight": (h,),
        "embed_tokens.weight": (v, h),
        "lm_head.weight": (v, h),
    }
    return {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}


@pytest.mark.parametrize("num_kv_heads", [2, 1])
def test_sharded_projections_equal_the_full_ones(num_kv_heads):
    config = tiny_config(num_kv_heads=num_kv_heads)
    full = full_weights(config)
    ranks = [shard_weights(full, config, offline_rank(r)) for r in (0, 1)]
    x = torch.randn(5, config.hidden_size)
    p, d = "layers.0.", config.head_dim

    # column-parallel q|k|v: each rank's output is the full output's columns of its heads
    qkv = F.linear(x, full[p + "self_attn.qkv_proj.weight"], full[p + "self_attn.qkv_proj.bias"])
    q_full, k_full, v_full = qkv.split([4 * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
    for r, w in enumerate(ranks):
        shard = rank_shard(config, offline_rank(r))
        out = F.linear(x, w[p + "self_attn.qkv_proj.weight"], w[p + "self_attn.qkv_proj.bias"])
        q, k, v = out.split([2 * d, d, d], dim=-1)
        kv_cols = slice(shard.kv_heads.start * d, shard.kv_heads.stop * d)
        torch.testing.assert_close(q, q_full[:, 2 * r * d : 2 * (r + 1) * d])
        torch.testing.assert_close(k, k_full[:, kv_cols])
        torch.testing.assert_close(v, v_full[:, kv_cols])

    # row-parallel o_proj: the ranks' partial products sum to the full one, bias added once
    attn = torch.randn(5, 4 * d)
    o_full = F.linear(attn, full[p + "self_attn.o_proj.weight"], full[p + "self_attn.o_proj.bias"])
    assert p + "self_attn.o_proj.bias" not in ranks[1]
    o_sum = sum(
        F.linear(
            attn[:, 2 * r * d : 2 * (r + 1) * d],
            w[p + "self_attn.o_proj.weight"],
            w.get(p + "self_attn.o_proj.bias"),
        )
        for r, w in enumerate(ranks)
    )
    torch.testing.assert_close(o_sum, o_full, rtol=1e-4, atol=1e-4)  # summed in another order

    # the MLP: gate and up halves sliced separately, down's partial sums add up
    def mlp(w: dict[str, torch.Tensor]) -> torch.Tensor:
        gate, up = F.linear(x, w[p + "mlp.gate_up_proj.weight"]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, w[p + "mlp.down_proj.weight"])

    torch.testing.assert_close(mlp(ranks[0]) + mlp(ranks[1]), mlp(full), rtol=1e-4, atol=1e-4)

    # vocabulary: each rank's logits are its range, the last one padded past vocab_size
    logits = [F.linear(x, w["lm_head.weight"]) for w in ranks]
    assert logits[0].shape == logits[1].shape == (5, 256)
    gathered = torch.cat(logits, -1)[:, : config.vocab_size]
    torch.testing.assert_close(gathered, x @ full["lm_head.weight"].T)
    assert ranks[1]["embed_tokens.weight"][-1].abs().sum() == 0  # the padding row
    assert ranks[0][p + "input_layernorm.weight"] is full[p + "input_layernorm.weight"]


def forward(model: torch.nn.Module, config: ModelConfig, tp: TensorParallel) -> torch.Tensor:
    """One prefill of 20 tokens over a 2-block cache of the rank's KV heads -> its logits."""
    local = rank_model_config(config, tp)
    cache = torch.zeros(2, config.num_layers, 2, local.num_kv_heads, 16, config.head_dim)
    attention = TorchAttention(cache, local.num_heads, config.head_dim)
    n = 20
    slots = torch.tensor([[p // 16 for p in range(n)], [p % 16 for p in range(n)]])
    attention.plan(AttentionMetadata([SeqSpan(0, n, n, [0, 1])], slots[0], slots[1], 16))
    ids = torch.tensor([(37 * p) % config.vocab_size for p in range(n)])
    with torch.inference_mode():
        hidden = model(ids, torch.arange(n), attention)
        return model.compute_logits(hidden)


# a MoE layer (4 experts, top 2, a shared expert) after a dense one: each expert's columns split
MOE = dict(
    architecture="Qwen3MoeForCausalLM",
    num_experts=4,
    num_experts_per_tok=2,
    moe_layers=(1,),
    moe_intermediate_size=32,
    shared_expert_intermediate_size=16,
)


@pytest.mark.parametrize(
    ("num_kv_heads", "moe"), [(2, {}), (1, {}), (2, MOE)], ids=["kv-split", "kv-replicated", "moe"]
)
def test_sharded_model_over_two_gloo_ranks_equals_the_full_model(num_kv_heads, moe):
    config = tiny_config(num_kv_heads=num_kv_heads, o_proj_bias=True, attention_bias=True, **moe)
    expected = forward(random_model(config, 64, "cpu", torch.float32), config, TensorParallel())
    address = free_address()
    logits: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            tp = join_group(r, 2, address, torch.device("cpu"), timeout_s=30.0)
            model = random_model(config, 64, "cpu", torch.float32, tp=tp)
            logits[r] = forward(model, config, tp)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    # rank 0 gathers the whole vocabulary (the row-parallel sums add in another order)
    torch.testing.assert_close(logits[0], expected, rtol=1e-4, atol=1e-5)
    assert logits[1].shape == (20, 256)  # rank 1 keeps its slice


def test_a_rank_runs_host_leases_and_a_draft_model_but_refuses_overlapped_steps():
    """Host leases (every rank's own host tier) and draft-model speculation (rank 0 drafts)
    run at TP 2, eagerly; overlapped steps are refused, naming the field (FP8 weights too,
    but a CPU config refuses them before: GPU only)."""
    cache = CacheConfig(host_kv_cache_bytes=1 << 20, keep_on_host=True)
    draft = SpeculativeConfig(method="draft", draft_model="default")
    config = EngineConfig(cache=cache, speculative=draft, tensor_parallel_size=2)
    ranked = rank_engine_config(config)
    assert ranked.cache.keep_on_host and ranked.speculative.method == "draft"
    assert not ranked.cuda_graph and ranked.async_scheduling is False
    with pytest.raises(ValueError, match="async_scheduling is not supported"):
        rank_engine_config(EngineConfig(async_scheduling=True, tensor_parallel_size=2))
