"""Reads the integer quantization configs of checkpoints users download (AWQ, GPTQ and
compressed-tensors W4A16, compressed-tensors INT8 W8A8) into frozen Int4Config / Int8Config,
and refuses NVFP4 and every other layout by naming its field; owns no state, no torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

NVFP4_ERROR = (
    "{where} {value!r}: NVFP4 (4-bit floating point) weights need an NVIDIA Blackwell GPU "
    "(compute capability >= 10.0), which kvrelay does not run on yet"
)
AWQ_VERSIONS = ("gemm",)  # AutoAWQ's WQLinear_GEMM layout
GPTQ_FORMATS = ("gptq", "gptq_v2")  # v1: zero points stored minus one; v2: as they are


@dataclass(frozen=True)
class Int4Config:
    """Weight-only 4-bit integer weights (W4A16), one float scale and zero point per group of
    group_size input channels (-1: one group per output row).

    method: "awq" (qweight [in, out/8], AWQ's interleaved nibble order), "gptq" (qweight
    [in/8, out], g_idx maps each input channel to its group) or "compressed-tensors"
    (pack-quantized: weight_packed [out, in/8] of codes offset by 8, symmetric).
    v1_zeros: GPTQ's original format (checkpoint_format "gptq") stores each zero point minus
    one; dequantization adds it back.
    desc_act: act-order (GPTQ's desc_act, compressed-tensors' actorder "group"): groups are not
    contiguous runs of input channels (g_idx).
    """

    method: str
    group_size: int
    v1_zeros: bool = False
    desc_act: bool = False

    @property
    def from_checkpoint(self) -> bool:
        return True


@dataclass(frozen=True)
class Int8Config:
    """compressed-tensors INT8 W8A8: int8 weights with one symmetric scale per output channel
    (a per-tensor scale is broadcast over the rows) and activations quantized per token on the
    fly (dynamic, symmetric)."""

    method: str = "compressed-tensors"

    @property
    def from_checkpoint(self) -> bool:
        return True


def parse_awq(qc: dict[str, Any], where: str) -> Int4Config:
    """AutoAWQ's quantization_config (quant_method "awq")."""
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise ValueError(f"{where}.bits {bits!r} is not supported (AWQ: 4 only)")
    version = str(qc.get("version", "gemm")).lower()
    if version not in AWQ_VERSIONS:
        raise ValueError(
            f"{where}.version {qc.get('version')!r} is not supported (AWQ: {AWQ_VERSIONS})"
        )
    if qc.get("zero_point", True) is not True:
        raise ValueError(f"{where}.zero_point {qc.get('zero_point')!r}: only zero_point true")
    group = _group_size(qc.get("group_size", qc.get("q_group_size")), f"{where}.group_size")
    _check_unconverted(qc.get("modules_to_not_convert"), f"{where}.modules_to_not_convert")
    return Int4Config("awq", group)


def parse_gptq(qc: dict[str, Any], where: str) -> Int4Config:
    """AutoGPTQ / GPTQModel's quantization_config (quant_method "gptq")."""
    bits = qc.get("bits")
    if bits != 4:
        raise ValueError(f"{where}.bits {bits!r} is not supported (GPTQ: 4 only)")
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in GPTQ_FORMATS:
        raise ValueError(f"{where}.checkpoint_format {fmt!r} is not supported ({GPTQ_FORMATS})")
    if qc.get("lm_head"):
        raise ValueError(f"{where}.lm_head: a quantized LM head is not supported")
    if qc.get("dynamic"):
        raise ValueError(f"{where}.dynamic: per-module overrides are not supported")
    _check_unconverted(qc.get("modules_to_not_convert"), f"{where}.modules_to_not_convert")
    desc_act = qc.get("desc_act", False)
    if not isinstance(desc_act, bool):
        raise ValueError(f"{where}.desc_act must be true or false, got {desc_act!r}")
    group = _group_size(qc.get("group_size"), f"{where}.group_size")
    return Int4Config("gptq", group, v1_zeros=fmt == "gptq", desc_act=desc_act)


