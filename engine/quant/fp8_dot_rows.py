"""fp8_dot_rows: y = (x_q W_q^T) * x_scale * w_scale (+ b) for a few rows already quantized to
e4m3 (QuantizedRows) and an e4m3 W, as one Triton kernel that multiplies the e4m3 codes on
tensor cores; owns no state (imports triton on first use).

For up to GEMV_MAX_ROWS rows the step is bound by reading the weights. cuBLASLt's FP8 GEMM picks
a 128 x 128 tile there and reads them at about half the HBM rate; the bf16-input GEMV
(fp8_gemv.py) converts every e4m3 weight to a wider type first, and that conversion, not HBM,
bounds it (~2.7 TB/s on the H200). Here the codes go to the tensor cores as they are, 16 rows
padded: on the H200 the 8B shape's four projections took 2.30 ms a step at one row against the
GEMV's 2.76, and 2.23-2.33 ms at 2-16 rows against 3.29-3.49 (bench/fp8_gemv_bench.py,
fp8dot; in git history before 31b779a).
The inputs come quantized from the kernel that made them (fp8_fused.py), so the quantization
costs no launch of its own. Tiles are fixed by weight width (tile_for), from a chain of calls
over weights L2 cannot hold: Triton's autotuner, timing each call alone, took gate/up's 28,672
channels in 34.4 us where 64 x 256 a step took 31.0.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from engine.execution import pdl

BLOCK_M = 16  # the smallest M of an e4m3 tensor-core product; rows beyond M are masked
MAX_ROWS = BLOCK_M
# (BLOCK_N, BLOCK_K, num_warps, num_stages) by weight width, from bench.fused_gemv_bench --fp8
# on an H200 (each call timed in a chain over weights L2 cannot hold): the 8B shape's gate_up
# (28,672 channels) reads fastest 64 x 256 a step, qkv and down 32 x 512.
WIDE_TILE = (64, 256, 4, 3)
NARROW_TILE = (32, 512, 4, 3)
WIDE_CHANNELS = 16384  # weights of at least this many output channels take WIDE_TILE


def tile_for(num_channels: int) -> tuple[int, int, int, int]:
    """The fixed tile of a weight with num_channels output channels."""
    return WIDE_TILE if num_channels >= WIDE_CHANNELS else NARROW_TILE


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def fp8_dot_rows_kernel(
        x_ptr,
        x_scale_ptr,
        w_ptr,
        w_scale_ptr,
        bias_ptr,
        out_ptr,
        M,
        N,
        K,
        out_row_stride,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """One program per BLOCK_N output channels, all M rows: acc += x_q @ w_q^T over K on
        e4m3 (fp32 accumulator), then the row and channel scales (and bias). PDL: it waits for
        the kernel before (engine/execution/pdl.py); the next kernel may come in after the loop."""
        pid = tl.program_id(0)
        rows = tl.arange(0, BLOCK_M)
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < M
        col_ok = cols < N
        if PDL:
            tl.extra.cuda.gdc_wait()
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            x = tl.load(
                x_ptr + rows[:, None] * K + ks[None, :],
                mask=row_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            w = tl.load(
                w_ptr + cols[:, None].to(tl.int64) * K + ks[None, :],
                mask=col_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            acc = tl.dot(x, tl.trans(w), acc)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        row_scale = tl.load(x_scale_ptr + rows, mask=row_ok, other=0.0)
        col_scale = tl.load(w_scale_ptr + cols, mask=col_ok, other=0.0)
        out = acc * row_scale[:, None] * col_scale[None, :]
        if HAS_BIAS:
            out += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(
            out_ptr + rows[:, None] * out_row_stride + cols[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & col_ok[None, :],
        )

    return fp8_dot_rows_kernel


def fp8_dot_rows(
    q: torch.Tensor,
    scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    tile: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """q e4m3 [M, K] (M <= MAX_ROWS, contiguous) with scale float32 [M, 1], weight e4m3 [N, K]
    contiguous, weight_scale float32 with N elements, bias [N] bf16 or None -> [M, N] bf16.
    tile: (BLOCK_N, BLOCK_K[, num_warps, num_stages]) instead of the fixed one (tests; Triton's
    defaults for the two left out)."""
    import triton

    num_rows, k = q.shape
    n = weight.shape[0]
    if num_rows > MAX_ROWS:
        raise ValueError(f"fp8_dot_rows takes at most {MAX_ROWS} rows, got {num_rows}")
    if not q.is_contiguous():
        q = q.contiguous()
    out = torch.empty((num_rows, n), dtype=torch.bfloat16, device=q.device)
    if num_rows == 0:
        return out
    use_pdl = pdl.enabled(q.device)
    block_n, block_k, *launch = tile or tile_for(n)
    options = dict(zip(("num_warps", "num_stages"), launch, strict=False))
    _kernel()[(triton.cdiv(n, block_n),)](
        q, scale, weight, weight_scale, weight_scale if bias is None else bias, out,
        num_rows, n, k, out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
        PDL=use_pdl, launch_pdl=use_pdl, **options,
    )  # fmt: skip
    return out
