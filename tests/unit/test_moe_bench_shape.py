"""The bench's Qwen3-30B-A3B random shape reads as the engine's MoE config (30.5B parameters,
every layer sparse), and the MoE byte counts behind its rooflines: a batch-1 decode step reads
top-k of each layer's experts, and one layer's bytes follow the experts its tokens touch."""

from __future__ import annotations

import torch

from bench.lib.moe_timing import moe_layer_bytes
from bench.lib.random_models import weight_bytes, write_random_model
from engine.models.llama import LlamaForCausalLM
from engine.models.loader import read_model_config
from engine.models.moe import SparseMoe


def test_the_qwen3_30b_a3b_shape_builds_the_moe_decoder(tmp_path) -> None:
    config = read_model_config(write_random_model(tmp_path, "qwen3-30b-a3b", weights=False))
    assert config.architecture == "Qwen3MoeForCausalLM" and config.qk_norm
    assert (config.num_experts, config.num_experts_per_tok) == (128, 8)
    assert config.moe_intermediate_size == 768 and config.norm_topk_prob
    assert config.moe_layers == tuple(range(48)) and config.num_kv_heads == 4
    with torch.device("meta"):
        model = LlamaForCausalLM(config, 4096).to(torch.bfloat16)
    assert sum(p.numel() for p in model.parameters()) == 30_532_122_624
    every, per_step = weight_bytes(model), weight_bytes(model, read_per_decode_step=True)
    experts = 48 * 128 * 3 * 768 * 2048 * 2
    embed = 151936 * 2048 * 2
    assert every - per_step == experts * 120 // 128 + embed  # 8 of 128 experts, no embeddings


def test_a_layers_bytes_follow_the_experts_its_tokens_touch() -> None:
    moe = SparseMoe(16, 8, 4, 2, True)
    with torch.no_grad():
        for param in moe.parameters():
            param.normal_()
    one, many = torch.randn(1, 16), torch.randn(64, 16)
    expert = (2 * 8 * 16 + 16 * 8) * 4  # float32 gate/up and down
    router = 4 * 16 * 4
    assert moe_layer_bytes(moe, one) == (2, 2 * expert + router + 2 * 16 * 4)
    assert moe_layer_bytes(moe, many) == (4, 4 * expert + router + 2 * 64 * 16 * 4)
