"""Reads a checkpoint's quantization config into a frozen scheme: FP8 (compressed-tensors or
NVIDIA ModelOpt) as Fp8Config, AWQ / GPTQ / compressed-tensors W4A16 and compressed-tensors
INT8 W8A8 through int_config.py; refuses NVFP4 and every other layout by naming its field;
owns no state, no torch.

The KV cache follows --kv-cache-dtype; the per-layer KV-cache scales a checkpoint may carry
(compressed-tensors' kv_cache_scheme, ModelOpt's kv_cache_quant_algo) are read from its tensors
by kv_scales.py and used when that cache is fp8.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from engine.quant.int_config import (
    Int4Config,
    Int8Config,
    is_nvfp4,
    parse_awq,
    parse_compressed_int,
    parse_gptq,
    refuse_nvfp4,
)

QUANTIZATIONS = ("fp8",)  # EngineConfig.quantization (None: as the checkpoint is)
QUANTIZATION_FLAGS = ("none", *QUANTIZATIONS)  # --quantization's choices
QUANTIZATION_HELP = (
    "fp8: quantize a bf16 checkpoint to FP8 at load (per-channel weight scales, per-token "
    "activation scales; CUDA GPUs of compute capability >= 8.9). FP8 checkpoints "
    "(compressed-tensors, ModelOpt) load as FP8 without it"
)
MIN_FP8_CAPABILITY = (8, 9)
_CT_FORMATS = ("float-quantized", "naive-quantized")
_CT_INT_FORMATS = ("int-quantized", "naive-quantized")


@dataclass(frozen=True)
class Fp8Config:
    """How a model's FP8 linear layers are made and scaled.

    method: "compressed-tensors" or "modelopt" (the checkpoint stores e4m3 weights and float
    scales), or "online" (bf16 weights quantized at load: --quantization fp8).
    per_channel_weights: the checkpoint has one weight scale per output channel, else one per
    tensor (in memory every layer keeps per-channel scales: a tensor's scale is broadcast over
    its rows, which is exact and lets fused q/k/v keep their parts' scales).
    static_input_scales: activations are quantized with the checkpoint's per-tensor
    input_scale; else with a scale per token computed on the fly (dynamic).
    fast_accum: cuBLASLt's FP8 GEMMs accumulate in Hopper's fast mode (Settings.fp8_fast_accum;
    False: exactly, ~5% slower GEMMs).
    """

    method: str
    per_channel_weights: bool
    static_input_scales: bool
    fast_accum: bool = True

    @property
    def from_checkpoint(self) -> bool:
        return self.method != "online"


QuantScheme = Fp8Config | Int4Config | Int8Config  # how a model's projections are quantized

ONLINE_FP8 = Fp8Config("online", per_channel_weights=True, static_input_scales=False)


def fp8_device_error(where: str) -> str:
    major, minor = MIN_FP8_CAPABILITY
    return (
        f"FP8 weights need a CUDA GPU with FP8 support (compute capability >= {major}.{minor}); "
        f"this engine runs on {where}"
    )


def quantization_from_flag(flag: str) -> str | None:
    """--quantization's value as EngineConfig.quantization ("none" is None)."""
    return None if flag == "none" else flag


def check_quantization(quantization: str | None) -> None:
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(
            f"quantization must be one of {QUANTIZATIONS} or None, got {quantization!r}"
        )


def resolve_quantization(
    quantization: str | None, checkpoint: QuantScheme | None, fast_accum: bool = True
) -> QuantScheme | None:
    """The scheme a model loads with: the checkpoint's own (an explicit "fp8" on an FP8
    checkpoint changes nothing; on an AWQ / GPTQ / INT8 one it is refused), else online FP8
    for "fp8", else None (plain weights); FP8 GEMMs accumulate fast or exactly as fast_accum
    says."""
    check_quantization(quantization)
    if quantization == "fp8" and isinstance(checkpoint, Int4Config | Int8Config):
        raise ValueError(
            f"quantization 'fp8' needs a bf16 or FP8 checkpoint; this one is already quantized "
            f"({checkpoint.method}, {type(checkpoint).__name__})"
        )
    scheme = checkpoint or (ONLINE_FP8 if quantization == "fp8" else None)
    if isinstance(scheme, Fp8Config):
        return replace(scheme, fast_accum=fast_accum)
    return scheme


def read_quant_config(folder: Path) -> QuantScheme | None:
    """The quantization scheme of a checkpoint folder (config.json, ModelOpt's
    hf_quant_config.json)."""
    hf = json.loads((folder / "config.json").read_text())
    modelopt = folder / "hf_quant_config.json"
    return parse_quant_config(hf, json.loads(modelopt.read_text()) if modelopt.is_file() else None)


def parse_quant_config(
    hf_config: dict[str, Any], hf_quant_config: dict[str, Any] | None = None
) -> QuantScheme | None:
    """config.json's quantization_config (or ModelOpt's hf_quant_config.json) -> its scheme;
    None when the checkpoint is not quantized. A ValueError names the first unsupported field."""
    qc = hf_config.get("quantization_config")
    if qc is None:
        if hf_quant_config is None:
            return None
        return _modelopt(hf_quant_config, "hf_quant_config.json")
    where = "quantization_config"
    if not isinstance(qc, dict):
        raise ValueError(f"{where} must be an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(qc, where)
    if method == "modelopt":
        return _modelopt(qc, where)
    if method == "awq":
        return parse_awq(qc, where)
    if method == "gptq":
        return parse_gptq(qc, where)
    if isinstance(method, str) and "fp4" in method.lower():
        raise refuse_nvfp4(f"{where}.quant_method", method)
    if method == "fp8" and qc.get("weight_block_size"):
        raise ValueError(f"{where}.weight_block_size: block-wise FP8 scales are not supported yet")
    raise ValueError(
        f"{where}.quant_method {method!r} is not supported; kvrelay loads AWQ and GPTQ (4-bit), "
        "compressed-tensors (FP8, INT8) and ModelOpt (FP8) checkpoints, or quantizes bf16 "
        "with --quantization fp8"
    )


def _compressed_tensors(qc: dict[str, Any], where: str) -> QuantScheme:
    groups = qc.get("config_groups") or {}
    for name, group in groups.items():
        for fmt, field in (
            (qc.get("format"), where),
            (group.get("format"), f"{where}.config_groups.{name}"),
        ):
            if is_nvfp4(None, fmt):
                raise refuse_nvfp4(f"{field}.format", fmt)
        if is_nvfp4(group.get("weights"), None):
            raise refuse_nvfp4(f"{where}.config_groups.{name}.weights", "float 4-bit")
    _check_ignore(qc.get("ignore") or [], f"{where}.ignore")
    if len(groups) != 1:
        raise ValueError(
            f"{where}.config_groups: exactly one group is supported, got {len(groups)}"
        )
    ((name, group),) = groups.items()
    top_format = qc.get("format")
    where_top, where = where, f"{where}.config_groups.{name}"
    targets = list(group.get("targets") or [])
    if targets != ["Linear"]:
        raise ValueError(f"{where}.targets: only ['Linear'] is supported, got {targets!r}")
    weights = group.get("weights")
    if isinstance(weights, dict) and weights.get("type") == "int":
        formats = _CT_INT_FORMATS if weights.get("num_bits") != 4 else ("pack-quantized",)
        for fmt, field in ((top_format, where_top), (group.get("format"), where)):
            if fmt is not None and fmt not in formats:
                raise ValueError(
                    f"{field}.format {fmt!r} is not supported with int weights "
                    f"({', '.join(formats)})"
                )
        if group.get("output_activations") is not None:
            raise ValueError(f"{where}.output_activations: output quantization is not supported")
        return parse_compressed_int(group, where)
    _check_format(top_format, f"{where_top}.format")
    _check_format(group.get("format"), f"{where}.format")
    if group.get("output_activations") is not None:
        raise ValueError(f"{where}.output_activations: output quantization is not supported")
    per_channel = _weight_strategy(group.get("weights"), f"{where}.weights")
    static = _input_strategy(group.get("input_activations"), f"{where}.input_activations")
    return Fp8Config("compressed-tensors", per_channel, static)


def _check_format(fmt: Any, where: str) -> None:
    if fmt is not None and fmt not in _CT_FORMATS:
        raise ValueError(f"{where} {fmt!r} is not supported (FP8 checkpoints are {_CT_FORMATS})")


def _check_fp8(args: dict[str, Any], where: str) -> None:
    bits, kind = args.get("num_bits"), args.get("type")
    if bits != 8 or kind != "float":
        raise ValueError(
            f"{where}: {kind} {bits}-bit is not supported (only FP8: num_bits 8, type float)"
        )
    if args.get("symmetric", True) is False:
        raise ValueError(f"{where}.symmetric: asymmetric FP8 is not supported")


def _weight_strategy(weights: Any, where: str) -> bool:
    """True for per-channel weight scales, False for per-tensor."""
    if not isinstance(weights, dict):
        raise ValueError(f"{where}: missing; only FP8 weight quantization is supported")
    _check_fp8(weights, where)
    strategy = weights.get("strategy")
    if strategy == "block" or weights.get("block_structure"):
        raise ValueError(f"{where}.strategy: block-wise FP8 scales are not supported yet")
    if strategy not in ("tensor", "channel"):
        raise ValueError(f"{where}.strategy {strategy!r} is not supported (tensor or channel)")
    if weights.get("dynamic"):
        raise ValueError(f"{where}.dynamic: dynamic weight scales are not supported")
    return strategy == "channel"


def _input_strategy(inputs: Any, where: str) -> bool:
    """True for a static per-tensor input scale, False for dynamic scales (run per token)."""
    if inputs is None:
        raise ValueError(f"{where}: weight-only FP8 (no activation quantization) is not supported")
    if not isinstance(inputs, dict):
        raise ValueError(f"{where} must be an object, got {type(inputs).__name__}")
    _check_fp8(inputs, where)
    strategy = inputs.get("strategy")
    if inputs.get("dynamic"):
        if strategy not in ("tensor", "token"):
            raise ValueError(f"{where}.strategy {strategy!r} is not supported (tensor or token)")
        return False  # dynamic per tensor runs per token: finer, and the same GEMM
    if strategy != "tensor":
        raise ValueError(f"{where}.strategy {strategy!r}: static input scales must be per tensor")
    return True


def _modelopt(qc: dict[str, Any], where: str) -> Fp8Config:
    if isinstance(qc.get("quantization"), dict):  # hf_quant_config.json nests it
        qc, where = qc["quantization"], f"{where}.quantization"
    algo = qc.get("quant_algo")
    if isinstance(algo, str) and "FP4" in algo.upper():
        raise refuse_nvfp4(f"{where}.quant_algo", algo)
    if algo != "FP8":
        raise ValueError(
            f"{where}.quant_algo {algo!r} is not supported (only 'FP8': per-tensor scales)"
        )
    key = "exclude_modules" if "exclude_modules" in qc else "ignore"
    _check_ignore(qc.get(key) or [], f"{where}.{key}")
    return Fp8Config("modelopt", per_channel_weights=False, static_input_scales=True)


def _check_ignore(names: list[str], where: str) -> None:
    """Only the LM head may stay unquantized (as in the public checkpoints); an FP8 LM head is
    dequantized at load, since kvrelay keeps it in the model's dtype."""
    for name in names:
        if "lm_head" not in str(name):
            raise ValueError(f"{where}: only lm_head may stay unquantized, got {name!r}")
