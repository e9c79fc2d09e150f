"""Int8Linear (owns an int8 weight, its per-output-channel float32 scales and an optional bias)
and the pure helpers around it: reading compressed-tensors INT8 W8A8 tensors, fusing parts,
dequantizing (the CPU reference path) and per-token int8 activation quantization.

Forward: each input row is quantized symmetrically with its own scale (amax / 127, dynamic),
then one torch._int_mm (cuBLASLt's int8 GEMM, int32 accumulation) and the row and channel
scales are applied in float32. cuBLASLt wants more than 16 rows: fewer are padded with zero
rows (decode steps; shapes only, so CUDA graphs capture it). torch._int_mm runs on CPU too
(tests), but a model on CPU dequantizes at load instead (engine/models/loader.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import nn

INT8_MAX = 127.0
MIN_ROWS = 17  # torch._int_mm on CUDA takes more than 16 rows
_AMAX_FLOOR = 1e-12

TakeFn = Callable[[str], torch.Tensor]  # removes and returns a checkpoint tensor by name


class Int8Weight(NamedTuple):
    """int8 [N, K] and float32 [N, 1]: weight ~ weight_int8 * scale."""

    weight: torch.Tensor
    scale: torch.Tensor


def read_int8(take: TakeFn, module: str) -> Int8Weight:
    """compressed-tensors' int-quantized tensors of module: weight int8 [N, K], weight_scale
    (per channel [N, 1] or per tensor), and weight_zero_point when written (must be zero:
    symmetric)."""
    weight = take(module + ".weight")
    if weight.dtype != torch.int8 or weight.dim() != 2:
        raise ValueError(
            f"{module}.weight is {weight.dtype} {tuple(weight.shape)}, expected 2-D int8"
        )
    scale_name = module + ".weight_scale"
    scale = per_row_scale(take(scale_name), weight.shape[0], scale_name)
    try:
        zero_point = take(module + ".weight_zero_point")
    except (KeyError, ValueError):  # the loader's take raises ValueError naming it
        zero_point = None
    if zero_point is not None and bool(zero_point.ne(0).any()):
        raise ValueError(
            f"{module}.weight_zero_point is not zero; asymmetric INT8 is not supported"
        )
    return Int8Weight(weight, scale)


def per_row_scale(scale: torch.Tensor, num_rows: int, name: str) -> torch.Tensor:
    """A checkpoint's weight scale (per tensor: one element, or per channel: N) as float32
    [N, 1]; a per-tensor scale is broadcast over the rows (exact)."""
    scale = scale.float()
    if scale.numel() == 1:
        return scale.reshape(1, 1).expand(num_rows, 1).contiguous()
    if scale.numel() == num_rows:
        return scale.reshape(num_rows, 1).contiguous()
    raise ValueError(f"{name} has {scale.numel()} elements; expected 1 or {num_rows}")


def fuse_int8(parts: Sequence[Int8Weight]) -> Int8Weight:
    """Stack parts along the output channels; each row keeps its scale (exact)."""
    return Int8Weight(torch.cat([p.weight for p in parts]), torch.cat([p.scale for p in parts]))


def dequantize_int8(weight: Int8Weight) -> torch.Tensor:
    """The float32 weight [N, K] (the CPU reference path)."""
    return weight.weight.float() * weight.scale


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 [M, K], float32 [M, 1]), x ~ q * scale, scale = row amax / 127."""
    x32 = x.float()
    scale = x32.abs().amax(dim=-1, keepdim=True).clamp(min=_AMAX_FLOOR) / INT8_MAX
    return (x32 / scale).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


class Int8Linear(nn.Module):
    """y = x W^T (+ b) with W int8 [N, K] and weight_scale float32 [1, N]; activations
    quantized per token on the fly. Both dimensions must be multiples of 8 (cuBLASLt int8)."""

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        if in_features % 8 or out_features % 8:
            raise ValueError(
                f"INT8 linear layers need dimensions divisible by 8, got {in_features} -> "
                f"{out_features}"
            )
        self.in_features, self.out_features = in_features, out_features

        def fixed(*shape: int, dtype: torch.dtype) -> nn.Parameter:
            return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)

        self.weight = fixed(out_features, in_features, dtype=torch.int8)
        self.weight_scale = fixed(1, out_features, dtype=torch.float32)
        self.register_parameter("bias", fixed(out_features, dtype=torch.bfloat16) if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N] in x's dtype."""
        rows = x.reshape(-1, self.in_features)
        num_rows = rows.shape[0]
        q, scale = quantize_rows_int8(rows)
        if num_rows < MIN_ROWS:
            q = torch.cat([q, q.new_zeros(MIN_ROWS - num_rows, self.in_features)])
        acc = torch._int_mm(q, self.weight.t())[:num_rows]
        out = acc.float() * scale * self.weight_scale
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        """forward's math with float32 matmuls, for tests."""
        rows = x.reshape(-1, self.in_features)
        q, scale = quantize_rows_int8(rows)
        out = (q.float() * scale) @ (self.weight.float() * self.weight_scale.t()).t()
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, int8, dynamic per-token inputs"


def int8_linear_state(prefix: str, weight: Int8Weight) -> dict[str, torch.Tensor]:
    """The state-dict entries of the Int8Linear at prefix."""
    return {
        prefix + ".weight": weight.weight,
        prefix + ".weight_scale": weight.scale.reshape(1, -1),
    }
