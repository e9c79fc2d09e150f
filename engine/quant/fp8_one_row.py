"""One-row decode steps over FP8 weights as four Triton GEMVs a layer that quantize their own
input, with their neighbours fused in as the bf16 ones (engine/models/fused_gemv.py) do: the
RMSNorm before qkv_proj and gate_up_proj, SiLU-and-mul after gate_up_proj, the residual add after
o_proj and down_proj. Owns no state but the setting read once from the environment (imports
triton on first use).

Why: with FP8 weights a batch-1 step of the 8B shape on an H200 is 9 kernels a layer (add +
RMSNorm + quantize, qkv, RoPE, attention, o, add + RMSNorm + quantize, gate/up, SiLU-and-mul +
quantize, down), and the three quantizing kernels alone took 8.1 us of a layer's 87
(bench/RESULTS.md, issue 12's seventeenth round). Here each program reads the whole bf16 input
row (from L2) for its scale (the amax of the row to be quantized, / 448), then quantizes each
input tile as it multiplies it with the e4m3 weight tile on tensor cores (fp8_dot_rows's
product; the row broadcast to the 16 rows a tensor-core product needs): a layer is 4 GEMVs,
RoPE and attention. The rounding is quantize_rows's (the row rounded to bf16, then scaled, then
rounded to e4m3's grid); with a norm the scale is amax(x * weight) times the row's 1/rms, equal up
to float rounding.

KVRELAY_FP8_ONE_ROW=1: steps of one row over a model whose projections are all dynamically
scaled (per-token) bias-free Fp8Linears take these kernels; off by default until measured in
the engine (bench.fused_gemv_bench --fp8 times them against the engine's path per projection).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from engine import pdl
from engine.env_flags import on_off
from engine.models.fused_gemv import share_storage
from engine.quant import split_k as splits
from engine.quant.fp8 import Fp8Linear
from engine.quant.fp8_dot_rows import BLOCK_M, WIDE_TILE
from engine.quant.fp8_dot_rows import tile_for as dot_rows_tile
from engine.quant.fp8_types import AMAX_FLOOR, FP8_MAX

ENV = "KVRELAY_FP8_ONE_ROW"
PROLOGUE_BLOCK = 4096  # input columns a prologue step reads (32 a thread at 4 warps)
E4M3_MIN_NORMAL = 2.0**-6  # below it e4m3 has subnormals, a fixed step of 2^-9
SUBNORMAL_SHIFT = 1.5 * 2.0**14  # float32's step at this size is e4m3's subnormal one


@functools.cache
def enabled() -> bool:
    """Whether one-row steps may take these kernels (read once; cache_clear to re-read)."""
    return on_off(ENV, False)


def row_linear(layer: nn.Module) -> bool:
    """layer is an Fp8Linear these kernels take: per-token (dynamic) input scales, no bias."""
    return isinstance(layer, Fp8Linear) and layer.input_scale is None and layer.bias is None


def takes(x: torch.Tensor, row_projections: list[nn.Module]) -> bool:
    """Whether a step whose hidden states are x runs on these kernels: enabled, one bf16 row on
    a CUDA device, and the model's projections all row_linear (row_projections: them, or []
    when any is not)."""
    one_row = x.dim() == 2 and x.shape[0] == 1 and x.is_cuda and x.dtype == torch.bfloat16
    return one_row and enabled() and bool(row_projections)


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def fp8_one_row_dot(
        x_ptr,
        norm_ptr,
        w_ptr,
        w_scale_ptr,
        out_ptr,
        ws_ptr,
        counter_ptr,
        N,
        K,
        eps,
        SPLIT_K: tl.constexpr,
        NORM: tl.constexpr,
        SILU: tl.constexpr,
        ADD: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PROLOGUE: tl.constexpr,
        FP8_MAX: tl.constexpr,
        AMAX_FLOOR: tl.constexpr,
        E4M3_MIN_NORMAL: tl.constexpr,
        SUBNORMAL_SHIFT: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """One row. Prologue: 1/rms (NORM) and the amax of the row to be quantized, so scale =
        amax / FP8_MAX. Loop over K: the row's tile made (normed, rounded to x's dtype),
        divided by the scale, cast to e4m3 and broadcast to the BLOCK_M rows a tensor-core
        product needs (only the first is stored), times the e4m3 weight tile. Epilogue: the
        row and channel scales, SiLU pairing, residual add. SPLIT_K > 1 (not with SiLU): the
        program's part of K (split_k.py), the last part's program does the epilogue."""
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
        k_start, k_end = splits.part_bounds(K, SPLIT_K, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            x = tl.load(x_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
            if NORM:
                weight = tl.load(norm_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
                x = (x * inv_rms * weight).to(x_ptr.dtype.element_ty).to(tl.float32)
            v = tl.minimum(tl.maximum(x / scale, -FP8_MAX), FP8_MAX)
            # v rounded to e4m3's grid, to nearest even, in float32, so that the cast to e4m3
            # is exact (Triton's interpreter rounds that cast wrongly when the mantissa carries
            # into the exponent): 3 mantissa bits in the normal range; below 2^-6 the
            # subnormals' fixed step 2^-9, by adding and taking away 1.5 * 2^14 (whose float32
            # step that is)
            bits = v.to(tl.int32, bitcast=True)
            bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000  # = 0xFFF00000
            subnormal = (v + SUBNORMAL_SHIFT) - SUBNORMAL_SHIFT
            v = tl.where(tl.abs(v) < E4M3_MIN_NORMAL, subnormal, bits.to(tl.float32, bitcast=True))
            q = tl.broadcast_to(v.to(tl.float8e4nv)[None, :], (BLOCK_M, BLOCK_K))
            w_ok = col_ok[:, None] & k_ok[None, :]
            w = tl.load(w_ptr + cols[:, None].to(tl.int64) * K + ks[None, :], mask=w_ok, other=0.0)
            acc = tl.dot(q, tl.trans(w), acc)
            if SILU:
                up_at = w_ptr + (cols[:, None] + N).to(tl.int64) * K + ks[None, :]
                acc_up = tl.dot(q, tl.trans(tl.load(up_at, mask=w_ok, other=0.0)), acc_up)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        dots = tl.max(acc, axis=0)  # the rows are equal: take one
        last = True
        if SPLIT_K > 1:  # the workspace is [SPLIT_K, N]
            last, dots = splits.sum_parts(dots, ws_ptr, counter_ptr, cols, col_ok, pid, N, SPLIT_K)
        if last:
            out = dots * scale * tl.load(w_scale_ptr + cols, mask=col_ok, other=0.0)
            if SILU:
                up_scale = tl.load(w_scale_ptr + N + cols, mask=col_ok, other=0.0)
                out = out / (1.0 + tl.exp(-out)) * (tl.max(acc_up, axis=0) * scale * up_scale)
            if ADD:
                out += tl.load(out_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
            tl.store(out_ptr + cols, out.to(out_ptr.dtype.element_ty), mask=col_ok)

    return fp8_one_row_dot


def normed_dot(
    x: torch.Tensor, norm_weight: torch.Tensor, eps: float, layer: Fp8Linear
) -> torch.Tensor:
    """layer(rmsnorm(x) * norm_weight) for the row x [1, K] -> [1, N]."""
    out = x.new_empty((1, layer.out_features))
    return _launch(x, layer, out, norm=norm_weight, eps=eps)


def normed_dot_silu(
    x: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate_up: Fp8Linear
) -> torch.Tensor:
    """silu(g) * u of gate_up(rmsnorm(x) * norm_weight), g its first N = out_features / 2
    channels and u the rest: x [1, K] -> [1, N]."""
    out = x.new_empty((1, gate_up.out_features // 2))
    return _launch(x, gate_up, out, norm=norm_weight, eps=eps, silu=True)


def dot_add_(x: torch.Tensor, layer: Fp8Linear, residual: torch.Tensor) -> torch.Tensor:
    """In place: residual += layer(x) for the row x [1, K], residual [1, N] (not x's storage)."""
    if share_storage(x, residual):
        raise ValueError("dot_add_'s input shares the residual's storage")
    return _launch(x, layer, residual, add=True)


def _launch(
    x: torch.Tensor,
    layer: Fp8Linear,
    out: torch.Tensor,
    *,
    norm: torch.Tensor | None = None,
    eps: float = 0.0,
    silu: bool = False,
    add: bool = False,
) -> torch.Tensor:
    return row_dot(
        x, layer.weight, layer.weight_scale, out, tile_for(out.shape[-1], silu),
        norm=norm, eps=eps, silu=silu, add=add,
    )  # fmt: skip


def tile_for(num_channels: int, silu: bool) -> tuple[int, int, int, int]:
    """fp8_dot_rows's fixed tile for num_channels output channels; with SiLU (two weight rows
    a channel) the wide one at half the channels, so that a step reads as many rows."""
    if silu:
        block_n, block_k, warps, stages = WIDE_TILE
        return block_n // 2, block_k, warps, stages
    return dot_rows_tile(num_channels)


def row_dot(
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
    split_k: int | None = None,
) -> torch.Tensor:
    """out [1, N] (=, or += with add) the product of the row x [1, K] bf16 (rmsnorm(x) * norm
    with a norm), quantized in the kernel, and weight e4m3 ([N, K]; [2N, K] gate then up with
    silu) with float32 per-channel weight_scale; tile (BLOCK_N, BLOCK_K, warps, stages);
    split_k: K's parts (split_k.py; not with silu) instead of split_for's."""
    import triton

    block_n, block_k, warps, stages = tile
    k, n = x.shape[-1], out.shape[-1]
    if x.shape != (1, k) or out.shape != (1, n):
        raise ValueError("x and out must be one row each")
    if weight.shape != ((2 if silu else 1) * n, k) or not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous [{(2 if silu else 1) * n}, {k}]")
    if weight_scale.numel() != weight.shape[0]:
        raise ValueError("the weight needs one scale per output channel")
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    x = x.contiguous()
    use_pdl = pdl.enabled(x.device)
    num_tiles = triton.cdiv(n, block_n)
    if silu and split_k not in (None, 1):
        raise ValueError("the SiLU pairing takes no split_k")
    split_k, workspace, counters = splits.launch_parts(
        1 if silu else split_k, num_tiles, k, block_k, (n,), out
    )
    _kernel()[(num_tiles, split_k)](
        x,
        weight_scale if norm is None else norm,  # read only when NORM
        weight,
        weight_scale.reshape(-1),
        out,
        workspace,
        counters,
        n,
        k,
        eps,
        SPLIT_K=split_k,
        NORM=norm is not None,
        SILU=silu,
        ADD=add,
        BLOCK_M=BLOCK_M,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PROLOGUE=min(PROLOGUE_BLOCK, triton.next_power_of_2(k)),
        FP8_MAX=FP8_MAX,
        AMAX_FLOOR=AMAX_FLOOR,
        E4M3_MIN_NORMAL=E4M3_MIN_NORMAL,
        SUBNORMAL_SHIFT=SUBNORMAL_SHIFT,
        PDL=use_pdl,
        num_warps=warps,
        num_stages=stages,
        launch_pdl=use_pdl,
    )
    return out
