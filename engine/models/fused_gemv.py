"""One-row decode projections of bf16 / fp16 weights as Triton GEMVs with their neighbours fused
in: the RMSNorm before qkv_proj and gate_up_proj, SiLU-and-mul after gate_up_proj, the residual
add after o_proj and down_proj. Owns no state (imports triton on first use).

Why: a batch-1 decode step of the 8B shape is bound by reading 14 GB of weights, yet on an H200
cuBLAS's graph replay took 1.34x the weight-read roofline (bench/RESULTS.md): besides its GEMV
tiles it ran split-K reductions (0.11 ms a step), 64 add + RMSNorm launches (0.19 ms) and 32
SiLU launches (0.05 ms), each of them a few microseconds of latency. Here a layer is four GEMV
launches plus RoPE and attention: the norm's sum of squares is taken in the same pass over K
that reads the input (every program reads the whole, L2-resident, input row), the gate and up
rows of an output channel are read by the same program, and the residual is added where the
output is written. No split-K: each program owns BLOCK_N output channels over all of K.

Tiles: fixed per projection kind (tile_for), from bench.fused_gemv_bench on an H200, each call
timed in a chain over weights L2 cannot hold, launched with PDL as the engine does: a normed
projection without SiLU (qkv) reads fastest 8 channels x 512 a step, the others 4 x 1024.
Triton's autotuner, timing each call alone, picked tiles 7-24% slower for the qkv and o shapes
there, and asking for each weight tile a step ahead lost in the chain too, so neither is used.

Steps of one token row (MAX_ROWS) take these kernels: the 8B bf16 shape's batch-1 graph replay
on an H200 went from 4.43 to 4.14 ms with them (bench/RESULTS.md). Larger steps keep cuBLAS and
FlashInfer's fused norms.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from engine.execution import pdl

MAX_ROWS = 1  # steps of this many rows take the kernels
DTYPES = (torch.bfloat16, torch.float16)  # of the models that take them
NORMED_TILE = (8, 512, 4)  # (BLOCK_N, BLOCK_K, num_warps): qkv_proj's (norm, no SiLU)
OTHER_TILE = (4, 1024, 4)  # o_proj, gate_up_proj (norm + SiLU), down_proj
ACCUMULATOR_FLOATS_PER_THREAD = 64  # BLOCK_N x BLOCK_K (x2 with SiLU) over the threads
INTERPRETER_TILE = (8, 128, 4)  # Triton's interpreter: small, so that tests cover partial tiles


def plain_linear(layer: nn.Module, dtype: torch.dtype) -> bool:
    """layer is an unquantized Linear without bias, in dtype, contiguous."""
    return (
        isinstance(layer, nn.Linear)
        and layer.bias is None
        and layer.weight.dtype == dtype
        and layer.weight.is_contiguous()
    )


def takes(x: torch.Tensor, plain_projections: list[nn.Module]) -> bool:
    """Whether a step whose hidden states are x runs on the fused GEMVs: one row on a CUDA
    device, and the model's projections all plain Linears (plain_projections: them, or [] when
    any is not)."""
    rows_ok = x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS
    return rows_ok and x.is_cuda and x.dtype in DTYPES and bool(plain_projections)


def share_storage(*tensors: torch.Tensor) -> bool:
    """Whether any two of tensors are views of one storage (an in-place kernel refuses them:
    its programs would read what others have written)."""
    storages = [t.untyped_storage().data_ptr() for t in tensors]
    return len(set(storages)) < len(storages)


def tile_for(norm: bool, silu: bool) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) of a call: NORMED_TILE for a normed projection without
    SiLU (qkv), else OTHER_TILE; each keeps its accumulator within
    ACCUMULATOR_FLOATS_PER_THREAD a thread."""
    return NORMED_TILE if norm and not silu else OTHER_TILE


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def fused_gemv(
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
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """One program per BLOCK_N output channels, all M (<= ROWS) rows, over the whole of K:
        acc[r, n, k] += x[r, k] (* norm[k]) * w[n, k] in fp32, summed along k at the end.
        NORM: times rsqrt(mean(x^2) + eps), the sum of squares taken in the same pass. SILU: w
        has 2N rows, gate (n) and up (N + n) in one program, out = silu(gate) * up. ADD: out +=
        its own values (the residual, in place: each program reads and writes only its own
        channels). PDL: wait for the kernel before, let the next one in after the loop."""
        pid = tl.program_id(0)
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.arange(0, ROWS)
        col_ok = cols < N
        row_ok = rows < M
        acc = tl.zeros((ROWS, BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc_up = tl.zeros((ROWS, BLOCK_N, BLOCK_K), dtype=tl.float32)
        squares = tl.zeros((ROWS, BLOCK_K), dtype=tl.float32)
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
            x = tl.load(
                x_ptr + rows[:, None] * x_row_stride + ks[None, :],
                mask=row_ok[:, None] & k_ok[None, :],
                other=0.0,
            ).to(tl.float32)
            if NORM:
                squares += x * x
                x = x * tl.load(norm_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            acc += x[:, None, :] * gate.to(tl.float32)[None, :, :]
            if SILU:
                acc_up += x[:, None, :] * up.to(tl.float32)[None, :, :]
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        inv_rms = tl.full((ROWS,), 1.0, tl.float32)
        if NORM:
            inv_rms = 1.0 / tl.sqrt(tl.sum(squares, axis=1) / K + eps)
        out = tl.sum(acc, axis=2) * inv_rms[:, None]
        if SILU:
            up_out = tl.sum(acc_up, axis=2) * inv_rms[:, None]
            out = out / (1.0 + tl.exp(-out)) * up_out
        out_ok = row_ok[:, None] & col_ok[None, :]
        if ADD:
            res = tl.load(
                out_ptr + rows[:, None] * out_row_stride + cols[None, :], mask=out_ok, other=0.0
            )
            out += res.to(tl.float32)
        tl.store(
            out_ptr + rows[:, None] * out_row_stride + cols[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=out_ok,
        )

    return fused_gemv


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    n: int,
    norm: torch.Tensor | None = None,
    eps: float = 0.0,
    silu: bool = False,
    residual: torch.Tensor | None = None,
    tile: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """tile: run this (BLOCK_N, BLOCK_K, num_warps) instead of tile_for's (tests; Triton's
    interpreter runs INTERPRETER_TILE unless given one)."""
    import triton

    num_rows, k = x.shape
    if num_rows > MAX_ROWS:
        raise ValueError(f"the fused GEMVs take at most {MAX_ROWS} row, got {num_rows}")
    if weight.shape != ((2 if silu else 1) * n, k) or not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous [{(2 if silu else 1) * n}, {k}]")
    if out.shape != (num_rows, n) or out.stride(-1) != 1:
        raise ValueError(f"the output must be [{num_rows}, {n}] with contiguous rows")
    if norm is not None and (norm.shape != (k,) or not norm.is_contiguous()):
        raise ValueError(f"the norm's weight must be contiguous [{k}]")
    if residual is not None and residual is not out:
        raise ValueError("the residual add writes into the residual itself")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if num_rows == 0:
        return out
    if tile is None and not x.is_cuda:
        tile = INTERPRETER_TILE
    block_n, block_k, warps = tile or tile_for(norm is not None, silu)
    use_pdl = pdl.enabled(x.device)
    _kernel()[(triton.cdiv(n, block_n),)](
        x,
        weight,
        weight if norm is None else norm,  # read only when NORM
        out,
        num_rows,
        n,
        k,
        eps,
        x.stride(0),
        out.stride(0),
        ROWS=MAX_ROWS,
        NORM=norm is not None,
        SILU=silu,
        ADD=residual is not None,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PDL=use_pdl,
        num_warps=warps,
        launch_pdl=use_pdl,
    )
    return out


def normed_gemv(
    hidden: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor
) -> torch.Tensor:
    """(rmsnorm(hidden) * norm_weight) @ weight^T: hidden [M, K], weight [N, K] -> [M, N]."""
    out = hidden.new_empty((hidden.shape[0], weight.shape[0]))
    return _launch(hidden, weight, out, weight.shape[0], norm=norm_weight, eps=eps)


def normed_gemv_silu(
    hidden: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate_up: torch.Tensor
) -> torch.Tensor:
    """silu(g) * u of (rmsnorm(hidden) * norm_weight) @ gate_up^T, g its first N = rows / 2
    channels and u the rest: hidden [M, K], gate_up [2N, K] -> [M, N]."""
    n = gate_up.shape[0] // 2
    out = hidden.new_empty((hidden.shape[0], n))
    return _launch(hidden, gate_up, out, n, norm=norm_weight, eps=eps, silu=True)


def gemv_add_(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """In place: residual += x @ weight^T (x [M, K], weight [N, K], residual [M, N]; x must
    not share residual's storage: other programs would read what one has written)."""
    if share_storage(x, residual):
        raise ValueError("gemv_add_'s input shares the residual's storage")
    return _launch(x, weight, residual, weight.shape[0], residual=residual)
