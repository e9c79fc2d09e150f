"""The integer and FP4 quantization configs: AWQ, GPTQ and compressed-tensors INT8 map to
Int4Config / Int8Config; NVFP4 is refused as needing Blackwell; every other layout is refused
naming its field; a 4-bit layout the kernel cannot take is refused by tensor."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.quant.config import parse_quant_config, resolve_quantization
from engine.quant.int4 import Int4Weight, int4_linear_state
from engine.quant.int_config import Int4Config, Int8Config

AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
INT8 = {"num_bits": 8, "type": "int", "symmetric": True}


def _hf(qc: dict[str, Any]) -> dict[str, Any]:
    return {"quantization_config": qc}


def _ct(weights: dict[str, Any], inputs: dict[str, Any] | None, fmt: str = "int-quantized"):
    group = {"targets": ["Linear"], "weights": weights, "input_activations": inputs}
    return _hf({"quant_method": "compressed-tensors", "format": fmt, "config_groups": {"g": group}})


INT8_WEIGHTS = {**INT8, "strategy": "channel"}
INT8_TOKENS = {**INT8, "strategy": "token", "dynamic": True}
W4_GROUPS = {**INT8, "num_bits": 4, "strategy": "group", "group_size": 128, "actorder": None}
NVFP4 = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}


def test_public_layouts_parse() -> None:
    assert parse_quant_config(_hf(AWQ)) == Int4Config("awq", 128)
    awq_autoawq_names = {"quant_method": "awq", "w_bit": 4, "q_group_size": 64, "version": "GEMM"}
    assert parse_quant_config(_hf(awq_autoawq_names)) == Int4Config("awq", 64)
    assert parse_quant_config(_hf(GPTQ)) == Int4Config("gptq", 128, v1_zeros=True)
    v2_act_order = {**GPTQ, "checkpoint_format": "gptq_v2", "desc_act": True, "group_size": -1}
    assert parse_quant_config(_hf(v2_act_order)) == Int4Config("gptq", -1, False, True)
    assert parse_quant_config(_ct(INT8_WEIGHTS, INT8_TOKENS)) == Int8Config()
    w4a16 = _ct(W4_GROUPS, None, "pack-quantized")
    assert parse_quant_config(w4a16) == Int4Config("compressed-tensors", 128)
    w4_channel = {**W4_GROUPS, "strategy": "channel", "actorder": "group"}
    assert parse_quant_config(_ct(w4_channel, None, "pack-quantized")) == Int4Config(
        "compressed-tensors", -1, desc_act=True
    )
    per_tensor = {**INT8, "strategy": "tensor"}
    assert parse_quant_config(_ct(per_tensor, INT8_TOKENS, "naive-quantized")) == Int8Config()


REFUSED = {
    "nvfp4-ct-format": (
        _ct(NVFP4, NVFP4, "nvfp4-pack-quantized"),
        "quantization_config.format 'nvfp4-pack-quantized'",
    ),
    "nvfp4-ct-weights": (
        _ct(NVFP4, None, "pack-quantized"),
        "config_groups.g.weights 'float 4-bit'",
    ),
    "nvfp4-modelopt": (
        _hf({"quant_method": "modelopt", "quant_algo": "NVFP4"}),
        "quant_algo 'NVFP4'",
    ),
    "fp4-method": (_hf({"quant_method": "mxfp4"}), "quant_method 'mxfp4'"),
}
FIELDS = {
    "gptq-bits": (_hf({**GPTQ, "bits": 8}), r"quantization_config.bits 8 is not supported"),
    "awq-bits": (_hf({**AWQ, "bits": 3}), r"quantization_config.bits 3 is not supported"),
    "unknown": (_hf({"quant_method": "hqq"}), r"quantization_config.quant_method 'hqq' is not"),
    "awq-version": (_hf({**AWQ, "version": "gemv"}), r"quantization_config.version 'gemv'"),
    "awq-zero-point": (_hf({**AWQ, "zero_point": False}), r"quantization_config.zero_point"),
    "awq-modules": (
        _hf({**AWQ, "modules_to_not_convert": ["mlp"]}),
        r"modules_to_not_convert: only lm_head may stay unquantized, got 'mlp'",
    ),
    "gptq-format": (
        _hf({**GPTQ, "checkpoint_format": "marlin"}),
        r"quantization_config.checkpoint_format 'marlin' is not supported",
    ),
    "gptq-lm-head": (_hf({**GPTQ, "lm_head": True}), r"quantization_config.lm_head"),
    "gptq-dynamic": (_hf({**GPTQ, "dynamic": {"-:.*mlp": {}}}), r"quantization_config.dynamic"),
    "gptq-group": (_hf({**GPTQ, "group_size": 0}), r"quantization_config.group_size 0"),
    "gptq-desc-act": (_hf({**GPTQ, "desc_act": "yes"}), r"quantization_config.desc_act must be"),
    "ct-int4-format": (
        _ct({**INT8, "num_bits": 4, "strategy": "group", "group_size": 32}, None),
        r"quantization_config.format 'int-quantized' is not supported with int weights",
    ),
    "ct-int3": (
        _ct({**INT8, "num_bits": 3, "strategy": "group"}, None),
        r"config_groups.g.weights.num_bits 3",
    ),
    "ct-w4a8": (
        _ct(W4_GROUPS, INT8_TOKENS, "pack-quantized"),
        r"config_groups.g.input_activations: W4A8 is not supported",
    ),
    "ct-w4-asym": (
        _ct({**W4_GROUPS, "symmetric": False}, None, "pack-quantized"),
        r"config_groups.g.weights.symmetric: asymmetric 4-bit",
    ),
    "ct-int8-static": (
        _ct(INT8_WEIGHTS, {**INT8, "strategy": "tensor", "dynamic": False}),
        r"config_groups.g.input_activations.dynamic: only dynamic per-token",
    ),
    "ct-int8-asym": (
        _ct({**INT8_WEIGHTS, "symmetric": False}, INT8_TOKENS),
        r"config_groups.g.weights.symmetric",
    ),
    "ct-int8-fp8-inputs": (
        _ct(INT8_WEIGHTS, {**INT8_TOKENS, "type": "float"}),
        r"g.input_activations: float 8-bit is not supported with INT8 weights",
    ),
    "ct-int8-weight-only": (_ct(INT8_WEIGHTS, None), r"g.input_activations: INT8 weight-only"),
    "ct-int-pack-format": (
        _ct(INT8_WEIGHTS, INT8_TOKENS, "pack-quantized"),
        r"quantization_config.format 'pack-quantized' is not supported with int weights",
    ),
}


@pytest.mark.parametrize("config, message", list(REFUSED.values()), ids=list(REFUSED))
def test_nvfp4_is_refused_as_needing_blackwell(config, message) -> None:
    with pytest.raises(ValueError, match=message) as err:
        parse_quant_config(config)
    assert "Blackwell" in str(err.value) and "NVFP4" in str(err.value)


@pytest.mark.parametrize("config, message", list(FIELDS.values()), ids=list(FIELDS))
def test_unsupported_fields_are_named(config, message) -> None:
    with pytest.raises(ValueError, match=message):
        parse_quant_config(config)


def test_fp8_flag_on_an_integer_checkpoint_is_refused() -> None:
    with pytest.raises(ValueError, match="quantization 'fp8' needs a bf16 or FP8 checkpoint"):
        resolve_quantization("fp8", Int4Config("awq", 128))
    assert resolve_quantization(None, Int8Config()) == Int8Config()


def _weight(groups: torch.Tensor, num_outputs: int = 16) -> Int4Weight:
    num_groups = int(groups.max()) + 1
    codes = torch.randint(0, 16, (num_outputs, groups.numel()), dtype=torch.uint8)
    ones = torch.ones(num_outputs, num_groups)
    return Int4Weight(codes, ones, 8 * ones, groups)


def test_int4_layouts_the_kernel_cannot_take_are_refused() -> None:
    act_order = Int4Config("gptq", 32, desc_act=True)
    uneven = torch.cat([torch.zeros(40), torch.ones(24)]).long()  # groups of 40 and 24
    with pytest.raises(ValueError, match="g_idx does not split the input channels into groups"):
        int4_linear_state("m", _weight(uneven), act_order, kernel="cpu")
    shuffled = (torch.arange(64) // 32)[
        torch.randperm(64, generator=torch.Generator().manual_seed(0))
    ]
    with pytest.raises(ValueError, match="m: g_idx is not in input order but desc_act is false"):
        int4_linear_state("m", _weight(shuffled), Int4Config("gptq", 32), kernel="cpu")
    state = int4_linear_state("m", _weight(shuffled), act_order, kernel="cpu")
    assert torch.equal(shuffled[state["m.input_perm"]], torch.arange(64) // 32)
    with pytest.raises(ValueError, match="group_size 48 over 96 input channels does not map"):
        int4_linear_state("m", _weight(torch.arange(96) // 48), Int4Config("gptq", 48), "cpu")
    per_row = int4_linear_state(
        "m", _weight(torch.zeros(512).long()), Int4Config("gptq", -1), "cpu"
    )
    assert per_row["m.scales_and_zeros"].shape == (2, 16, 2)  # -1: kernel groups of 256
