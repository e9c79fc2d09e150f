"""Fp8Linear's input quantization on CUDA, one Triton kernel per call: per-row quantization of
given rows (quantize_rows_cuda), or inside the kernel that makes the rows: add + RMSNorm +
quantize, SiLU-and-mul + quantize; the rows may be an Fp8Linear's ScaledRows, whose scales the
kernel applies as it reads them. Owns no state; imports triton on first use.

Unfused, an add + RMSNorm or a SiLU-and-mul kernel writes bf16 rows, then quantize_rows reads
them back and writes e4m3. Fused, the row is quantized while it is still in registers: on an
H200 the 8B shape's 16,384-token step spends 17.9 ms in these kernels where the unfused chain
took 28.3 ms (bench/fp8_step_kernels_bench.py, in git history before 31b779a). The math is
the unfused chain's: the result is rounded to the activations' dtype before its amax is
taken, so the e4m3 codes are those
quantize_rows would give on the unfused output, up to float rounding. Per-row quantization
alone is quantize_rows_torch's math in one launch instead of ~6 small torch kernels. Decode
batches' deferred-scale products of 17-2,048 rows walk the SiLU row in chunks instead
(fp8_silu_chunked.py). On Hopper the kernel launches with PDL (engine/execution/pdl.py).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from engine.execution import pdl
from engine.quant import fp8_silu_chunked
from engine.quant.fp8_silu_chunked import ChunkedSilu
from engine.quant.fp8_types import AMAX_FLOOR, FP8_DTYPE, FP8_MAX, QuantizedRows, ScaledRows

NORM, ADD_NORM, SILU_AND_MUL, AS_IS = 0, 1, 2, 3  # what the kernel does before it quantizes


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def make_and_quantize_rows(
        src_ptr,
        src_row_stride,
        residual_ptr,
        residual_row_stride,
        weight_ptr,
        q_ptr,
        scale_ptr,
        static_scale_ptr,
        row_scale_ptr,
        col_scale_ptr,
        num_cols,
        eps,
        OP: tl.constexpr,
        BLOCK: tl.constexpr,
        STATIC: tl.constexpr,
        DEQUANT: tl.constexpr,
        FP8_MAX: tl.constexpr,
        AMAX_FLOOR: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """One program per row. OP NORM: rmsnorm(src) * weight; ADD_NORM: residual += src,
        then rmsnorm(the sum) * weight; SILU_AND_MUL: silu(src's first num_cols) * its next
        num_cols; AS_IS: src. DEQUANT: src holds ScaledRows' raw product, and each value read
        from it is first multiplied by its row's and its column's scale and rounded to src's
        dtype (the value the row-scaled GEMM would have stored). The row is rounded to src's
        dtype, then quantized as quantize_rows does: scale = amax / FP8_MAX (or the static
        scale), q = row / scale clamped, stored e4m3. PDL: the next kernel may come in at once
        (to prefetch its weights); this one waits for the one before (engine/execution/pdl.py)."""
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < num_cols
        src = src_ptr + row * src_row_stride + cols
        x = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        if DEQUANT:
            row_scale = tl.load(row_scale_ptr + row)
            col_scale = tl.load(col_scale_ptr + cols, mask=mask, other=0.0)
            x = (x * row_scale * col_scale).to(src_ptr.dtype.element_ty).to(tl.float32)
        if OP == 3:  # AS_IS
            y = x
        elif OP == 2:  # SILU_AND_MUL
            up = tl.load(src + num_cols, mask=mask, other=0.0).to(tl.float32)
            if DEQUANT:
                up_scale = tl.load(col_scale_ptr + num_cols + cols, mask=mask, other=0.0)
                up = (up * row_scale * up_scale).to(src_ptr.dtype.element_ty).to(tl.float32)
            y = x / (1.0 + tl.exp(-x)) * up
        else:
            if OP == 1:  # ADD_NORM
                res = residual_ptr + row * residual_row_stride + cols
                x += tl.load(res, mask=mask, other=0.0).to(tl.float32)
                tl.store(res, x.to(residual_ptr.dtype.element_ty), mask=mask)
            inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / num_cols + eps)
            y = x * inv_rms * tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = y.to(src_ptr.dtype.element_ty).to(tl.float32)
        if STATIC:
            scale = tl.load(static_scale_ptr)
        else:
            scale = tl.maximum(tl.max(tl.abs(y), axis=0), AMAX_FLOOR) / FP8_MAX
        q = tl.minimum(tl.maximum(y / scale, -FP8_MAX), FP8_MAX)
        tl.store(q_ptr + row * num_cols + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + row, scale)

    return make_and_quantize_rows


def _empty_rows(
    num_rows: int, num_cols: int, dtype: torch.dtype, device: torch.device
) -> QuantizedRows:
    """Room for num_rows quantized rows: codes [M, num_cols] of dtype, float32 scales [M, 1]."""
    return QuantizedRows(
        torch.empty((num_rows, num_cols), dtype=dtype, device=device),
        torch.empty((num_rows, 1), dtype=torch.float32, device=device),
    )


def warps_for(block: int) -> int:
    """The launch's warps for a row of block (a power of two) columns: one per 512, 1..16."""
    return max(1, min(16, block // 512))


def _launch(
    op: int,
    src: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    eps: float,
    num_cols: int,
    static_scale: torch.Tensor | None,
    out_dtype: torch.dtype,
    src_scales: ScaledRows | None = None,
) -> QuantizedRows:
    """src_scales: src is src_scales.raw, read through its row and column scales."""
    num_rows = src.shape[0]
    out = _empty_rows(num_rows, num_cols, out_dtype, src.device)
    if num_rows:
        block = 1 << (num_cols - 1).bit_length()  # the whole row in one program's registers
        use_pdl = pdl.enabled(src.device)
        _kernel()[(num_rows,)](
            src,
            src.stride(0),
            src if residual is None else residual,  # read only for ADD_NORM
            src.stride(0) if residual is None else residual.stride(0),
            src if weight is None else weight,  # read only for the norms
            out.q,
            out.scale,
            out.scale if static_scale is None else static_scale,  # read only when STATIC
            out.scale if src_scales is None else src_scales.row_scale,  # read only when DEQUANT
            out.scale if src_scales is None else src_scales.col_scale,
            num_cols,
            eps,
            OP=op,
            BLOCK=block,
            STATIC=static_scale is not None,
            DEQUANT=src_scales is not None,
            FP8_MAX=FP8_MAX,
            AMAX_FLOOR=AMAX_FLOOR,
            PDL=use_pdl,
            launch_pdl=use_pdl,
            num_warps=warps_for(block),
        )
    return out


def quantize_rows_cuda(x: torch.Tensor, static_scale: torch.Tensor | None) -> QuantizedRows:
    """quantize_rows_torch(x, static_scale) for x [M, K] (bf16) on CUDA: (e4m3 [M, K]
    contiguous, float32 [M, 1])."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return _launch(AS_IS, x, None, None, 0.0, x.shape[1], static_scale, FP8_DTYPE)


def add_rms_norm_quantize(
    x: torch.Tensor | ScaledRows,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    static_scale: torch.Tensor | None,
    out_dtype: torch.dtype = FP8_DTYPE,
) -> QuantizedRows:
    """quantize_rows(rmsnorm(residual + x) * weight): residual (when given) becomes
    residual + x in place, as fused_ops.add_rms_norm_ does; x is left as it is.

    x, residual: [M, K], last dimension contiguous (x may be an Fp8Linear's ScaledRows, read
    through its scales); static_scale: the consumer's one-element float32 input scale, or None
    for per-row scales. out_dtype is for tests of the math only (float32 keeps x / scale
    unrounded)."""
    src, src_scales = (x.raw, x) if isinstance(x, ScaledRows) else (x, None)
    if src.stride(1) != 1 or (residual is not None and residual.stride(1) != 1):
        raise ValueError("add_rms_norm_quantize needs rows with a contiguous last dimension")
    op = NORM if residual is None else ADD_NORM
    width = src.shape[1]
    return _launch(op, src, residual, weight, eps, width, static_scale, out_dtype, src_scales)


def silu_and_mul_quantize(
    gate_up: torch.Tensor | ScaledRows,
    static_scale: torch.Tensor | None,
    out_dtype: torch.dtype = FP8_DTYPE,
    chunked: ChunkedSilu | None = None,
) -> QuantizedRows:
    """quantize_rows(silu(gate) * up) for gate_up [M, 2I] (gate, then up; rows contiguous; or
    an Fp8Linear's ScaledRows, read through its scales). chunked: run fp8_silu_chunked.py's
    kernel so (default: its CHUNKED for ScaledRows of its MIN_ROWS to MAX_ROWS rows; on plain
    bf16 rows it measured slower)."""
    src, src_scales = (gate_up.raw, gate_up) if isinstance(gate_up, ScaledRows) else (gate_up, None)
    width = src.shape[1]
    if src.stride(1) != 1 or width % 2:
        raise ValueError(f"gate_up of shape {tuple(src.shape)} is not [M, 2I] by rows")
    half = width // 2
    if chunked is None and src_scales is not None and fp8_silu_chunked.takes(src.shape[0]):
        chunked = fp8_silu_chunked.CHUNKED
    if chunked is None or not src.shape[0]:
        return _launch(
            SILU_AND_MUL, src, None, None, 0.0, half, static_scale, out_dtype, src_scales
        )
    out = _empty_rows(src.shape[0], half, out_dtype, src.device)
    row_scale, col_scale = (None, None) if src_scales is None else src_scales[1:]
    fp8_silu_chunked.launch(src, row_scale, col_scale, static_scale, *out, chunked)
    return out
