"""A candidate few-row FP8 GEMV for bench/fp8_gemv_bench.py: plain vector loads and one
reduction along K at the end (no tensor cores), against the engine's tl.dot kernel
(engine/quant/fp8_gemv.py), which reads the weights at ~2.4 TB/s at batch 1 on an H200. Owns no
state; imports triton on first use. Not used by the engine until the bench shows it faster.
"""

from __future__ import annotations

import functools
from typing import Any

import torch


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def fp8_gemv_vector(
        x_ptr,
        w_ptr,
        scale_ptr,
        out_ptr,
        M,
        N,
        K,
        x_row_stride,
        out_row_stride,
        ROWS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """One program per BLOCK_N output channels: acc[r, n, k] += x[r, k] * w[n, k] over
        the K tiles in fp32, summed along k once at the end, times the channel scales."""
        pid = tl.program_id(0)
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.arange(0, ROWS)
        col_ok = cols < N
        row_ok = rows < M
        acc = tl.zeros((ROWS, BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            w = tl.load(
                w_ptr + cols[:, None].to(tl.int64) * K + ks[None, :],
                mask=col_ok[:, None] & k_ok[None, :],
                other=0.0,
            ).to(tl.float32)
            x = tl.load(
                x_ptr + rows[:, None] * x_row_stride + ks[None, :],
                mask=row_ok[:, None] & k_ok[None, :],
                other=0.0,
            ).to(tl.float32)
            acc += x[:, None, :] * w[None, :, :]
        scale = tl.load(scale_ptr + cols, mask=col_ok, other=0.0)
        out = tl.sum(acc, axis=2) * scale[None, :]
        tl.store(
            out_ptr + rows[:, None] * out_row_stride + cols[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & col_ok[None, :],
        )

    return fp8_gemv_vector


def fp8_gemv_vector(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block_n: int,
    block_k: int,
    num_warps: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] (M <= 16, last dimension contiguous), weight e4m3 [N, K] contiguous,
    weight_scale float32 with N elements -> [M, N] in x's dtype (written into out if given)."""
    num_rows, k = x.shape
    n = weight.shape[0]
    rows = 1 << max(0, (num_rows - 1).bit_length())
    if out is None:
        out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    grid = (-(-n // block_n),)
    _kernel()[grid](
        x,
        weight,
        weight_scale,
        out,
        num_rows,
        n,
        k,
        x.stride(0),
        out.stride(0),
        ROWS=rows,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
    )
    return out