def parse_compressed_int(group: dict[str, Any], where: str) -> Int4Config | Int8Config:
    """A compressed-tensors config group of int weights: W4A16 (pack-quantized, symmetric
    groups or channels) or INT8 W8A8 (per-channel weights, dynamic per-token activations),
    all symmetric."""
    weights = group.get("weights") or {}
    bits, strategy = weights.get("num_bits"), weights.get("strategy")
    if bits == 4:
        return _compressed_w4a16(group, weights, where)
    if bits != 8:
        raise ValueError(
            f"{where}.weights.num_bits {bits!r}: int {bits}-bit weights are not supported "
            "(compressed-tensors: W4A16, INT8 W8A8 and FP8)"
        )
    if strategy not in ("channel", "tensor"):
        raise ValueError(f"{where}.weights.strategy {strategy!r} is not supported (channel)")
    _symmetric_static_weights(weights, where, "INT8")
    inputs = group.get("input_activations")
    if not isinstance(inputs, dict):
        raise ValueError(f"{where}.input_activations: INT8 weight-only is not supported")
    if inputs.get("type") != "int" or inputs.get("num_bits") != 8:
        raise ValueError(
            f"{where}.input_activations: {inputs.get('type')} {inputs.get('num_bits')}-bit "
            "is not supported with INT8 weights (int 8-bit)"
        )
    if not inputs.get("dynamic") or inputs.get("strategy") not in ("token", "tensor"):
        raise ValueError(
            f"{where}.input_activations.dynamic: only dynamic per-token INT8 activations are "
            f"supported, got dynamic {inputs.get('dynamic')!r}, strategy "
            f"{inputs.get('strategy')!r}"
        )
    if inputs.get("symmetric", True) is not True:
        raise ValueError(f"{where}.input_activations.symmetric: asymmetric is not supported")
    return Int8Config()


def _symmetric_static_weights(weights: dict[str, Any], where: str, kind: str) -> None:
    """Refuse asymmetric weights (kind names them) and dynamic weight scales."""
    if weights.get("symmetric", True) is not True:
        raise ValueError(f"{where}.weights.symmetric: asymmetric {kind} is not supported")
    if weights.get("dynamic"):
        raise ValueError(f"{where}.weights.dynamic: dynamic weight scales are not supported")


def _compressed_w4a16(group: dict[str, Any], weights: dict[str, Any], where: str) -> Int4Config:
    fmt = group.get("format")
    if fmt is not None and fmt != "pack-quantized":
        raise ValueError(f"{where}.format {fmt!r}: 4-bit int weights are pack-quantized")
    if group.get("input_activations") is not None:
        raise ValueError(f"{where}.input_activations: W4A8 is not supported (W4A16 only)")
    _symmetric_static_weights(weights, where, "4-bit")
    strategy = weights.get("strategy")
    if strategy == "channel":
        group_size = -1
    elif strategy == "group":
        group_size = _group_size(weights.get("group_size"), f"{where}.weights.group_size")
    else:
        raise ValueError(f"{where}.weights.strategy {strategy!r} is not supported (group, channel)")
    actorder = weights.get("actorder")
    if actorder not in (None, False, "static", "weight", "group"):
        raise ValueError(f"{where}.weights.actorder {actorder!r} is not supported")
    return Int4Config("compressed-tensors", group_size, desc_act=actorder == "group")


def is_nvfp4(args: Any, fmt: Any) -> bool:
    """Whether a compressed-tensors group (its weights' args, its format) is NVFP4."""
    if isinstance(fmt, str) and "fp4" in fmt.lower():
        return True
    return isinstance(args, dict) and args.get("type") == "float" and args.get("num_bits") == 4


def refuse_nvfp4(where: str, value: Any) -> ValueError:
    return ValueError(NVFP4_ERROR.format(where=where, value=value))


def _group_size(value: Any, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or (value <= 0 and value != -1):
        raise ValueError(f"{where} {value!r} is not supported (a positive integer or -1)")
    return value


def _check_unconverted(names: Any, where: str) -> None:
    for name in names or []:
        if "lm_head" not in str(name):
            raise ValueError(f"{where}: only lm_head may stay unquantized, got {name!r}")
