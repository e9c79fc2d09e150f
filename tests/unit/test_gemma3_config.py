"""Gemma 3's config.json (model_type gemma3_text) in both forms transformers reads parses into
ModelConfig's per-layer windows, RoPE bases, softmax scale and activation; what the engine does
not run of Gemma 3 is refused by name (the multimodal checkpoint, bidirectional attention,
soft-capping, a scaled sliding-layer RoPE, quantized weights)."""

from __future__ import annotations

from typing import Any

import pytest

from engine.config import ModelConfig
from engine.models.gemma3 import Gemma3ForCausalLM
from engine.models.registry import model_class
from engine.quant.config import resolve_quantization
from tests.unit.test_model_config import hf_dict

LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]


def gemma3_dict(**fields: Any) -> dict[str, Any]:
    """Gemma3TextConfig's config.json (transformers 5: rope_parameters per layer type)."""
    shape = dict(head_dim=16, sliding_window=8, layer_types=LAYER_TYPES)
    out = hf_dict("Gemma3TextConfig", **{**shape, **fields})
    out["architectures"] = ["Gemma3ForCausalLM"]
    return out


def test_the_transformers_5_form_parses() -> None:
    config = ModelConfig.from_hf_dict(
        gemma3_dict(rope_scaling={"rope_type": "linear", "factor": 8.0}), "tiny"
    )
    assert config.layer_windows == (8, 8, None, 8)
    assert config.sliding_window is None  # per layer: max_model_len is not capped
    assert config.rope_theta == 1_000_000.0 and config.local_rope_theta == 10_000.0
    assert config.rope_scaling.kind == "linear" and config.rope_scaling.factor == 8.0
    assert config.attention_scale == 256**-0.5  # query_pre_attn_scalar, not head_dim
    assert config.hidden_act == "gelu_pytorch_tanh" and config.qk_norm
    assert config.tie_word_embeddings
    assert model_class(config) is Gemma3ForCausalLM


def test_the_hub_form_parses() -> None:
    """The hub's gemma-3 config.json: rope_theta, rope_local_base_freq, rope_scaling of the
    full layers and sliding_window_pattern instead of layer_types; defaults for what it omits."""
    hf = {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 7,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "rope_theta": 500_000.0,
        "rope_local_base_freq": 20_000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
    }
    config = ModelConfig.from_hf_dict(hf, "tiny")
    assert config.layer_windows == (512,) * 5 + (None, 512)
    assert config.rope_theta == 500_000.0 and config.local_rope_theta == 20_000.0
    assert config.rope_scaling.kind == "linear"
    assert config.attention_scale == 0.25
    assert config.tie_word_embeddings and config.hidden_act == "gelu_pytorch_tanh"
    assert config.rms_norm_eps == 1e-6


@pytest.mark.parametrize(
    "field, value, named",
    [
        ("use_bidirectional_attention", True, "use_bidirectional_attention"),
        ("final_logit_softcapping", 30.0, "final_logit_softcapping"),
        ("attn_logit_softcapping", 50.0, "attn_logit_softcapping"),
        ("hidden_activation", "gelu", "hidden_activation"),
        ("layer_types", ["chunked_attention"] * 4, "layer_types"),
        (
            "rope_parameters",
            {
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "linear", "factor": 2.0},
            },
            "rope_parameters.sliding_attention.rope_type",
        ),
        (
            "rope_parameters",
            {"full_attention": {"rope_type": "yarn", "factor": 4.0}, "sliding_attention": {}},
            "rope_parameters.full_attention.rope_type",
        ),
    ],
)
def test_what_is_not_run_is_refused_by_name(field: str, value: Any, named: str) -> None:
    hf = {**gemma3_dict(), field: value}
    with pytest.raises(ValueError, match=f"Gemma3ForCausalLM: config.json's {named}="):
        ModelConfig.from_hf_dict(hf, "tiny")


def test_the_multimodal_checkpoint_is_refused() -> None:
    hf = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "text_config": {"model_type": "gemma3_text", "hidden_size": 64},
        "vision_config": {},
    }
    with pytest.raises(ValueError, match="text-only") as refused:
        ModelConfig.from_hf_dict(hf, "tiny")
    assert "Gemma3ForConditionalGeneration" in str(refused.value)


def test_other_families_keep_their_refusals() -> None:
    """Sliding layers and the gelu-tanh MLP pass for Gemma 3 only."""
    layers = {**hf_dict("Qwen2Config"), "layer_types": ["sliding_attention"] * 4}
    with pytest.raises(ValueError, match="layer_types="):
        ModelConfig.from_hf_dict(layers, "tiny")
    gelu = {**hf_dict("LlamaConfig"), "hidden_act": "gelu_pytorch_tanh"}
    with pytest.raises(ValueError, match="hidden_act="):
        ModelConfig.from_hf_dict(gelu, "tiny")


def test_quantized_weights_are_refused() -> None:
    config = ModelConfig.from_hf_dict(gemma3_dict(), "tiny")
    quant = resolve_quantization("fp8", None, True)
    with pytest.raises(ValueError, match="unquantized weights only"):
        Gemma3ForCausalLM(config, 64, quant=quant)
