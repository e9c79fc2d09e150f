"""ModelConfig.from_hf_dict: the fields of the supported families' default configs pass, fields
that change the math in ways the engine does not run are refused by name and value, and the MoE
families' fields (Qwen3-MoE, Mixtral) parse and their architectures run on the decoder."""

from __future__ import annotations

from typing import Any

import pytest

from engine.config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.models.loader import read_model_config
from engine.models.moe import SparseMoe
from engine.models.registry import model_class
from tests.factories import make_tiny_checkpoint

CONFIG_CLASSES = ("LlamaConfig", "Qwen2Config", "Qwen3Config", "MistralConfig")


def hf_dict(config_class: str, **fields: Any) -> dict[str, Any]:
    """A transformers config's dict as save_pretrained writes config.json (tiny shape)."""
    import transformers

    shape = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    config = getattr(transformers, config_class)(**{**shape, **fields})
    out = config.to_dict()
    out["architectures"] = [config_class.removesuffix("Config") + "ForCausalLM"]
    return out


def qwen3_moe_dict(norm_topk_prob: bool = True) -> dict[str, Any]:
    """A tiny Qwen3-MoE config dict of 4 layers: 1 and 3 sparse (decoder_sparse_step 2), 3 dense
    again (mlp_only_layers)."""
    return hf_dict(
        "Qwen3MoeConfig",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=norm_topk_prob,
        decoder_sparse_step=2,
        mlp_only_layers=[3],
    )


@pytest.mark.parametrize("config_class", CONFIG_CLASSES)
def test_default_configs_of_supported_families_parse(config_class: str) -> None:
    config = ModelConfig.from_hf_dict(hf_dict(config_class), "tiny")
    assert config.num_layers == 4 and config.num_experts == 0 and config.moe_layers == ()
    assert config.qk_norm == (config_class == "Qwen3Config")
    assert model_class(config) is LlamaForCausalLM


def test_qwen3_head_dim_and_bias() -> None:
    config = ModelConfig.from_hf_dict(hf_dict("Qwen3Config", head_dim=32), "tiny")
    assert config.head_dim == 32 and config.num_heads * config.head_dim != config.hidden_size
    assert config.qk_norm and not config.attention_bias and not config.o_proj_bias


def test_mistral_sliding_window_is_kept() -> None:
    config = ModelConfig.from_hf_dict(hf_dict("MistralConfig", sliding_window=256), "tiny")
    assert config.sliding_window == 256  # the engine caps max_model_len to it


@pytest.mark.parametrize(
    "field, value, named",
    [
        ("attn_logit_softcapping", 50.0, "attn_logit_softcapping"),
        ("final_logit_softcapping", 30.0, "final_logit_softcapping"),
        ("use_sliding_window", True, "use_sliding_window"),
        ("layer_types", ["full_attention", "sliding_attention"], "layer_types"),
        ("hidden_act", "gelu", "hidden_act"),
        ("hidden_activation", "gelu_pytorch_tanh", "hidden_activation"),
        ("mlp_bias", True, "mlp_bias"),
        ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope_scaling.rope_type"),
        ("rope_scaling", {"type": "dynamic", "factor": 2.0}, "rope_scaling.type"),
        ("rope_parameters", {"rope_type": "longrope"}, "rope_parameters.rope_type"),
        (
            "rope_parameters",
            {"rope_type": "default", "partial_rotary_factor": 0.5},
            "rope_parameters.partial_rotary_factor",
        ),
        ("partial_rotary_factor", 0.25, "partial_rotary_factor"),
        (
            "rope_parameters",
            {"full_attention": {"rope_type": "default"}, "sliding_attention": {}},
            "rope_parameters",
        ),
    ],
)
def test_fields_that_change_the_math_are_refused_by_name(
    field: str, value: Any, named: str
) -> None:
    hf = {**hf_dict("Qwen3Config"), field: value}
    with pytest.raises(ValueError, match=f"config.json's {named}=") as refused:
        ModelConfig.from_hf_dict(hf, "tiny")
    shown = value[named.split(".")[1]] if "." in named else value
    assert f"{named}={shown!r} is not supported" in str(refused.value)
    assert str(refused.value).startswith("Qwen3ForCausalLM: ")


