"""A few-row FP8 GEMV candidate that quantizes its own input, for bench.fused_gemv_bench --fp8;
owns no state (imports triton on first use).

On the H200 a batch-1 step of the 8B shape with FP8 weights is 9 kernels a layer: add + RMSNorm
+ quantize, qkv, RoPE, attention, o (bf16 GEMV), add + RMSNorm + quantize, gate/up,
SiLU-and-mul + quantize, down. The three quantizing kernels took 8.1 us of a layer's 87
(bench/RESULTS.md, issue 12's seventeenth round). Here the GEMV does their work itself, as the
bf16 fused GEMVs do (engine/models/fused_gemv.py): each program reads the whole bf16 input row
(from L2) for its per-row scale (the amax of what the row becomes, / 448), then quantizes each
input tile as it multiplies it with fp8_dot_rows's tensor-core product, and may
- NORM: take rmsnorm(x) * weight as the row (the amax of it is the amax of x * weight times the
  row's 1/rms: the same up to float rounding);
- SILU: read gate and up rows (weight [2N, K]) and give silu(gate) * up, down's bf16 input;
- ADD: add its output into the residual in place (o and down), so the next NORM reads it.
A layer is then 4 GEMVs, RoPE and attention. Kept apart from the engine until the chain bench
says it is faster; the engine's rounding (quantize_rows: the row rounded to bf16, then scaled)
is kept, so outputs match the engine's path to float rounding.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from engine import pdl
from engine.quant.fp8 import AMAX_FLOOR, FP8_MAX
from engine.quant.fp8_dot_rows import BLOCK_M

PROLOGUE_BLOCK = 4096  # input columns a prologue step reads (32 a thread at 4 warps)


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def fp8_prologue_dot(
        x_ptr,
        norm_ptr,
        w_ptr,
        w_scale_ptr,
        out_ptr,
        N,
        K,
        eps,
        NORM: tl.constexpr,
        SILU: tl.constexpr,
        ADD: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PROLOGUE: tl.constexpr,
        FP8_MAX: tl.constexpr,
        AMAX_FLOOR: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """One row. Prologue: 1/rms (NORM) and the amax of the row to be quantized, so scale =
        amax / FP8_MAX. Loop over K: the row's tile made (normed, rounded to x's dtype),
        divided by the scale, cast to e4m3 and broadcast to the BLOCK_M rows a tensor-core
        product needs (only the first is stored), times the e4m3 weight tile. Epilogue: the
        row and channel scales, SiLU pairing, residual add."""
        pid = tl.program_id(0)
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        if PDL:
            tl.extra.cuda.gdc_wait()
        squares = tl.zeros((PROLOGUE,), dtype=tl.float32)
        amax = tl.zeros((PROLOGUE,), dtype=tl.float32)
        for k0 in range(0, K, PROLOGUE):
            ks = k0 + tl.arange(0, PROLOGUE)
            x = tl.load(x_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
            squares += x * x
            if NORM:
                x = x * tl.load(norm_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        inv_rms = 1.0
        if NORM:
            inv_rms = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / K + eps)
        row_amax = (tl.max(amax, axis=0) * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
        scale = tl.maximum(row_amax, AMAX_FLOOR) / FP8_MAX
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            x = tl.load(x_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
            if NORM:
                weight = tl.load(norm_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
                x = (x * inv_rms * weight).to(x_ptr.dtype.element_ty).to(tl.float32)
            v = tl.minimum(tl.maximum(x / scale, -FP8_MAX), FP8_MAX)
            # to 3 mantissa bits, to nearest even, in float32, so that the cast to e4m3 is
            # exact (Triton's interpreter rounds that cast wrongly when the mantissa carries
            # into the exponent); below e4m3's normal range the cast rounds once more
            bits = v.to(tl.int32, bitcast=True)
            bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000  # = 0xFFF00000
            v = bits.to(tl.float32, bitcast=True)
            q = tl.broadcast_to(v.to(tl.float8e4nv)[None, :], (BLOCK_M, BLOCK_K))
            w_ok = col_ok[:, None] & k_ok[None, :]
            w = tl.load(w_ptr + cols[:, None].to(tl.int64) * K + ks[None, :], mask=w_ok, other=0.0)
            acc = tl.dot(q, tl.trans(w), acc)
            if SILU:
                up_at = w_ptr + (cols[:, None] + N).to(tl.int64) * K + ks[None, :]
                acc_up = tl.dot(q, tl.trans(tl.load(up_at, mask=w_ok, other=0.0)), acc_up)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        col_scale = tl.load(w_scale_ptr + cols, mask=col_ok, other=0.0)
        out = tl.max(acc, axis=0) * scale * col_scale  # the rows are equal: take one
        if SILU:
            up_scale = tl.load(w_scale_ptr + N + cols, mask=col_ok, other=0.0)
            out = out / (1.0 + tl.exp(-out)) * (tl.max(acc_up, axis=0) * scale * up_scale)
        if ADD:
            out += tl.load(out_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + cols, out.to(out_ptr.dtype.element_ty), mask=col_ok)

    return fp8_prologue_dot


def fp8_prologue_dot(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    out: torch.Tensor,
    tile: tuple[int, int, int, int],
    *,
    norm: torch.Tensor | None = None,
    eps: float = 1e-5,
    silu: bool = False,
    add: bool = False,
) -> torch.Tensor:
    """out [1, N] (=, or += with add) the product of the row x [1, K] bf16 (rmsnorm(x) * norm
    with a norm), quantized in the kernel, and weight e4m3 ([N, K]; [2N, K] gate then up with
    silu) with float32 per-channel weight_scale; tile (BLOCK_N, BLOCK_K, warps, stages)."""
    import triton

    block_n, block_k, warps, stages = tile
    k, n = x.shape[-1], out.shape[-1]
    if x.shape != (1, k) or out.shape != (1, n):
        raise ValueError("x and out must be one row each")
    if weight.shape != ((2 if silu else 1) * n, k) or not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous [{(2 if silu else 1) * n}, {k}]")
    if weight_scale.numel() != weight.shape[0]:
        raise ValueError("the weight needs one scale per output channel")
    if not x.is_contiguous() or not out.is_contiguous():
        raise ValueError("x and out must be contiguous")
    use_pdl = pdl.enabled(x.device)
    _kernel()[(triton.cdiv(n, block_n),)](
        x,
        weight_scale if norm is None else norm,  # read only when NORM
        weight,
        weight_scale.reshape(-1),
        out,
        n,
        k,
        eps,
        NORM=norm is not None,
        SILU=silu,
        ADD=add,
        BLOCK_M=BLOCK_M,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PROLOGUE=min(PROLOGUE_BLOCK, triton.next_power_of_2(k)),
        FP8_MAX=FP8_MAX,
        AMAX_FLOOR=AMAX_FLOOR,
        PDL=use_pdl,
        num_warps=warps,
        num_stages=stages,
        launch_pdl=use_pdl,
    )
    return out
