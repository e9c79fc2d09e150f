"""Fp8Linear (owns an e4m3 weight, its per-output-channel float32 scales and an optional static
input scale) and the pure FP8 helpers around it: weight quantization, dequantization, fusing
quantized parts, per-token activation quantization, and the device check.

Forward: the input is quantized per row (one Triton kernel on CUDA; its own amax / 448, or the
checkpoint's static scale for every row), then one torch._scaled_mm (cuBLASLt, row-wise scales:
scale_a [M, 1], scale_b [1, N], both float32) writes bf16. The input may come already quantized
(QuantizedRows, from the kernel that made it: fp8_fused.py). cuBLASLt accumulates in Hopper's
fast FP8 mode (as vLLM's and TensorRT-LLM's FP8 GEMMs do) unless the layer was made with
fast_accum False (Settings.fp8_fast_accum: exact accumulation, ~5% slower GEMMs). Up to
GEMV_MAX_ROWS rows (decode steps of a few sequences) Triton kernels that read the e4m3 weight
once at close to the HBM rate take over: quantized rows multiply as e4m3 on tensor cores
(fp8_dot_rows.py; the fused kernels quantize such rows too), a bf16 input (o_proj's, from
attention) multiplies the weight dequantized in registers (fp8_gemv.py). Shapes only, no host
syncs, so the decode CUDA graphs capture each.

Inputs of more rows than that and at most DEFER_MAX_ROWS (decode batches) run cuBLASLt's
per-tensor FP8 GEMM with unit scales instead, and forward_deferred hands back ScaledRows: the
unscaled product and the row and column scales, which the kernel that reads it applies
(fp8_fused.py, rope_kv_kernel.py). On the H200 that GEMM was 12-15% faster than the row-scaled
one at 232-768 rows and slower at 16,384; the 8B offline run went from 58.3 to 57.1 s with it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import nn

from engine.quant.config import MIN_FP8_CAPABILITY, Fp8Config, fp8_device_error
from engine.quant.fp8_dot_rows import fp8_dot_rows  # imports triton on first use
from engine.quant.fp8_fused import quantize_rows_cuda  # imports triton on first use
from engine.quant.fp8_gemv import GEMV_MAX_ROWS, fp8_gemv  # imports triton on first use
from engine.quant.fp8_types import AMAX_FLOOR, FP8_DTYPE, FP8_MAX, QuantizedRows, ScaledRows
from engine.quant.int4 import Int4Linear
from engine.quant.int8 import Int8Linear
from engine.quant.int_config import Int4Config, Int8Config

SCALE_NAMES = ("weight_scale", "input_scale")  # Fp8Linear's float32 parameters
DEFER_MAX_ROWS = 1024  # up to here the per-tensor GEMM won (232, 768 rows); 16,384 lost


class Fp8Weight(NamedTuple):
    """A quantized weight: e4m3 [N, K] and float32 [N, 1], weight ~ weight_fp8 * scale."""

    weight: torch.Tensor
    scale: torch.Tensor


def check_fp8_device(device: torch.device) -> None:
    """Refuse FP8 weights where torch._scaled_mm cannot run them (CPU, GPUs before Ada)."""
    if device.type != "cuda":
        raise ValueError(fp8_device_error(str(device)))
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_FP8_CAPABILITY:
        major, minor = capability
        raise ValueError(fp8_device_error(f"{device} (compute capability {major}.{minor})"))


def quantize_weight(weight: torch.Tensor) -> Fp8Weight:
    """Per output channel: each row's scale is its amax / 448 (round to nearest, no clipping)."""
    w32 = weight.float()
    scale = w32.abs().amax(dim=1, keepdim=True).clamp(min=AMAX_FLOOR) / FP8_MAX
    return Fp8Weight((w32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale)


def dequantize_weight(weight: Fp8Weight) -> torch.Tensor:
    """The float32 weight [N, K] a quantized one stands for."""
    return weight.weight.float() * weight.scale


def per_row_scale(scale: torch.Tensor, num_rows: int) -> torch.Tensor:
    """A checkpoint's weight scale (one per tensor: [] / [1], or per channel: [N] / [N, 1])
    as float32 [N, 1]; a per-tensor scale is broadcast over the rows (exact)."""
    scale = scale.float()
    if scale.numel() == 1:
        return scale.reshape(1, 1).expand(num_rows, 1).contiguous()
    if scale.numel() == num_rows:
        return scale.reshape(num_rows, 1).contiguous()
    raise ValueError(
        f"weight scale of shape {tuple(scale.shape)} fits neither one per tensor nor one per "
        f"output channel of {num_rows} rows"
    )


def fuse_weights(parts: Sequence[Fp8Weight]) -> Fp8Weight:
    """Stack quantized parts (q/k/v, gate/up) along the output dimension; each row keeps its
    own scale, so the fused weight dequantizes to exactly the parts' concatenation."""
    return Fp8Weight(torch.cat([p.weight for p in parts]), torch.cat([p.scale for p in parts]))


def quantize_rows_torch(
    x: torch.Tensor, static_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, 1]) with x ~ q * scale: each row's amax /
    448 (dynamic, per token), or static_scale (a one-element float32 tensor) for every row."""
    x32 = x.float()
    if static_scale is None:
        scale = x32.abs().amax(dim=-1, keepdim=True).clamp(min=AMAX_FLOOR) / FP8_MAX
    else:
        scale = static_scale.reshape(1, 1).expand(x.shape[0], 1).contiguous()
    return (x32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_rows(
    x: torch.Tensor, static_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows_torch's result, as one Triton kernel on CUDA."""
    if x.is_cuda:
        return quantize_rows_cuda(x, static_scale)
    return quantize_rows_torch(x, static_scale)