def test_refusal_names_the_value() -> None:
    hf = {**hf_dict("LlamaConfig"), "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    with pytest.raises(ValueError, match=r"rope_scaling\.rope_type='yarn'"):
        ModelConfig.from_hf_dict(hf, "tiny")


@pytest.mark.parametrize("kind", ["default", "linear", "llama3"])
def test_implemented_rope_types_pass(kind: str) -> None:
    rope = {"rope_type": kind, "factor": 2.0, "rope_theta": 5e5}
    config = ModelConfig.from_hf_dict({**hf_dict("LlamaConfig"), "rope_parameters": rope}, "t")
    assert config.rope_scaling.kind == kind and config.rope_theta == 5e5


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_qwen3_moe_config_parses_into_the_moe_fields(norm_topk_prob: bool) -> None:
    hf = qwen3_moe_dict(norm_topk_prob)
    config = ModelConfig.from_hf_dict(hf, "tiny")
    assert (config.num_experts, config.num_experts_per_tok) == (4, 2)
    assert config.moe_intermediate_size == 32 and config.intermediate_size == 128
    assert config.norm_topk_prob is norm_topk_prob
    assert config.moe_layers == (1,)  # every 2nd layer (1, 3), less the mlp-only layer 3
    assert config.shared_expert_intermediate_size == 0
    assert config.qk_norm
    # the hub's config.json spells the count num_experts (transformers 5 num_local_experts)
    hub = {k: v for k, v in hf.items() if k != "num_local_experts"} | {"num_experts": 4}
    assert ModelConfig.from_hf_dict(hub, "tiny").num_experts == 4


def test_mixtral_config_parses_into_the_moe_fields() -> None:
    hf = hf_dict("MixtralConfig", num_local_experts=4, num_experts_per_tok=2, intermediate_size=32)
    config = ModelConfig.from_hf_dict(hf, "tiny")
    assert (config.num_experts, config.num_experts_per_tok) == (4, 2)
    assert config.moe_intermediate_size == 32
    assert config.norm_topk_prob  # Mixtral always renormalizes its top-k weights
    assert config.moe_layers == (0, 1, 2, 3) and not config.qk_norm


def test_top_k_beyond_the_expert_count_is_refused() -> None:
    hf = hf_dict("MixtralConfig", num_local_experts=4, num_experts_per_tok=5)
    with pytest.raises(ValueError, match="num_experts_per_tok=5"):
        ModelConfig.from_hf_dict(hf, "tiny")


@pytest.mark.parametrize(
    "config_class, fields",
    [
        ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2)),
        ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    ],
)
def test_moe_architectures_run_on_the_decoder(config_class: str, fields: dict[str, Any]) -> None:
    config = ModelConfig.from_hf_dict(hf_dict(config_class, **fields), "tiny")
    assert model_class(config) is LlamaForCausalLM
    model = LlamaForCausalLM(config, 64)
    assert all(isinstance(layer.mlp, SparseMoe) for layer in model.layers)
    assert model.layers[0].mlp.float32_routing_weights is (config_class == "MixtralConfig")


@pytest.mark.parametrize("architecture", ["qwen3_moe", "mixtral"])
def test_the_factorys_moe_checkpoints_parse(architecture: str, tmp_path) -> None:
    """tests/factories.py's MoE configs (4 experts, top-2, experts 32 wide) as the engine reads
    them from disk."""
    folder = make_tiny_checkpoint(
        tmp_path, architecture=architecture, norm_topk_prob=True, weights=False
    )
    config = read_model_config(folder)
    assert (config.num_experts, config.num_experts_per_tok) == (4, 2)
    assert config.moe_intermediate_size == 32 and config.norm_topk_prob
    assert config.moe_layers == (0, 1)
    assert model_class(config) is LlamaForCausalLM


def test_a_moe_config_without_architectures_is_not_run_as_a_dense_llama() -> None:
    hf = hf_dict("MixtralConfig", num_local_experts=4, num_experts_per_tok=2)
    del hf["architectures"]
    config = ModelConfig.from_hf_dict(hf, "tiny")
    assert model_class(config) is LlamaForCausalLM  # the default architecture
    with pytest.raises(ValueError, match="num_experts=4"):
        LlamaForCausalLM(config, 64)
