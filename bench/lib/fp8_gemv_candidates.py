"""Few-row FP8 GEMM candidates that decode the e4m3 weights more cheaply than the engine's
kernels (engine/quant/fp8_gemv.py), for bench.fp8_gemv_bench; owns no state (imports triton on
first use).

The engine's GEMV kernels read the gate_up weights at ~2.7 TB/s whatever their tile shape, which
fits a bound on converting e4m3 to bf16/f32 rather than on HBM. Three ways around it, the third
of which the engine took (engine/quant/fp8_dot_rows.py; the bench times that one):
- "f16dot": tl.dot on f16 operands. e4m3 -> f16 is one hardware instruction per two values;
  x (bf16) is scaled by X_SCALE before its f16 conversion so that activations up to
  65504 / X_SCALE stay finite, and the fp32 accumulator is scaled back.
- "bits": the vector kernel with the weights decoded by integer operations. The byte's
  exponent and mantissa bits shifted into a float32's are the value times 2**-120; x is
  scaled by 2**64 and the result by 2**56, so no product leaves float32's range.
- "fp8dot": tl.dot on e4m3 operands, x quantized per row beforehand (as cuBLASLt's path).
f16dot autotunes over fp8_dot_rows's tile shapes.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from engine.quant.fp8_dot_rows import tile_configs

X_SCALE = 1.0 / 64  # f16dot: x * X_SCALE is what gets converted to f16
BITS_X_SCALE = 2.0**64  # bits: x * 2**64 * (weight bits as float32 = w * 2**-120) ...
BITS_OUT_SCALE = 2.0**56  # ... = x * w * 2**-56, scaled back at the end
BLOCK_M = 16  # tl.dot's smallest M


@functools.cache
def _f16dot_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.autotune(configs=tile_configs(), key=["N", "K"])
    @triton.jit
    def f16dot(
        x_ptr,
        w_ptr,
        scale_ptr,
        out_ptr,
        M,
        N,
        K,
        x_scale,
        out_scale,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_M: tl.constexpr,
    ):
        """acc[m, n] = sum_k f16(x[m, k] * x_scale) * f16(w[n, k]); out = acc * scale / x_scale."""
        pid = tl.program_id(0)
        rows = tl.arange(0, BLOCK_M)
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(
                x_ptr + rows[:, None] * K + ks[None, :],
                mask=(rows[:, None] < M) & (ks[None, :] < K),
                other=0.0,
            )
            w = tl.load(
                w_ptr + cols[:, None].to(tl.int64) * K + ks[None, :],
                mask=(cols[:, None] < N) & (ks[None, :] < K),
                other=0.0,
            )
            x16 = (x.to(tl.float32) * x_scale).to(tl.float16)
            acc = tl.dot(x16, tl.trans(w.to(tl.float16)), acc)
        scale = tl.load(scale_ptr + cols, mask=cols < N, other=0.0) * out_scale
        tl.store(
            out_ptr + rows[:, None] * N + cols[None, :],
            (acc * scale[None, :]).to(out_ptr.dtype.element_ty),
            mask=(rows[:, None] < M) & (cols[None, :] < N),
        )

    return f16dot


@functools.cache
def _bits_kernel() -> Any:
    import triton
    import triton.language as tl

    configs = [
        triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w)
        for bn, bk, w in (
            (4, 1024, 4),
            (8, 512, 4),
            (8, 1024, 4),
            (8, 1024, 8),
            (16, 512, 4),
            (16, 1024, 8),
            (8, 2048, 8),
        )
    ]

    @triton.autotune(configs=configs, key=["N", "K"])
    @triton.jit
    def bits(
        x_ptr,
        w_ptr,
        scale_ptr,
        out_ptr,
        N,
        K,
        x_scale,
        out_scale,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """One row: acc[n, k] += x[k] * x_scale * float32-bits-of(w byte) summed along k."""
        pid = tl.program_id(0)
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            byte = tl.load(
                w_ptr + cols[:, None].to(tl.int64) * K + ks[None, :],
                mask=(cols[:, None] < N) & (ks[None, :] < K),
                other=0,
            )
            word = byte.to(tl.uint32)
            w = (((word & 0x7F) << 20) | ((word & 0x80) << 24)).to(tl.float32, bitcast=True)
            x = tl.load(x_ptr + ks, mask=ks < K, other=0.0).to(tl.float32) * x_scale
            acc += x[None, :] * w
        scale = tl.load(scale_ptr + cols, mask=cols < N, other=0.0) * out_scale
        out = tl.sum(acc, axis=1) * scale
        tl.store(out_ptr + cols, out.to(out_ptr.dtype.element_ty), mask=cols < N)

    return bits


def _grid(n: int) -> Any:
    import triton

    return lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)


def gemv_f16dot(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M <= 16, K] bf16 contiguous, weight e4m3 [N, K], scale float32 [N] -> [M, N] bf16."""
    (m, k), n = x.shape, weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _f16dot_kernel()[_grid(n)](
        x, weight, scale, out, m, n, k, X_SCALE, 1.0 / X_SCALE, BLOCK_M=BLOCK_M
    )
    return out


def gemv_bits(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [1, K] bf16, weight e4m3 [N, K] (read as bytes), scale float32 [N] -> [1, N] bf16."""
    k, n = x.shape[1], weight.shape[0]
    if x.shape[0] != 1:
        raise ValueError(f"gemv_bits takes one row, got {x.shape[0]}")
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _bits_kernel()[_grid(n)](
        x, weight.view(torch.uint8), scale, out, n, k, BITS_X_SCALE, BITS_OUT_SCALE
    )
    return out
