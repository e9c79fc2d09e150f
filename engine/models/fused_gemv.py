"""Few-row decode projections of bf16 / fp16 weights as Triton GEMVs with their neighbours fused
in: the RMSNorm before qkv_proj and gate_up_proj, SiLU-and-mul after gate_up_proj, the residual
add after o_proj and down_proj. Owns no state but the settings read once from the environment
(imports triton on first use).

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

KVRELAY_BF16_GEMV_ROWS: steps of at most this many token rows take these kernels (default
ROWS_DEFAULT; 0: never, cuBLAS and FlashInfer's fused norms as before; at most MAX_ROWS).
KVRELAY_GATE_UP_BLAS=1 (not for fp16 models, whose range the unnormalized product may leave):
gate/up as cuBLAS's product of the residual times the norm's weight (o_proj's GEMV writes it
beside the residual), 1/rms and the SiLU in silu_and_mul_rms after; in a chain cuBLAS read
gate/up's weights in 56.9 us where normed_gemv_silu took 64.1 (H200), but the engine's step with
it is not measured yet, so it is off by default.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
from torch import nn

from engine import pdl
from engine.env_flags import on_off

ROWS_ENV = "KVRELAY_BF16_GEMV_ROWS"
GATE_UP_BLAS_ENV = "KVRELAY_GATE_UP_BLAS"
GATE_UP_BLAS_DEFAULT = False
ROWS_DEFAULT = 1
MAX_ROWS = 2  # the fp32 accumulator is rows x BLOCK_N x BLOCK_K registers' worth (x2 for SiLU)
DTYPES = (torch.bfloat16, torch.float16)  # of the models that take them
NORMED_TILE = (8, 512, 4)  # (BLOCK_N, BLOCK_K, num_warps): qkv_proj's (norm, no SiLU)
OTHER_TILE = (4, 1024, 4)  # o_proj, gate_up_proj (norm + SiLU), down_proj
ACCUMULATOR_FLOATS_PER_THREAD = 64  # rows x BLOCK_N x BLOCK_K (x2 with SiLU) over the threads
INTERPRETER_TILE = (8, 128, 4)  # Triton's interpreter: small, so that tests cover partial tiles


@functools.cache
def max_rows() -> int:
    """Steps of up to this many rows take the fused GEMVs (read once; cache_clear to re-read);
    a value that is not 0..MAX_ROWS is refused by the variable's name."""
    raw = os.environ.get(ROWS_ENV, str(ROWS_DEFAULT)).strip()
    if not raw.isdigit() or int(raw) > MAX_ROWS:
        raise ValueError(f"{ROWS_ENV} must be 0..{MAX_ROWS}, got {raw!r}")
    return int(raw)


@functools.cache
def gate_up_on_blas() -> bool:
    """Whether the few-row path runs gate_up_proj as a plain cuBLAS product of the scaled,
    unnormalized residual (o_proj's GEMV writes it), with the norm's 1/rms and the SiLU in
    silu_and_mul_rms after it, instead of the fused normed_gemv_silu (read once)."""
    return on_off(GATE_UP_BLAS_ENV, GATE_UP_BLAS_DEFAULT)


def plain_linear(layer: nn.Module, dtype: torch.dtype) -> bool:
    """layer is an unquantized Linear (BlasLinear included) without bias, in dtype, contiguous."""
    return (
        isinstance(layer, nn.Linear)
        and layer.bias is None
        and layer.weight.dtype == dtype
        and layer.weight.is_contiguous()
    )


def takes(x: torch.Tensor, plain_projections: list[nn.Module]) -> bool:
    """Whether a step whose hidden states are x runs on the fused GEMVs: few enough rows on a
    CUDA device, and the model's projections all plain Linears (plain_projections: them, or []
    when any is not)."""
    rows_ok = x.dim() == 2 and 0 < x.shape[0] <= max_rows()
    return rows_ok and x.is_cuda and x.dtype in DTYPES and bool(plain_projections)


