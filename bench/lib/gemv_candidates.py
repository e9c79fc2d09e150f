"""One-row bf16 GEMV candidates beside the engine's fused kernel (engine/models/fused_gemv.py),
for bench.fused_gemv_bench; owns no state (imports triton on first use).

On the H200 the engine's gate/up GEMV (RMSNorm before, SiLU after, a channel's gate and up rows
read by one program) reads its 235 MB at 3.67 TB/s in a decode step's chain, where cuBLAS's
plain product reached 3.8-4.1 and the engine's own down GEMV 4.0 (bench/RESULTS.md, issue 12's
seventeenth round). Three changes that may account for it, each a switch of one kernel:
- SUM_EACH_STEP: sum the products along K at each step into [rows, BLOCK_N] instead of
  keeping a [rows, BLOCK_N, BLOCK_K] accumulator to the end (a quarter of the registers at
  4 x 1024, so more programs in flight, for a reduction each step).
- INTERLEAVED (with SILU): the weight's rows in blocks of BLOCK_N gate rows then the same
  channels' up rows (interleave()), so a program reads one contiguous stream, not two 117 MB
  apart.
- SILU_INPUT (without NORM): the input is gate/up's plain output [M, 2K] and the kernel forms
  silu(gate) * up as it reads it, so gate/up can run as a plain normed GEMV and no kernel of
  its own does the SiLU.
Tiles are (BLOCK_N, BLOCK_K, num_warps) as the engine's. The kernel is the engine's with the
switches added, kept apart so that the engine's kernel stays the one its GPU tests ran: the
switch that wins on the GPU moves into engine/models/fused_gemv.py, and this module goes.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from engine import pdl
from engine.models import fused_gemv


def interleave(gate_up: torch.Tensor, block: int) -> torch.Tensor:
    """gate_up [2N, K] (gate rows, then up rows) -> the same rows in blocks of `block` gate
    rows followed by the same channels' up rows (N a multiple of block)."""
    n = gate_up.shape[0] // 2
    if n % block:
        raise ValueError(f"{n} channels do not split into blocks of {block}")
    gate, up = gate_up[:n], gate_up[n:]
    blocks = torch.stack([gate.reshape(n // block, block, -1), up.reshape(n // block, block, -1)])
    return blocks.transpose(0, 1).reshape(2 * n, -1).contiguous()


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def candidate_gemv(
        x_ptr,
        w_ptr,
        norm_ptr,
        out_ptr,
        M,
        N,
        K,
        eps,
        x_row_stride,
        out_row_stride,
        ROWS: tl.constexpr,
        NORM: tl.constexpr,
        SILU: tl.constexpr,
        ADD: tl.constexpr,
        SUM_EACH_STEP: tl.constexpr,
        INTERLEAVED: tl.constexpr,
        SILU_INPUT: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """The engine's fused_gemv with the module docstring's three switches."""
        pid = tl.program_id(0)
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.arange(0, ROWS)
        col_ok = cols < N
        row_ok = rows < M
        if SUM_EACH_STEP:
            acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
            acc_up = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        else:
            acc = tl.zeros((ROWS, BLOCK_N, BLOCK_K), dtype=tl.float32)
            acc_up = tl.zeros((ROWS, BLOCK_N, BLOCK_K), dtype=tl.float32)
        squares = tl.zeros((ROWS, BLOCK_K), dtype=tl.float32)
        if INTERLEAVED:
            first = 2 * pid * BLOCK_N + tl.arange(0, BLOCK_N)
            gate_rows = w_ptr + first[:, None].to(tl.int64) * K
            up_rows = gate_rows + BLOCK_N * K
        else:
            gate_rows = w_ptr + cols[:, None].to(tl.int64) * K
            up_rows = w_ptr + (cols[:, None] + N).to(tl.int64) * K
        if PDL:
            tl.extra.cuda.gdc_wait()
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            w_ok = col_ok[:, None] & k_ok[None, :]
            gate = tl.load(gate_rows + ks[None, :], mask=w_ok, other=0.0)
            up = gate
            if SILU:
                up = tl.load(up_rows + ks[None, :], mask=w_ok, other=0.0)
            x_at = x_ptr + rows[:, None] * x_row_stride + ks[None, :]
            x_ok = row_ok[:, None] & k_ok[None, :]
            x = tl.load(x_at, mask=x_ok, other=0.0).to(tl.float32)
            if SILU_INPUT:  # x holds gate's output; up's is K columns on
                x_up = tl.load(x_at + K, mask=x_ok, other=0.0).to(tl.float32)
                x = x / (1.0 + tl.exp(-x)) * x_up
            if NORM:
                squares += x * x
                x = x * tl.load(norm_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            product = x[:, None, :] * gate.to(tl.float32)[None, :, :]
            if SUM_EACH_STEP:
                acc += tl.sum(product, axis=2)
            else:
                acc += product
            if SILU:
                product_up = x[:, None, :] * up.to(tl.float32)[None, :, :]
                if SUM_EACH_STEP:
                    acc_up += tl.sum(product_up, axis=2)
                else:
                    acc_up += product_up
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        inv_rms = tl.full((ROWS,), 1.0, tl.float32)
        if NORM:
            inv_rms = 1.0 / tl.sqrt(tl.sum(squares, axis=1) / K + eps)
        if SUM_EACH_STEP:
            gate_sum = acc
            up_sum = acc_up
        else:
            gate_sum = tl.sum(acc, axis=2)
            up_sum = tl.sum(acc_up, axis=2)
        out = gate_sum * inv_rms[:, None]
        if SILU:
            out = out / (1.0 + tl.exp(-out)) * (up_sum * inv_rms[:, None])
        out_ok = row_ok[:, None] & col_ok[None, :]
        out_at = out_ptr + rows[:, None] * out_row_stride + cols[None, :]
        if ADD:
            out += tl.load(out_at, mask=out_ok, other=0.0).to(tl.float32)
        tl.store(out_at, out.to(out_ptr.dtype.element_ty), mask=out_ok)

    return candidate_gemv


def candidate_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    tile: tuple[int, int, int],
    *,
    norm: torch.Tensor | None = None,
    eps: float = 1e-5,
    silu: bool = False,
    add: bool = False,
    sum_each_step: bool = False,
    interleaved: bool = False,
    silu_input: bool = False,
) -> torch.Tensor:
    """out [M, N] (=, or += with add) the candidate's product of x [M, K] (with silu_input
    [M, 2K]: gate's output, then up's) and weight ([N, K]; [2N, K] with silu, interleaved in
    blocks of tile's BLOCK_N when interleaved)."""
    import triton

    block_n, block_k, warps = tile
    num_rows, n = out.shape
    k = x.shape[1] // (2 if silu_input else 1)
    if weight.shape != ((2 if silu else 1) * n, k) or not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous [{(2 if silu else 1) * n}, {k}]")
    if interleaved and (not silu or n % block_n):
        raise ValueError("an interleaved weight is gate/up's, in whole blocks of BLOCK_N")
    if silu_input and norm is not None:
        raise ValueError("silu_input forms the input in the kernel: no norm before it")
    x = x.contiguous()
    use_pdl = pdl.enabled(x.device)  # as the engine's kernels launch
    _kernel()[(triton.cdiv(n, block_n),)](
        x,
        weight,
        weight if norm is None else norm,
        out,
        num_rows,
        n,
        k,
        eps,
        x.stride(0),
        out.stride(0),
        ROWS=fused_gemv.padded_rows(num_rows),
        NORM=norm is not None,
        SILU=silu,
        ADD=add,
        SUM_EACH_STEP=sum_each_step,
        INTERLEAVED=interleaved,
        SILU_INPUT=silu_input,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PDL=use_pdl,
        num_warps=warps,
        launch_pdl=use_pdl,
    )
    return out
