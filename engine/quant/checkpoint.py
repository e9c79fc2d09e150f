"""Turns a checkpoint's linear-layer tensors into quantized layers' state: Fp8Linear (an FP8
checkpoint's weights and scales, parts such as q/k/v fused along the output dimension, or plain
weights quantized at load), Int4Linear (AWQ, GPTQ) and Int8Linear (compressed-tensors INT8);
and dequantizes any of them into a plain float32 weight (the CPU reference path, and a layer
kept in the model's dtype). Owns no state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from engine.quant.config import Fp8Config, QuantScheme
from engine.quant.fp8 import (
    Fp8Weight,
    dequantize_weight,
    fuse_weights,
    linear_state,
    per_row_scale,
    quantize_weight,
)
from engine.quant.fp8_types import FP8_DTYPE
from engine.quant.int4 import Int4Weight, dequantize_int4, fuse_int4, int4_linear_state, read_int4
from engine.quant.int8 import dequantize_int8, fuse_int8, int8_linear_state, read_int8
from engine.quant.int_config import Int4Config

Take = Callable[[str], torch.Tensor]  # removes and returns a checkpoint tensor by name


def fp8_linear_tensors(
    take: Take, name: str, parts: Sequence[str], quant: Fp8Config, device: torch.device
) -> dict[str, torch.Tensor]:
    """The state of the Fp8Linear `name`, made of the checkpoint's modules `parts` (in order).

    Online: the parts' weights are concatenated on the device and quantized per channel.
    FP8 checkpoint: each part keeps its scales (a per-tensor scale broadcast over its rows, so
    the fused weight dequantizes to exactly the parts' concatenation); static input scales of
    the parts, which all see the same input, become their maximum (nothing clips).
    """
    if not quant.from_checkpoint:
        weight = torch.cat([take(part + ".weight").to(device) for part in parts])
        return linear_state(name, quantize_weight(weight), None)
    weight = fuse_weights([_checkpoint_weight(take, part) for part in parts])
    input_scale = None
    if quant.static_input_scales:
        scales = [take(part + ".input_scale").float().reshape(()) for part in parts]
        input_scale = torch.stack(scales).max()
    return linear_state(name, weight, input_scale)


def quantized_linear_tensors(
    take: Take, name: str, parts: Sequence[str], quant: QuantScheme, device: torch.device
) -> dict[str, torch.Tensor]:
    """The state of the quantized layer `name` (its scheme's kind), made of the checkpoint's
    modules `parts` (in order); a 4-bit weight is packed for its kernel on device."""
    if isinstance(quant, Fp8Config):
        return fp8_linear_tensors(take, name, parts, quant, device)
    if isinstance(quant, Int4Config):
        weight = fuse_int4([read_int4(take, part, quant) for part in parts], name)
        on_device = Int4Weight(*(t.to(device) for t in weight))
        return int4_linear_state(name, on_device, quant, kernel=device.type)
    return int8_linear_state(name, fuse_int8([read_int8(take, part) for part in parts]))


def dequantized_weight(take: Take, module: str, quant: QuantScheme) -> torch.Tensor:
    """The float32 weight [N, K] a quantized checkpoint module stands for (every tensor of it
    taken): the CPU reference path, independent of the GPU kernels."""
    if isinstance(quant, Int4Config):
        return dequantize_int4(read_int4(take, module, quant))
    if isinstance(quant, Fp8Config):
        weight = dequantize_weight(_checkpoint_weight(take, module))
        if quant.static_input_scales:  # activations stay in the model's dtype here
            take(module + ".input_scale")
        return weight
    return dequantize_int8(read_int8(take, module))


def plain_weight(take: Take, module: str) -> torch.Tensor:
    """The weight of a layer kept in the model's dtype (the LM head), dequantized (float32)
    when the checkpoint stores it in FP8."""
    weight = take(module + ".weight")
    if weight.dtype != FP8_DTYPE:
        return weight
    scale = per_row_scale(take(module + ".weight_scale"), weight.shape[0])
    return dequantize_weight(Fp8Weight(weight, scale))


def _checkpoint_weight(take: Take, module: str) -> Fp8Weight:
    weight = take(module + ".weight")
    if weight.dtype != FP8_DTYPE:
        raise ValueError(
            f"{module}.weight is {weight.dtype} in an FP8 checkpoint, expected {FP8_DTYPE}"
        )
    return Fp8Weight(weight, per_row_scale(take(module + ".weight_scale"), weight.shape[0]))