@functools.cache
def unit_scale(device: torch.device) -> torch.Tensor:
    """A float32 1.0 on device (one per device, made on first use, which must come before any
    graph capture): both scales of the unscaled GEMM."""
    return torch.ones((), dtype=torch.float32, device=device)


def defers_scales(layer: nn.Module, rows: torch.Tensor | QuantizedRows) -> bool:
    """Whether layer's output for these rows may be ScaledRows: an Fp8Linear without bias, on
    CUDA, a decode batch's size (more rows than its GEMV takes, at most DEFER_MAX_ROWS)."""
    x = rows.q if isinstance(rows, QuantizedRows) else rows
    return (
        isinstance(layer, Fp8Linear)
        and layer.bias is None
        and x.is_cuda
        and x.shape[0] <= DEFER_MAX_ROWS
        and not takes_gemv(x)
    )


def takes_gemv(rows: torch.Tensor) -> bool:
    """Whether Fp8Linear runs these input rows on its few-row Triton kernels (CUDA, few rows):
    fp8_dot_rows when they come quantized, else fp8_gemv."""
    return rows.is_cuda and rows.shape[0] <= GEMV_MAX_ROWS


def takes_quantized(layer: nn.Module, rows: torch.Tensor | ScaledRows) -> bool:
    """Whether layer takes these input rows quantized (an Fp8Linear on CUDA; few rows go to
    fp8_dot_rows then): a fused kernel may hand it QuantizedRows instead of bf16."""
    x = rows.raw if isinstance(rows, ScaledRows) else rows
    return isinstance(layer, Fp8Linear) and x.is_cuda


