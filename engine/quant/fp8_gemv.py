"""fp8_gemv: y = x W^T for a few rows of bf16 x and an e4m3 W with per-channel scales, as one
Triton kernel that dequantizes W in registers; owns no state (imports triton on first use).

A decode step of a few sequences is bound by reading the weights. cuBLASLt's FP8 GEMM picks a
128 x 128 tile for one row and reads the weights at about half the HBM rate, after a kernel
that quantizes the activations; this kernel skips that quantization (the activations stay
bf16, which is also closer to the unquantized model) and streams W once, BLOCK_N output
channels per program, tile shapes chosen per (N, K) by Triton's autotuner on first use.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

GEMV_MAX_ROWS = 16  # Fp8Linear takes this kernel up to here, cuBLASLt's FP8 GEMM above


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    configs = [
        triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
        for bn, bk, w, s in (
            (16, 128, 2, 6),
            (16, 256, 2, 4),
            (16, 512, 2, 3),
            (16, 128, 4, 8),
            (16, 256, 4, 4),
            (16, 512, 4, 3),
            (32, 128, 4, 6),
            (32, 256, 4, 4),
            (16, 1024, 8, 2),
            (32, 512, 8, 3),
        )
    ]

    @triton.autotune(configs=configs, key=["N", "K"])
    @triton.jit
    def fp8_gemv(
        x_ptr,
        w_ptr,
        scale_ptr,
        bias_ptr,
        out_ptr,
        M,
        N,
        K,
        x_row_stride,
        out_row_stride,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """One program per BLOCK_N output channels, all M (<= BLOCK_M) rows: acc += x_tile @
        dequant(w_tile)^T over K in fp32, then the channel scales (and bias)."""
        pid = tl.program_id(0)
        rows = tl.arange(0, BLOCK_M)
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < M
        col_ok = cols < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            x = tl.load(
                x_ptr + rows[:, None] * x_row_stride + ks[None, :],
                mask=row_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            w = tl.load(
                w_ptr + cols[:, None].to(tl.int64) * K + ks[None, :],
                mask=col_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
        scale = tl.load(scale_ptr + cols, mask=col_ok, other=0.0)
        out = acc * scale[None, :]
        if HAS_BIAS:
            out += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(
            out_ptr + rows[:, None] * out_row_stride + cols[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & col_ok[None, :],
        )

    return fp8_gemv


def fp8_gemv(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [M, K] bf16 (M <= GEMV_MAX_ROWS, last dimension contiguous), weight e4m3 [N, K]
    contiguous, weight_scale float32 with N elements, bias [N] or None -> [M, N] in x's dtype."""
    import triton

    num_rows, k = x.shape
    n = weight.shape[0]
    if num_rows > GEMV_MAX_ROWS:
        raise ValueError(f"fp8_gemv takes at most {GEMV_MAX_ROWS} rows, got {num_rows}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out

    def grid(meta: dict[str, Any]) -> tuple[int]:
        return (triton.cdiv(n, meta["BLOCK_N"]),)

    _kernel()[grid](
        x,
        weight,
        weight_scale,
        weight_scale if bias is None else bias,  # read only when HAS_BIAS
        out,
        num_rows,
        n,
        k,
        x.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=GEMV_MAX_ROWS,
    )
    return out
