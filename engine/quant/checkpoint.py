"""Turns a checkpoint's linear-layer tensors into Fp8Linear state: an FP8 checkpoint's weights
and scales (parts such as q/k/v fused along the output dimension), or plain weights quantized at
load; and dequantizes an FP8 tensor for a layer kept in the model's dtype. Owns no state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from engine.quant.config import Fp8Config
from engine.quant.fp8 import (
    Fp8Weight,
    dequantize_weight,
    fuse_weights,
    linear_state,
    per_row_scale,
    quantize_weight,
)
from engine.quant.fp8_types import FP8_DTYPE

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
