"""The decoder with sparse MoE layers: dense and sparse layers mixed (mlp_only_layers) build the
right modules and projection lists, random (dummy) weights fill the router and experts, the
strict loader names a missing or extra expert tensor, and a quantized MoE model is refused by
name (experts run in the model's dtype only)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.config import ModelConfig
from engine.models import moe_kernels
from engine.models.llama import MLP, LlamaForCausalLM
from engine.models.loader import load_model, random_model, read_model_config
from engine.models.moe import SparseMoe
from engine.quant.config import Fp8Config
from tests.factories import make_tiny_checkpoint, rewrite_checkpoint
from tests.unit.test_fp8_checkpoint import write_fp8_checkpoint
from tests.unit.test_model_config import qwen3_moe_dict

CPU = torch.device("cpu")


def mixed_config() -> ModelConfig:
    """4 layers: 1 and 3 sparse (decoder_sparse_step 2), 3 dense again (mlp_only_layers)."""
    return ModelConfig.from_hf_dict(qwen3_moe_dict(), "tiny")


def test_dense_and_sparse_layers_mixed_build_the_right_modules() -> None:
    config = mixed_config()
    assert config.moe_layers == (1,)
    model = LlamaForCausalLM(config, 64)
    kinds = [type(layer.mlp) for layer in model.layers]
    assert kinds == [MLP, SparseMoe, MLP, MLP]
    dense, sparse = model.layers[0].mlp, model.layers[1].mlp
    assert dense.gate_up_proj.weight.shape == (2 * config.intermediate_size, config.hidden_size)
    assert sparse.experts_gate_up.shape == (4, 2 * 32, config.hidden_size)
    assert sparse.experts_down.shape == (4, config.hidden_size, 32)
    assert sparse.top_k == 2 and sparse.norm_topk_prob and not sparse.float32_routing_weights
    # the fused GEMVs' projection list holds the MoE layer's attention only
    assert [len(layer.projections()) for layer in model.layers] == [4, 2, 4, 4]
    assert len(model.plain_projections(torch.float32)) == 14
    model.use_fused_ops(True)
    assert model.layers[0].mlp.fused and not hasattr(sparse, "fused")


def test_random_weights_fill_the_router_and_experts() -> None:
    model = random_model(mixed_config(), 64, CPU, torch.float32, std=0.5)
    moe = model.layers[1].mlp
    for param in (moe.gate.weight, moe.experts_gate_up, moe.experts_down):
        assert 0.4 < param.std().item() < 0.6, param.shape
    q_size = model.layers[0].self_attn.q_size
    hidden = model(torch.tensor([1, 2, 3]), torch.arange(3), attn=_NoAttention(q_size))
    assert hidden.shape == (3, 64) and torch.isfinite(hidden).all()


class _NoAttention:
    """Attention's output as zeros (the MLPs alone make the hidden states)."""

    def __init__(self, q_size: int) -> None:
        self.q_size = q_size

    def forward_qkv(self, layer, qkv, positions, rope):
        return qkv.new_zeros(qkv.shape[0], self.q_size)


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("moe"), architecture="qwen3_moe")


def _load(folder: Path, quantization: str | None = None) -> torch.nn.Module:
    config = read_model_config(folder)
    return load_model(folder, config, 64, CPU, torch.float32, quantization=quantization)


def test_the_experts_load_from_the_per_expert_tensors(qwen3_moe: Path) -> None:
    model = _load(qwen3_moe)
    stored = load_file(qwen3_moe / "model.safetensors")
    moe = model.layers[1].mlp
    p = "model.layers.1.mlp."
    assert torch.equal(moe.gate.weight, stored[p + "gate.weight"])
    gate_up = torch.cat(
        [stored[p + "experts.2.gate_proj.weight"], stored[p + "experts.2.up_proj.weight"]]
    )
    assert torch.equal(moe.experts_gate_up[2], gate_up)
    assert torch.equal(moe.experts_down[3], stored[p + "experts.3.down_proj.weight"])


def test_a_missing_or_extra_expert_tensor_is_named(qwen3_moe: Path, tmp_path: Path) -> None:
    def drop(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        del tensors["model.layers.1.mlp.experts.3.down_proj.weight"]
        return tensors

    with pytest.raises(ValueError, match=r"missing tensor 'layers\.1\.mlp\.experts\.3\.down_proj"):
        _load(rewrite_checkpoint(qwen3_moe, tmp_path / "missing", drop))

    def add(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:  # a fifth expert
        return tensors | {"model.layers.0.mlp.experts.4.up_proj.weight": torch.zeros(32, 64)}

    with pytest.raises(ValueError, match=r"'layers\.0\.mlp\.experts\.4\.up_proj\.weight'"):
        _load(rewrite_checkpoint(qwen3_moe, tmp_path / "extra", add))


def test_a_quantized_moe_model_is_refused_by_name(qwen3_moe: Path, tmp_path: Path) -> None:
    fp8 = write_fp8_checkpoint(qwen3_moe, tmp_path / "fp8")
    with pytest.raises(ValueError, match="compressed-tensors quantization") as refused:
        _load(fp8)  # CPU would dequantize it: refused before
    assert "MoE" in str(refused.value) and "Qwen3MoeForCausalLM" in str(refused.value)
    with pytest.raises(ValueError, match=r"online quantization .*not supported"):
        _load(qwen3_moe, quantization="fp8")  # --quantization fp8
    with pytest.raises(ValueError, match="MoE model is not supported"):
        LlamaForCausalLM(mixed_config(), 64, Fp8Config("online", True, False))


@pytest.mark.parametrize("experts, top_k, max_tokens", [(128, 8, 8192), (8, 2, 2048), (4, 2, 100)])
def test_the_warm_up_meets_every_kernel_specialization_a_step_can(
    experts: int, top_k: int, max_tokens: int
) -> None:
    """Every (blocking, pair count a multiple of 16 or not) that some step of 1..max_tokens
    tokens meets is met by one of the warm-up's token counts; on CPU nothing runs."""
    moe = SparseMoe(16, 8, experts, top_k, True)

    def key(t: int) -> tuple:
        return moe_kernels.tile_for(t * top_k, experts), t * top_k % 16 == 0

    counts = moe.warm_up_token_counts(max_tokens)
    assert all(1 <= t <= max_tokens for t in counts)
    assert {key(t) for t in counts} == {key(t) for t in range(1, max_tokens + 1)}
    assert moe.warm_up(max_tokens) == []  # CPU: the torch reference, nothing to compile
    model = LlamaForCausalLM(mixed_config(), 64)
    assert model.warm_up_moe(512) == []
