"""The FP8 quantization-config parser: the public compressed-tensors and ModelOpt layouts map to
Fp8Config, everything else is refused naming its field; the flag resolves against the
checkpoint; EngineConfig refuses FP8 on CPU."""

from __future__ import annotations

import json
from typing import Any

import pytest

from engine.config import EngineConfig
from engine.quant.config import (
    ONLINE_FP8,
    Fp8Config,
    parse_quant_config,
    quantization_from_flag,
    read_quant_config,
    resolve_quantization,
)

CPU_ERROR = (
    "FP8 weights need a CUDA GPU with FP8 support (compute capability >= 8.9); "
    "this engine runs on cpu"
)


def _args(strategy: str, *, dynamic: bool = False, **extra: Any) -> dict[str, Any]:
    fp8 = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None}
    return {**fp8, "strategy": strategy, "dynamic": dynamic, "block_structure": None, **extra}


TOKEN = _args("token", dynamic=True)
CT = "compressed-tensors"


def compressed_tensors(
    weights: dict[str, Any] | None, inputs: dict[str, Any] | None, **top: Any
) -> dict[str, Any]:
    """config.json with a compressed-tensors quantization_config (llm-compressor's layout)."""
    group = {"targets": ["Linear"], "weights": weights, "input_activations": inputs}
    qc = {
        "quant_method": CT,
        "format": "float-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "config_groups": {"group_0": {**group, "output_activations": None}},
        **top,
    }
    return {"model_type": "llama", "quantization_config": qc}


def modelopt_file(algo: str = "FP8", exclude: list[str] | None = None) -> dict[str, Any]:
    """ModelOpt's hf_quant_config.json."""
    excluded = ["lm_head"] if exclude is None else exclude
    quantization = {"quant_algo": algo, "kv_cache_quant_algo": None, "exclude_modules": excluded}
    return {"producer": {"name": "modelopt", "version": "0.19.0"}, "quantization": quantization}


@pytest.mark.parametrize(
    "weights, inputs, want",
    [
        (_args("tensor"), _args("tensor"), Fp8Config(CT, False, True)),
        (_args("channel"), TOKEN, Fp8Config(CT, True, False)),
        (_args("tensor"), _args("tensor", dynamic=True), Fp8Config(CT, False, False)),
        (_args("channel"), _args("tensor"), Fp8Config(CT, True, True)),
    ],
    ids=["static-per-tensor", "dynamic-per-channel", "dynamic-per-tensor", "static-channel"],
)
def test_compressed_tensors_layouts(weights, inputs, want) -> None:
    assert parse_quant_config(compressed_tensors(weights, inputs)) == want


def test_modelopt_layouts() -> None:
    want = Fp8Config("modelopt", per_channel_weights=False, static_input_scales=True)
    assert parse_quant_config({"model_type": "llama"}, modelopt_file()) == want
    qc = {"quant_method": "modelopt", "quant_algo": "FP8", "exclude_modules": ["lm_head"]}
    in_config = {"quantization_config": qc}
    assert parse_quant_config(in_config) == want


def test_plain_checkpoint_has_no_scheme() -> None:
    assert parse_quant_config({"model_type": "llama"}) is None


def test_kv_cache_scales_are_not_read() -> None:
    """The KV cache follows --kv-cache-dtype; a checkpoint's KV scales do not refuse it."""
    scheme = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
    config = compressed_tensors(_args("channel"), TOKEN, kv_cache_scheme=scheme)
    assert parse_quant_config(config) == Fp8Config(CT, True, False)


HF_FP8_BLOCK = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128]}
REFUSED = {
    "int8-fp8-inputs": (
        compressed_tensors(_args("channel", type="int"), TOKEN),
        "format 'float-quantized' is not supported with int weights",
    ),
    "int4": (
        compressed_tensors(_args("group", num_bits=4, type="int"), None),
        "format 'float-quantized' is not supported with int weights",
    ),
    "block": (
        compressed_tensors(_args("block", block_structure=[128, 128]), TOKEN),
        "weights.strategy: block-wise FP8 scales are not supported yet",
    ),
    "hf-fp8-block": (
        {"quantization_config": HF_FP8_BLOCK},
        "weight_block_size: block-wise FP8 scales are not supported yet",
    ),
    "weight-only": (compressed_tensors(_args("channel"), None), "input_activations: weight-only"),
    "static-token": (
        compressed_tensors(_args("channel"), _args("token")),
        "static input scales must be per tensor",
    ),
    "ignore": (
        compressed_tensors(_args("tensor"), _args("tensor"), ignore=["lm_head", "layers.0.mlp"]),
        "ignore: only lm_head may stay unquantized, got 'layers.0.mlp'",
    ),
    "format": (
        compressed_tensors(_args("tensor"), _args("tensor"), format="pack-quantized"),
        "format 'pack-quantized' is not supported",
    ),
    "dynamic-weights": (
        compressed_tensors(_args("tensor", dynamic=True), _args("tensor")),
        "weights.dynamic: dynamic weight scales",
    ),
    "asymmetric": (
        compressed_tensors(_args("tensor", symmetric=False), _args("tensor")),
        "weights.symmetric: asymmetric",
    ),
    "gptq": ({"quantization_config": {"quant_method": "gptq"}}, "bits None is not supported"),
    "nvfp4": (
        {"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"}},
        "quant_algo 'NVFP4': NVFP4 .* need an NVIDIA Blackwell GPU",
    ),
}


@pytest.mark.parametrize("config, message", list(REFUSED.values()), ids=list(REFUSED))
def test_unsupported_layouts_are_refused_by_field(config, message) -> None:
    with pytest.raises(ValueError, match=message):
        parse_quant_config(config)


def test_more_than_one_group_is_refused() -> None:
    config = compressed_tensors(_args("tensor"), _args("tensor"))
    groups = config["quantization_config"]["config_groups"]
    groups["group_1"] = groups["group_0"]
    with pytest.raises(ValueError, match=r"config_groups: exactly one group"):
        parse_quant_config(config)


def test_modelopt_excluding_layers_is_refused() -> None:
    with pytest.raises(ValueError, match=r"quantization.exclude_modules: only lm_head"):
        parse_quant_config({}, modelopt_file(exclude=["lm_head", "model.layers.0.self_attn"]))


def test_read_quant_config_reads_the_folder(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert read_quant_config(tmp_path) is None
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(modelopt_file()))
    assert read_quant_config(tmp_path) == Fp8Config("modelopt", False, True)


def test_flag_resolves_against_the_checkpoint() -> None:
    checkpoint = Fp8Config(CT, False, True)
    assert resolve_quantization(None, None) is None
    assert resolve_quantization("fp8", None) == ONLINE_FP8
    assert resolve_quantization("fp8", checkpoint) == checkpoint  # explicit on FP8: fine
    assert resolve_quantization(None, checkpoint) == checkpoint
    with pytest.raises(ValueError, match="quantization must be one of"):
        resolve_quantization("int8", None)
    assert quantization_from_flag("none") is None
    assert quantization_from_flag("fp8") == "fp8"


def test_engine_config_refuses_fp8_on_cpu() -> None:
    with pytest.raises(ValueError) as err:
        EngineConfig(quantization="fp8")  # device "cpu" is the default
    assert str(err.value) == CPU_ERROR
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="int8", device="cuda")
    assert EngineConfig(quantization="fp8", device="cuda").quantization == "fp8"
    assert EngineConfig(quantization="fp8", device="auto").quantization == "fp8"  # load checks