def share_storage(*tensors: torch.Tensor) -> bool:
    """Whether any two of tensors are views of one storage (an in-place kernel refuses them:
    its programs would read what others have written)."""
    storages = [t.untyped_storage().data_ptr() for t in tensors]
    return len(set(storages)) < len(storages)


def padded_rows(num_rows: int) -> int:
    """The kernel's ROWS for num_rows rows: the next power of two."""
    return 1 << max(0, (num_rows - 1).bit_length())


def tile_for(num_rows: int, norm: bool, silu: bool) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) of a call: NORMED_TILE or OTHER_TILE, BLOCK_N halved
    until the accumulator fits ACCUMULATOR_FLOATS_PER_THREAD a thread."""
    block_n, block_k, warps = NORMED_TILE if norm and not silu else OTHER_TILE
    per_channel = padded_rows(num_rows) * block_k * (2 if silu else 1)
    while block_n > 1 and block_n * per_channel > ACCUMULATOR_FLOATS_PER_THREAD * 32 * warps:
        block_n //= 2
    return block_n, block_k, warps


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
        scaled_ptr,
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
        SCALED: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """One program per BLOCK_N output channels, all M (<= ROWS) rows, over the whole of K:
        acc[r, n, k] += x[r, k] (* norm[k]) * w[n, k] in fp32, summed along k at the end.
        NORM: times rsqrt(mean(x^2) + eps), the sum of squares taken in the same pass. SILU: w
        has 2N rows, gate (n) and up (N + n) in one program, out = silu(gate) * up. ADD: out +=
        its own values (the residual, in place: each program reads and writes only its own
        channels). SCALED (with ADD): also scaled = out * norm[n], the next RMSNorm's weight
        applied to the new residual (its 1/rms is left to the kernel after the next product).
        PDL: wait for the kernel before, let the next one in after the loop."""
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
        if SCALED:
            weight_of_col = tl.load(norm_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
            tl.store(
                scaled_ptr + rows[:, None] * out_row_stride + cols[None, :],
                (out.to(out_ptr.dtype.element_ty).to(tl.float32) * weight_of_col[None, :]).to(
                    out_ptr.dtype.element_ty
                ),
                mask=out_ok,
            )
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
    scaled: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """tile: run this (BLOCK_N, BLOCK_K, num_warps) instead of tile_for's (tests, benches;
    Triton's interpreter runs INTERPRETER_TILE unless given one). scaled (with residual):
    (buffer shaped as out, weight [n]) to receive the new residual times weight."""
    import triton

    num_rows, k = x.shape
    if num_rows > MAX_ROWS:
        raise ValueError(f"the fused GEMVs take at most {MAX_ROWS} rows, got {num_rows}")
    if weight.shape != ((2 if silu else 1) * n, k) or not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous [{(2 if silu else 1) * n}, {k}]")
    if out.shape != (num_rows, n) or out.stride(-1) != 1:
        raise ValueError(f"the output must be [{num_rows}, {n}] with contiguous rows")
    if norm is not None and (norm.shape != (k,) or not norm.is_contiguous()):
        raise ValueError(f"the norm's weight must be contiguous [{k}]")
    if residual is not None and residual is not out:
        raise ValueError("the residual add writes into the residual itself")
    if scaled is not None and (
        residual is None
        or norm is not None
        or scaled[0].shape != out.shape
        or scaled[0].stride() != out.stride()
        or scaled[1].shape != (n,)
        or not scaled[1].is_contiguous()
    ):
        raise ValueError(f"the scaled copy needs the residual add, out's layout and a [{n}] weight")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if num_rows == 0:
        return out
    if tile is None and not x.is_cuda:
        tile = INTERPRETER_TILE
    block_n, block_k, warps = tile or tile_for(num_rows, norm is not None, silu)
    use_pdl = pdl.enabled(x.device)
    _kernel()[(triton.cdiv(n, block_n),)](
        x,
        weight,
        # read only when NORM (over K) or SCALED (over N)
        (scaled[1] if scaled is not None else weight) if norm is None else norm,
        out,
        out if scaled is None else scaled[0],
        num_rows,
        n,
        k,
        eps,
        x.stride(0),
        out.stride(0),
        ROWS=padded_rows(num_rows),
        NORM=norm is not None,
        SILU=silu,
        ADD=residual is not None,
        SCALED=scaled is not None,
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


def gemv_add_scaled_(
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    scaled: torch.Tensor,
) -> torch.Tensor:
    """gemv_add_, and scaled = the new residual * norm_weight (the next RMSNorm's weight; its
    1/rms is left to silu_and_mul_rms): scaled is shaped as residual, norm_weight [N]."""
    if share_storage(x, residual, scaled):
        raise ValueError(
            "gemv_add_scaled_'s input, residual and scaled copy must not share storage"
        )
    n = weight.shape[0]
    return _launch(x, weight, residual, n, residual=residual, scaled=(scaled, norm_weight))


@functools.cache
def _silu_rms_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def silu_and_mul_rms(
        gate_up_ptr,
        residual_ptr,
        out_ptr,
        N,
        K,
        eps,
        gate_up_row_stride,
        residual_row_stride,
        out_row_stride,
        BLOCK: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """Program (row, block): r = 1/rms of the residual row (read whole, from L2), then
        out = silu(r * gate) * (r * up) over BLOCK channels. PDL: let the next kernel in at the
        start (it waits for this one to finish anyway)."""
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        col_ok = cols < N
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(residual_ptr + row * residual_row_stride + ks, mask=ks < K, other=0.0)
            squares += x.to(tl.float32) * x.to(tl.float32)
        inv_rms = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / K + eps)
        at = gate_up_ptr + row * gate_up_row_stride + cols
        gate = tl.load(at, mask=col_ok, other=0.0).to(tl.float32) * inv_rms
        up = tl.load(at + N, mask=col_ok, other=0.0).to(tl.float32) * inv_rms
        out = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + row * out_row_stride + cols, out.to(out_ptr.dtype.element_ty), col_ok)

    return silu_and_mul_rms


SILU_RMS_BLOCK = 256  # channels a program (56 of them for 14,336); each reads the residual row


def silu_and_mul_rms(gate_up: torch.Tensor, residual: torch.Tensor, eps: float) -> torch.Tensor:
    """silu(r * g) * (r * u), r = 1/rms(residual) per row: gate_up [M, 2N] (g its first N
    columns) is the product of the norm's weight-scaled, not yet normalized, input
    (gemv_add_scaled_'s); residual [M, K] that input before scaling -> [M, N]."""
    import triton

    num_rows, two_n = gate_up.shape
    if residual.shape[0] != num_rows or two_n % 2:
        raise ValueError(f"gate_up [{num_rows}, 2N] and residual [{num_rows}, K] do not pair")
    if gate_up.stride(-1) != 1 or residual.stride(-1) != 1:
        raise ValueError("gate_up's and the residual's rows must be contiguous")
    n, k = two_n // 2, residual.shape[1]
    out = gate_up.new_empty((num_rows, n))
    if num_rows == 0:
        return out
    use_pdl = pdl.enabled(gate_up.device)
    block = SILU_RMS_BLOCK if gate_up.is_cuda else 128
    _silu_rms_kernel()[(num_rows, triton.cdiv(n, block))](
        gate_up,
        residual,
        out,
        n,
        k,
        eps,
        gate_up.stride(0),
        residual.stride(0),
        out.stride(0),
        BLOCK=block,
        BLOCK_K=min(4096, triton.next_power_of_2(k)) if gate_up.is_cuda else 128,
        PDL=use_pdl,
        num_warps=4,
        launch_pdl=use_pdl,
    )
    return out