class Fp8Linear(nn.Module):
    """y = x W^T (+ b) with W e4m3 [N, K] (W.t() is the column-major [K, N] operand
    torch._scaled_mm wants) and weight_scale float32 [1, N]; input_scale float32 [1, 1] when
    the checkpoint's scheme is static, else None (per-token scales at run time). bias (Qwen2's
    q/k/v) is bf16. Runs in bf16 on CUDA GPUs of compute capability >= 8.9. Both dimensions
    must be multiples of 16 (cuBLASLt FP8). fast_accum: cuBLASLt's GEMMs accumulate in Hopper's
    fast FP8 mode (False: exactly, ~5% slower)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        static_input_scale: bool,
        fast_accum: bool = True,
    ):
        super().__init__()
        if in_features % 16 or out_features % 16:
            raise ValueError(
                f"FP8 linear layers need dimensions divisible by 16, got {in_features} -> "
                f"{out_features}"
            )
        self.in_features, self.out_features = in_features, out_features
        self.fast_accum = fast_accum

        def fixed(*shape: int, dtype: torch.dtype) -> nn.Parameter:
            return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)

        self.weight = fixed(out_features, in_features, dtype=FP8_DTYPE)
        self.weight_scale = fixed(1, out_features, dtype=torch.float32)
        input_scale = fixed(1, 1, dtype=torch.float32) if static_input_scale else None
        self.register_parameter("input_scale", input_scale)
        self.register_parameter("bias", fixed(out_features, dtype=torch.bfloat16) if bias else None)

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        """x [..., K] (bf16), or QuantizedRows [M, K] -> [..., N] / [M, N] bf16."""
        if isinstance(x, QuantizedRows):
            if takes_gemv(x.q):
                return fp8_dot_rows(x.q, x.scale, self.weight, self.weight_scale, self.bias)
            return self._scaled_mm(x)
        rows = x.reshape(-1, self.in_features)
        if takes_gemv(rows):
            out = fp8_gemv(rows, self.weight, self.weight_scale, self.bias)
        else:
            out = self._scaled_mm(QuantizedRows(*quantize_rows(rows, self.input_scale)))
        return out.reshape(*x.shape[:-1], self.out_features)

    def forward_deferred(self, x: torch.Tensor | QuantizedRows) -> ScaledRows:
        """x [M, K] (bf16, quantized here) or QuantizedRows -> ScaledRows [M, N]: the per-tensor
        GEMM of the e4m3 codes at unit scales (callers check defers_scales first)."""
        if not isinstance(x, QuantizedRows):
            x = QuantizedRows(*quantize_rows(x, self.input_scale))
        unit = unit_scale(x.q.device)  # first made in the graphs' warm-up, outside capture
        raw = torch._scaled_mm(
            x.q, self.weight.t(), scale_a=unit, scale_b=unit,
            out_dtype=torch.bfloat16, use_fast_accum=self.fast_accum,
        )  # fmt: skip
        return ScaledRows(raw, x.scale, self.weight_scale)

    def _scaled_mm(self, rows: QuantizedRows) -> torch.Tensor:
        return torch._scaled_mm(
            rows.q,
            self.weight.t(),
            scale_a=rows.scale,
            scale_b=self.weight_scale,
            bias=self.bias,
            out_dtype=torch.bfloat16,
            use_fast_accum=self.fast_accum,
        )

    def forward_reference(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        """forward's math in float32, for tests: the input as forward takes it (quantized per
        row with torch ops, or as it is where forward runs fp8_gemv or it comes quantized),
        times the dequantized weight."""
        if isinstance(x, QuantizedRows):
            inputs, shape = x.q.float() * x.scale, x.q.shape[:-1]
        else:
            rows, shape = x.reshape(-1, self.in_features), x.shape[:-1]
            if takes_gemv(rows):
                inputs = rows.float()
            else:
                x_fp8, x_scale = quantize_rows_torch(rows, self.input_scale)
                inputs = x_fp8.float() * x_scale
        out = inputs @ self.dequantized_weight().t()
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(torch.bfloat16).reshape(*shape, self.out_features)

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 weight [N, K] this layer stands for."""
        return dequantize_weight(Fp8Weight(self.weight, self.weight_scale.t()))

    def extra_repr(self) -> str:
        inputs = "dynamic per-token" if self.input_scale is None else "static"
        return f"{self.in_features} -> {self.out_features}, fp8 e4m3, {inputs} input scales"


def make_linear(
    in_features: int,
    out_features: int,
    bias: bool,
    quant: Fp8Config | Int4Config | Int8Config | None,
) -> nn.Module:
    """An nn.Linear, or the quantized layer of the scheme: Fp8Linear, Int4Linear (AWQ / GPTQ,
    engine/quant/int4.py) or Int8Linear (compressed-tensors INT8, engine/quant/int8.py)."""
    if quant is None:
        return nn.Linear(in_features, out_features, bias=bias)
    if isinstance(quant, Int4Config):
        return Int4Linear(in_features, out_features, bias, quant)
    if isinstance(quant, Int8Config):
        return Int8Linear(in_features, out_features, bias)
    return Fp8Linear(in_features, out_features, bias, quant.static_input_scales, quant.fast_accum)


def linear_state(
    prefix: str, weight: Fp8Weight, input_scale: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """The state-dict entries of the Fp8Linear at prefix."""
    state = {
        prefix + ".weight": weight.weight,
        prefix + ".weight_scale": weight.scale.reshape(1, -1),
    }
    if input_scale is not None:
        state[prefix + ".input_scale"] = input_scale.float().reshape(1, 1)
    return state
