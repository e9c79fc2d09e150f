"""SiLU-and-mul + per-row FP8 quantization that walks each row in chunks, for decode batches'
deferred-scale products; owns no state (imports triton on first use).

fp8_fused.py's kernel holds a whole row in one program: for the 8B shape 14,336 values of gate
and of up (and, reading an Fp8Linear's ScaledRows, both column-scale vectors), 16 warps of ~128
registers a thread, so one program per SM at a time. At 16,384 rows that is near the HBM rate;
at a decode batch of 768 rows it moved ~2.4 TB/s on an H200. Here a program of a few warps
walks its row CHUNK columns at a time, twice: the first pass finds the row's amax of
silu(gate) * up (rounded to the activations' dtype, as fp8_fused.py does) and stores the bf16
product in a scratch buffer, the second reads it back, quantizes and stores (with a static
input scale there is no amax to find: one pass). The codes and scales equal fp8_fused.py's.

Alone on an H200 (8B shape, ms per step over 32 layers): on ScaledRows the best setting (2048
columns, 8 warps, scratch; CHUNKED) took 0.794 ms at 768 rows against the whole-row kernel's
1.172, and 0.309 against 0.423 at 232; on bf16 rows it lost (0.758 against 0.649 at 768). Over
the whole fp8 offline run (decode batches' products come as ScaledRows) it took 57.6 s to 56.1
s. It applies to ScaledRows of MIN_ROWS to MAX_ROWS rows (takes): fewer rows (fp8_dot_rows'
few) keep the whole-row kernel, launched with PDL, and so do plain bf16 rows, where it is
slower.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch

from engine.quant.fp8_types import AMAX_FLOOR, FP8_MAX

MAX_ROWS = 2048  # above, rows no longer fit L2 between the passes; the whole-row kernel is fast
MIN_ROWS = 17  # below, fp8_dot_rows' few rows: the whole-row kernel, launched with PDL


class ChunkedSilu(NamedTuple):
    """How the chunked kernel runs: CHUNK columns a step (a power of two), WARPS warps."""

    chunk: int
    warps: int


CHUNKED = ChunkedSilu(2048, 8)  # the fastest measured on an H200 (see above)


def takes(num_rows: int) -> bool:
    """Whether inputs of num_rows rows take the chunked kernel by default (ScaledRows only)."""
    return MIN_ROWS <= num_rows <= MAX_ROWS


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def silu_quantize_chunked(
        src_ptr,
        src_row_stride,
        row_scale_ptr,
        col_scale_ptr,
        static_scale_ptr,
        scratch_ptr,
        q_ptr,
        scale_ptr,
        num_cols,
        CHUNK: tl.constexpr,
        DEQUANT: tl.constexpr,
        STATIC: tl.constexpr,
        FP8_MAX: tl.constexpr,
        AMAX_FLOOR: tl.constexpr,
    ):
        """One program per row: pass 1 (dynamic scales only) the amax and the product into
        scratch, pass 2 the codes (of the product read back, or computed: static scales)."""
        row = tl.program_id(0).to(tl.int64)
        src = src_ptr + row * src_row_stride
        out_dtype = src_ptr.dtype.element_ty
        row_scale = 1.0
        if DEQUANT:
            row_scale = tl.load(row_scale_ptr + row)
        if STATIC:
            scale = tl.load(static_scale_ptr)
        else:
            amax = tl.zeros((CHUNK,), dtype=tl.float32)
            for c0 in range(0, num_cols, CHUNK):
                cols = c0 + tl.arange(0, CHUNK)
                mask = cols < num_cols
                gate = tl.load(src + cols, mask=mask, other=0.0).to(tl.float32)
                up = tl.load(src + num_cols + cols, mask=mask, other=0.0).to(tl.float32)
                if DEQUANT:
                    g_scale = tl.load(col_scale_ptr + cols, mask=mask, other=0.0)
                    u_scale = tl.load(col_scale_ptr + num_cols + cols, mask=mask, other=0.0)
                    gate = (gate * row_scale * g_scale).to(out_dtype).to(tl.float32)
                    up = (up * row_scale * u_scale).to(out_dtype).to(tl.float32)
                y = (gate / (1.0 + tl.exp(-gate)) * up).to(out_dtype)
                tl.store(scratch_ptr + row * num_cols + cols, y, mask=mask)
                amax = tl.maximum(amax, tl.abs(y.to(tl.float32)))
            scale = tl.maximum(tl.max(amax, axis=0), AMAX_FLOOR) / FP8_MAX
        for c0 in range(0, num_cols, CHUNK):
            cols = c0 + tl.arange(0, CHUNK)
            mask = cols < num_cols
            if not STATIC:
                y = tl.load(scratch_ptr + row * num_cols + cols, mask=mask, other=0.0)
            else:  # one pass: the product
                gate = tl.load(src + cols, mask=mask, other=0.0).to(tl.float32)
                up = tl.load(src + num_cols + cols, mask=mask, other=0.0).to(tl.float32)
                if DEQUANT:
                    g_scale = tl.load(col_scale_ptr + cols, mask=mask, other=0.0)
                    u_scale = tl.load(col_scale_ptr + num_cols + cols, mask=mask, other=0.0)
                    gate = (gate * row_scale * g_scale).to(out_dtype).to(tl.float32)
                    up = (up * row_scale * u_scale).to(out_dtype).to(tl.float32)
                y = (gate / (1.0 + tl.exp(-gate)) * up).to(out_dtype)
            q = tl.minimum(tl.maximum(y.to(tl.float32) / scale, -FP8_MAX), FP8_MAX)
            tl.store(q_ptr + row * num_cols + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + row, scale)

    return silu_quantize_chunked


def launch(
    src: torch.Tensor,
    row_scale: torch.Tensor | None,
    col_scale: torch.Tensor | None,
    static_scale: torch.Tensor | None,
    q: torch.Tensor,
    scale: torch.Tensor,
    how: ChunkedSilu = CHUNKED,
) -> None:
    """Fill q [M, I] and scale [M, 1] from src [M, 2I] (gate, then up; rows contiguous), read
    through row_scale [M, 1] and col_scale [1, 2I] when both are given (ScaledRows)."""
    num_rows, half = src.shape[0], src.shape[1] // 2
    scratch = torch.empty(
        (num_rows, half) if static_scale is None else (1,),
        dtype=src.dtype,
        device=src.device,
    )
    _kernel()[(num_rows,)](
        src, src.stride(0),
        scale if row_scale is None else row_scale,  # read only when DEQUANT
        scale if col_scale is None else col_scale,
        scale if static_scale is None else static_scale,  # read only when STATIC
        scratch, q, scale, half,
        CHUNK=how.chunk, DEQUANT=row_scale is not None, STATIC=static_scale is not None,
        FP8_MAX=FP8_MAX, AMAX_FLOOR=AMAX_FLOOR, num_warps=how.warps,
    )  # fmt: skip
