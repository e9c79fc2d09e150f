"""SiLU-and-mul + per-row FP8 quantization kernels that hold a chunk of the row rather than all
of it, for bench.fp8_step_kernels_bench; owns no state (imports triton on first use).

engine/quant/fp8_fused.py runs one program per row with the whole 14,336-value row (gate, up
and, for ScaledRows, both column-scale vectors) in registers: 16 warps of ~128 registers a
thread, one program per SM at a time. At 16,384 rows that is near the HBM rate; at a decode
batch of 768 it moves ~2.4 TB/s, and reading ScaledRows costs ~0.6 ms more a step. Here each
program walks its row in CHUNK-column pieces twice: the first pass finds the row's amax of
silu(gate) * up (rounded to bf16, as the engine's kernel does), the second quantizes and
stores. "recompute" reads gate and up again in the second pass (from L2 when the row is still
there); "scratch" stores the bf16 product in the first pass and reads it back.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from engine.quant.fp8 import AMAX_FLOOR, FP8_DTYPE, FP8_MAX, QuantizedRows, ScaledRows


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def silu_quant_chunked(
        src_ptr,
        src_row_stride,
        row_scale_ptr,
        col_scale_ptr,
        scratch_ptr,
        q_ptr,
        scale_ptr,
        num_cols,
        CHUNK: tl.constexpr,
        DEQUANT: tl.constexpr,
        SCRATCH: tl.constexpr,
        FP8_MAX: tl.constexpr,
        AMAX_FLOOR: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        src = src_ptr + row * src_row_stride
        row_scale = 1.0
        if DEQUANT:
            row_scale = tl.load(row_scale_ptr + row)
        amax = tl.zeros((CHUNK,), dtype=tl.float32)
        for c0 in range(0, num_cols, CHUNK):
            cols = c0 + tl.arange(0, CHUNK)
            mask = cols < num_cols
            gate = tl.load(src + cols, mask=mask, other=0.0).to(tl.float32)
            up = tl.load(src + num_cols + cols, mask=mask, other=0.0).to(tl.float32)
            if DEQUANT:
                g_scale = tl.load(col_scale_ptr + cols, mask=mask, other=0.0)
                u_scale = tl.load(col_scale_ptr + num_cols + cols, mask=mask, other=0.0)
                gate = (gate * row_scale * g_scale).to(tl.bfloat16).to(tl.float32)
                up = (up * row_scale * u_scale).to(tl.bfloat16).to(tl.float32)
            y = (gate / (1.0 + tl.exp(-gate)) * up).to(tl.bfloat16)
            if SCRATCH:
                tl.store(scratch_ptr + row * num_cols + cols, y, mask=mask)
            amax = tl.maximum(amax, tl.abs(y.to(tl.float32)))
        scale = tl.maximum(tl.max(amax, axis=0), AMAX_FLOOR) / FP8_MAX
        for c0 in range(0, num_cols, CHUNK):
            cols = c0 + tl.arange(0, CHUNK)
            mask = cols < num_cols
            if SCRATCH:
                y = tl.load(scratch_ptr + row * num_cols + cols, mask=mask, other=0.0)
            else:  # the first pass's product again
                gate = tl.load(src + cols, mask=mask, other=0.0).to(tl.float32)
                up = tl.load(src + num_cols + cols, mask=mask, other=0.0).to(tl.float32)
                if DEQUANT:
                    g_scale = tl.load(col_scale_ptr + cols, mask=mask, other=0.0)
                    u_scale = tl.load(col_scale_ptr + num_cols + cols, mask=mask, other=0.0)
                    gate = (gate * row_scale * g_scale).to(tl.bfloat16).to(tl.float32)
                    up = (up * row_scale * u_scale).to(tl.bfloat16).to(tl.float32)
                y = (gate / (1.0 + tl.exp(-gate)) * up).to(tl.bfloat16)
            q = tl.minimum(tl.maximum(y.to(tl.float32) / scale, -FP8_MAX), FP8_MAX)
            tl.store(q_ptr + row * num_cols + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + row, scale)

    return silu_quant_chunked


def silu_quant_chunked(
    gate_up: torch.Tensor | ScaledRows,
    chunk: int,
    num_warps: int,
    scratch: bool,
) -> QuantizedRows:
    """quantize_rows(silu(gate) * up) of gate_up [M, 2I] bf16 (or ScaledRows, read through its
    scales), CHUNK columns at a time; scratch: keep the product in a bf16 buffer between passes."""
    src, scaled = (gate_up.raw, gate_up) if isinstance(gate_up, ScaledRows) else (gate_up, None)
    num_rows, half = src.shape[0], src.shape[1] // 2
    out = QuantizedRows(
        torch.empty((num_rows, half), dtype=FP8_DTYPE, device=src.device),
        torch.empty((num_rows, 1), dtype=torch.float32, device=src.device),
    )
    buffer = torch.empty((num_rows, half) if scratch else (1,), dtype=torch.bfloat16,
                         device=src.device)  # fmt: skip
    _kernel()[(num_rows,)](
        src, src.stride(0),
        out.scale if scaled is None else scaled.row_scale,
        out.scale if scaled is None else scaled.col_scale,
        buffer, out.q, out.scale, half,
        CHUNK=chunk, DEQUANT=scaled is not None, SCRATCH=scratch,
        FP8_MAX=FP8_MAX, AMAX_FLOOR=AMAX_FLOOR, num_warps=num_warps,
    )  # fmt: skip
    return out
