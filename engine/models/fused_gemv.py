"""Few-row decode projections of bf16 / fp16 weights as Triton GEMVs with their neighbours fused
in: the RMSNorm before qkv_proj and gate_up_proj, SiLU-and-mul after gate_up_proj, the residual
add after o_proj and down_proj. Owns no state but the row limit read once from the environment
(imports triton on first use).

Why: a batch-1 decode step of the 8B shape is bound by reading 14 GB of weights, yet on an H200
cuBLAS's graph replay took 1.34x the weight-read roofline (bench/RESULTS.md): besides its GEMV
tiles it ran split-K reductions (0.11 ms a step), 64 add + RMSNorm launches (0.19 ms) and 32
SiLU launches (0.05 ms), each of them a few microseconds of latency. Here a layer is four GEMV
launches plus RoPE and attention: the norm's sum of squares is taken in the same pass over K
that reads the input (every program reads the whole, L2-resident, input row), the gate and up
rows of an output channel are read by the same program, and the residual is added where the
output is written. No split-K: each program owns BLOCK_N output channels over all of K.

KVRELAY_BF16_GEMV_ROWS: steps of at most this many token rows take these kernels (default
ROWS_DEFAULT; 0: never, cuBLAS and FlashInfer's fused norms as before; at most MAX_ROWS).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
from torch import nn

from engine import pdl

ROWS_ENV = "KVRELAY_BF16_GEMV_ROWS"
ROWS_DEFAULT = 1
MAX_ROWS = 2  # the fp32 accumulator is rows x BLOCK_N x BLOCK_K registers' worth (x2 for SiLU)
DTYPES = (torch.bfloat16, torch.float16)  # of the models that take them
# (BLOCK_N, BLOCK_K, num_warps) the autotuner tries, each with AHEAD on and off
# (the 4096-wide ones: a whole 8B row of K a load, for the short-K qkv and o shapes)
TILES = (
    (2, 1024, 4),
    (4, 1024, 4),
    (4, 2048, 8),
    (8, 512, 4),
    (16, 512, 8),
    (1, 4096, 4),
    (2, 4096, 8),
    (2, 2048, 4),
)
INTERPRETER_TILE = {"BLOCK_N": 8, "BLOCK_K": 128, "AHEAD": True, "num_warps": 4}


@functools.cache
def max_rows() -> int:
    """Steps of up to this many rows take the fused GEMVs (read once; cache_clear to re-read);
    a value that is not 0..MAX_ROWS is refused by the variable's name."""
    raw = os.environ.get(ROWS_ENV, str(ROWS_DEFAULT)).strip()
    if not raw.isdigit() or int(raw) > MAX_ROWS:
        raise ValueError(f"{ROWS_ENV} must be 0..{MAX_ROWS}, got {raw!r}")
    return int(raw)


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


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    configs = [
        triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "AHEAD": ahead}, num_warps=w)
        for bn, bk, w in TILES
        for ahead in (False, True)
    ]

    def fits_registers(configs: list[Any], named_args: dict[str, Any], **kwargs: Any) -> list[Any]:
        """At most 64 accumulator floats a thread (rows x BLOCK_N x BLOCK_K, twice with SiLU)."""
        rows = kwargs.get("ROWS", named_args.get("ROWS", 1))
        silu = kwargs.get("SILU", named_args.get("SILU", False))
        per = rows * (2 if silu else 1)
        fit = [
            c
            for c in configs
            if per * c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_K"] <= 64 * 32 * c.num_warps
        ]
        return fit or configs[:1]

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
        AHEAD: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """One program per BLOCK_N output channels, all M (<= ROWS) rows, over the whole of K:
        acc[r, n, k] += x[r, k] (* norm[k]) * w[n, k] in fp32, summed along k at the end.
        NORM: times rsqrt(mean(x^2) + eps), the sum of squares taken in the same pass. SILU: w
        has 2N rows, gate (n) and up (N + n) in one program, out = silu(gate) * up. ADD: out += its
        own values (the residual, in place: each program reads and writes only its own
        channels). AHEAD: each
        weight tile is requested one K step before it is used (the first before the wait), so
        two are in flight. PDL: wait for the kernel before, let the next one in after the
        loop."""
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
        ks = tl.arange(0, BLOCK_K)
        w_ok = col_ok[:, None] & (ks < K)[None, :]
        if AHEAD:  # the first tiles before the wait: no kernel writes the weights
            gate = tl.load(gate_rows + ks[None, :], mask=w_ok, other=0.0)
            up = gate
            if SILU:
                up = tl.load(up_rows + ks[None, :], mask=w_ok, other=0.0)
        if PDL:
            tl.extra.cuda.gdc_wait()
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            w_ok = col_ok[:, None] & k_ok[None, :]
            if AHEAD:  # this tile was loaded last time round; ask for the next one first
                gate_now, up_now = gate, up
                next_ok = col_ok[:, None] & (ks + BLOCK_K < K)[None, :]
                gate = tl.load(gate_rows + BLOCK_K + ks[None, :], mask=next_ok, other=0.0)
                if SILU:
                    up = tl.load(up_rows + BLOCK_K + ks[None, :], mask=next_ok, other=0.0)
            else:
                gate_now = tl.load(gate_rows + ks[None, :], mask=w_ok, other=0.0)
                up_now = gate_now
                if SILU:
                    up_now = tl.load(up_rows + ks[None, :], mask=w_ok, other=0.0)
            x = tl.load(
                x_ptr + rows[:, None] * x_row_stride + ks[None, :],
                mask=row_ok[:, None] & k_ok[None, :],
                other=0.0,
            ).to(tl.float32)
            if NORM:
                squares += x * x
                x = x * tl.load(norm_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            acc += x[:, None, :] * gate_now.to(tl.float32)[None, :, :]
            if SILU:
                acc_up += x[:, None, :] * up_now.to(tl.float32)[None, :, :]
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

    tuned = triton.autotune(
        configs=configs,
        key=["N", "K", "ROWS", "NORM", "SILU", "ADD"],
        prune_configs_by={"early_config_prune": fits_registers},
        restore_value=["out_ptr"],  # timing an in-place add must not add it many times
    )(fused_gemv)
    return tuned, fused_gemv


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    n: int,
    norm: torch.Tensor | None = None,
    eps: float = 0.0,
    silu: bool = False,
    residual: torch.Tensor | None = None,
    tile: dict[str, Any] | None = None,
) -> torch.Tensor:
    """tile: run these BLOCK_N, BLOCK_K, AHEAD and num_warps instead of the autotuner's pick
    (tests; in Triton's interpreter a fixed tile is always used)."""
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
    if x.stride(-1) != 1:
        x = x.contiguous()
    if num_rows == 0:
        return out

    def grid(meta: dict[str, Any]) -> tuple[int]:
        return (triton.cdiv(n, meta["BLOCK_N"]),)

    use_pdl = pdl.enabled(x.device)
    tuned, untuned = _kernel()
    if tile is None and not x.is_cuda:  # Triton's interpreter cannot time configs
        tile = INTERPRETER_TILE
    kernel = tuned if tile is None else untuned
    kernel[grid](
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
        ROWS=1 << max(0, (num_rows - 1).bit_length()),
        NORM=norm is not None,
        SILU=silu,
        ADD=residual is not None,
        PDL=use_pdl,
        launch_pdl=use_pdl,
        **(tile or {}),
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
    if x.untyped_storage().data_ptr() == residual.untyped_storage().data_ptr():
        raise ValueError("gemv_add_'s input shares the residual's storage")
    return _launch(x, weight, residual, weight.shape[0], residual=residual)
