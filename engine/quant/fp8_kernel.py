"""quantize_rows_cuda: the input quantization of Fp8Linear as one Triton kernel per call.

Owns no state; imports triton on first use. The same math as fp8.quantize_rows_torch (which
the GPU tests compare it to), in one launch instead of the ~6 small torch kernels (abs, amax,
divide, clamp, cast) that would otherwise run before every FP8 GEMM of a decode step.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from engine.quant.fp8 import AMAX_FLOOR, FP8_DTYPE, FP8_MAX


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def quantize_rows(
        x_ptr,
        x_row_stride,
        q_ptr,
        scale_ptr,
        static_scale_ptr,
        num_cols,
        BLOCK: tl.constexpr,
        STATIC: tl.constexpr,
        FP8_MAX: tl.constexpr,
        AMAX_FLOOR: tl.constexpr,
    ):
        """One program per row: scale = amax / FP8_MAX (or the static scale), q = x / scale
        clamped to +-FP8_MAX, stored as e4m3 (round to nearest)."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < num_cols
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        if STATIC:
            scale = tl.load(static_scale_ptr)
        else:
            scale = tl.maximum(tl.max(tl.abs(x), axis=0), AMAX_FLOOR) / FP8_MAX
        q = tl.minimum(tl.maximum(x / scale, -FP8_MAX), FP8_MAX)
        tl.store(q_ptr + row * num_cols + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + row, scale)

    return quantize_rows


def quantize_rows_cuda(
    x: torch.Tensor, static_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16, last dimension contiguous) -> (e4m3 [M, K] contiguous, float32 [M, 1])."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    num_rows, num_cols = x.shape
    q = torch.empty((num_rows, num_cols), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((num_rows, 1), dtype=torch.float32, device=x.device)
    if num_rows:
        block = 1 << (num_cols - 1).bit_length()
        _kernel()[(num_rows,)](
            x,
            x.stride(0),
            q,
            scale,
            scale if static_scale is None else static_scale,  # read only when STATIC
            num_cols,
            BLOCK=block,
            STATIC=static_scale is not None,
            FP8_MAX=FP8_MAX,
            AMAX_FLOOR=AMAX_FLOOR,
            num_warps=max(1, min(16, block // 1024)),
        )
    return q, scale
