"""The MoE experts' GPU path: the routed (token, expert) pairs aligned into per-expert blocks on
the device, then two grouped GEMMs in Triton; owns no state (imports triton on first use).

Why our Triton kernels and not FlashInfer's fused MoE (0.7 has `cutlass_fused_moe`, which takes
bf16, and its docs list an SM90 CuTe-DSL bf16 one): theirs finish each token in their own
rounding (float32 routing weights applied to unrounded expert outputs) while the oracle is
transformers' (each expert's output rounded to bf16, Qwen's weights cast to bf16 first), they
take their own fc1 layout (TensorRT-LLM's up/gate order) and alignment constraints, and they
cannot run in the CPU tests. Ours (the shape of vLLM's and SGLang's fused_moe) keeps
transformers' rounding points (bit-equal to moe.reference_experts on an H100 at the
Qwen3-30B-A3B shape), runs in Triton's interpreter, and is captured by CUDA graphs. Timing
FlashInfer's against it on an H100 is the open question; if it wins, it becomes a path here.

The steps (align, then gate_up, then down):
1. align (one launch, a program an expert): the histogram of the T * k pairs' experts gives
   each expert's run, padded to whole BLOCK_M blocks, and its start; each program writes its
   pairs' indices in order into `sorted_pairs` [max_padded(T*k, E, BLOCK_M) <= T*k +
   E*(BLOCK_M-1) rounded to a block] (padding = T*k), its blocks' expert into `block_experts`,
   and program 0 the padded length `num_padded`, on the device: no host sync, fixed shapes.
2. gate_up: one program per (block, BLOCK_N output columns) multiplies its block's rows of x
   (pair // k) by its expert's gate rows and up rows, and writes SiLU(gate) * up [T*k, I],
   rounded where torch rounds (after each product, after SiLU, after the mul).
3. down: the same kernel over those rows and the expert's down weights, each row's output
   rounded to x's dtype and multiplied by its routing weight (in the weight's dtype), written
   in float32 [T*k, H]; the top-k rows of each token are then summed (torch) and rounded once.
Programs whose block lies past num_padded return at once, so grids are sized for the worst
case (fixed under a CUDA graph) while work follows the real routing.

On an H100 (bf16, CUDA-graph replay; Qwen3-30B-A3B's layer E=128, k=8, H=2048, I=768): 103 us
at T=1 (22.5 us of weight reads at 3.35 TB/s) when align was ~15 torch ops, 55 us of it
align; 248 us at T=8, 481 at T=64, 794 at T=2048 (the best tiles of a sweep; tile_for). Mixtral's
(E=8, k=2, H=4096, I=14336): 303 us at T=1 (roofline 210), 4.4 ms at T=2048. The torch loop
over experts took 2.0 ms at T=1 and 51 ms at T=2048 eagerly.
"""

from __future__ import annotations

import functools
import os
from typing import Any, NamedTuple

import torch

# Triton's interpreter (the CPU tests) runs bf16 dots wrongly: tiles multiply in float32 there.
# Read once, at import.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

ALIGN_CHUNK = 1024  # pairs an align program reads a step


class Tile(NamedTuple):
    """One launch's blocking: rows (aligned pairs) and output columns a program, the K step,
    warps and software-pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int


class Aligned(NamedTuple):
    """The pairs in per-expert blocks: sorted_pairs [max_padded] (int32 pair indices, T*k for
    padding), block_experts [max_padded / BLOCK_M] (int32), num_padded [1] (int32, the padded
    rows in use; both arrays are unspecified past it)."""

    sorted_pairs: torch.Tensor
    block_experts: torch.Tensor
    num_padded: torch.Tensor


def tile_for(num_pairs: int, num_experts: int) -> Tile:
    """The blocking for num_pairs routed pairs over num_experts: 16 rows while experts average
    few rows (decode), more for prefill."""
    per_expert = num_pairs / num_experts
    if per_expert < 8:
        return Tile(16, 32, 256, 4, 3)
    if per_expert < 48:
        return Tile(64, 64, 64, 4, 3)
    return Tile(128, 128, 64, 8, 3)


def max_padded(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most rows the aligned pairs can take: every expert's run rounded up to block_m, as a
    whole number of blocks."""
    bound = num_pairs + num_experts * (block_m - 1)
    return -(-bound // block_m) * block_m


def align(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> Aligned:
    """expert_ids [T, k] aligned into per-expert blocks of block_m rows (see Aligned) by one
    Triton launch of one program an expert: each takes the histogram of all the pairs' experts
    (its run's padded start is the sum of the runs before), then writes its pairs in order,
    its run's padding and its blocks' expert."""
    flat = expert_ids.reshape(-1)
    num_pairs, device = flat.numel(), flat.device
    size = max_padded(num_pairs, num_experts, block_m)
    sorted_pairs = torch.empty(size, dtype=torch.int32, device=device)
    block_experts = torch.empty(size // block_m, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    chunk = min(ALIGN_CHUNK, max(16, 1 << (num_pairs - 1).bit_length()))
    _align_kernel()[(num_experts,)](
        flat, sorted_pairs, block_experts, num_padded, num_pairs, num_experts,
        BLOCK_M=block_m, BINS=1 << num_experts.bit_length(), CHUNK=chunk,
    )  # fmt: skip
    return Aligned(sorted_pairs, block_experts, num_padded)


@functools.cache
def _align_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def align_pairs(
        ids_ptr,
        sorted_pairs_ptr,
        block_experts_ptr,
        num_padded_ptr,
        num_pairs,
        num_experts,
        BLOCK_M: tl.constexpr,
        BINS: tl.constexpr,
        CHUNK: tl.constexpr,
    ):
        """Program e: the histogram of all pairs' experts in BINS bins (> num_experts: masked
        lanes count in bin num_experts, ignored), then expert e's pairs, padding and blocks."""
        expert = tl.program_id(0)
        lanes = tl.arange(0, CHUNK)
        counts = tl.zeros((BINS,), dtype=tl.int32)
        for c0 in range(0, num_pairs, CHUNK):
            pairs = c0 + lanes
            ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=num_experts)
            counts += tl.histogram(ids.to(tl.int32), BINS)
        bins = tl.arange(0, BINS)
        padded = tl.where(bins < num_experts, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
        start = tl.sum(tl.where(bins < expert, padded, 0), axis=0)
        count = tl.sum(tl.where(bins == expert, counts, 0), axis=0)
        end = start + tl.sum(tl.where(bins == expert, padded, 0), axis=0)
        if expert == 0:
            tl.store(num_padded_ptr, tl.sum(padded, axis=0))
        written = start
        for c0 in range(0, num_pairs, CHUNK):
            pairs = c0 + lanes
            ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=num_experts)
            hit = (ids == expert).to(tl.int32)
            tl.store(sorted_pairs_ptr + written + tl.cumsum(hit, axis=0) - 1, pairs, mask=hit > 0)
            written += tl.sum(hit, axis=0)
        padding = start + count + tl.arange(0, BLOCK_M)
        tl.store(sorted_pairs_ptr + padding, num_pairs, mask=padding < end)
        for b0 in range(start // BLOCK_M, end // BLOCK_M, CHUNK):
            blocks = b0 + lanes
            tl.store(block_experts_ptr + blocks, expert, mask=blocks < end // BLOCK_M)

    return align_pairs


def fused_experts(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    tile: Tile | None = None,
) -> torch.Tensor:
    """The experts' weighted sum [T, H] (moe.reference_experts' numerics) by the Triton kernels:
    x [T, H]; each token's experts expert_ids [T, k] and weights [T, k] (float32 or x's
    dtype); gate_up [E, 2I, H], down [E, H, I]; x and the experts contiguous, of one dtype.
    tile: the blocking (None: tile_for's)."""
    for name, t in (("x", x), ("experts_gate_up", gate_up), ("experts_down", down)):
        if t.dtype != x.dtype or not t.is_contiguous():
            raise ValueError(f"{name}: want contiguous {x.dtype}, got {t.dtype}")
    num_tokens, top_k = expert_ids.shape
    num_experts, two_i, hidden = gate_up.shape
    num_pairs, inter = num_tokens * top_k, two_i // 2
    tile = tile or tile_for(num_pairs, num_experts)
    aligned = align(expert_ids, num_experts, tile.block_m)
    flat_weights = weights.reshape(-1).contiguous()
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    weighted = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)
    _grouped_gemm(x, gate_up, act, aligned, flat_weights, tile, top_k, gated=True)
    _grouped_gemm(act, down, weighted, aligned, flat_weights, tile, 1, gated=False)
    return weighted.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)


def _grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    aligned: Aligned,
    weights: torch.Tensor,
    tile: Tile,
    a_rows_per_token: int,
    gated: bool,
) -> None:
    """out[pair] = a[pair // a_rows_per_token] @ w[expert].T, over the aligned pairs: gated,
    SiLU(gate) * up of w's two halves; else times the pair's routing weight."""
    num_cols, depth = out.shape[1], a.shape[1]
    upcast = _INTERPRETED or a.dtype == torch.float32
    grid = (aligned.block_experts.numel() * -(-num_cols // tile.block_n),)
    _kernel()[grid](
        a, w, out, aligned.sorted_pairs, aligned.block_experts, aligned.num_padded, weights,
        out.shape[0], num_cols, depth, a_rows_per_token,
        GATED=gated, ROUND_WEIGHTED=weights.dtype != torch.float32, UPCAST=upcast,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        num_warps=tile.warps, num_stages=tile.stages,
    )  # fmt: skip


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def grouped_gemm(
        a_ptr,
        w_ptr,
        out_ptr,
        sorted_pairs_ptr,
        block_experts_ptr,
        num_padded_ptr,
        weights_ptr,
        num_pairs,
        N,
        K,
        a_rows_per_token,
        GATED: tl.constexpr,
        ROUND_WEIGHTED: tl.constexpr,
        UPCAST: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """One program: BLOCK_M aligned pairs x BLOCK_N output columns over all of K. w is
        [E, N, K] ([E, 2N, K] gated: gate rows, then up rows); a [*, K]; out [num_pairs, N].
        UPCAST: the tiles multiplied in IEEE float32 (float32 models; and in Triton 3.9's
        interpreter, whose tl.dot gets bf16 tiles wrong: their products are exact in float32)."""
        pid = tl.program_id(0)
        num_n = tl.cdiv(N, BLOCK_N)
        block, pid_n = pid // num_n, pid % num_n
        if block * BLOCK_M >= tl.load(num_padded_ptr):
            return
        expert = tl.load(block_experts_ptr + block).to(tl.int64)
        pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = pairs < num_pairs
        a_rows = tl.where(valid, pairs // a_rows_per_token, 0).to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        w_rows = tl.where(col_ok, cols, 0).to(tl.int64)
        ks = tl.arange(0, BLOCK_K)
        w_expert = w_ptr + expert * (2 * N if GATED else N) * K
        a_tile = a_ptr + a_rows[:, None] * K + ks[None, :]
        w_tile = w_expert + w_rows[None, :] * K + ks[:, None]  # [BLOCK_K, BLOCK_N]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = ks < K - k0
            a = tl.load(a_tile, mask=valid[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_tile, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(a, w, acc, input_precision="ieee")
            if GATED:
                w_up = tl.load(w_tile + N * K, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                if UPCAST:
                    w_up = w_up.to(tl.float32)
                acc_up = tl.dot(a, w_up, acc_up, input_precision="ieee")
            a_tile += BLOCK_K
            w_tile += BLOCK_K
        dtype = a_ptr.dtype.element_ty
        y = acc.to(dtype).to(tl.float32)
        if GATED:  # torch's rounding: SiLU(gate), then the product, each to the dtype
            silu = (y / (1.0 + tl.exp(-y))).to(dtype).to(tl.float32)
            y = silu * acc_up.to(dtype).to(tl.float32)
        else:
            weight = tl.load(weights_ptr + pairs, mask=valid, other=0.0)
            y = y * weight.to(tl.float32)[:, None]
            if ROUND_WEIGHTED:
                y = y.to(dtype).to(tl.float32)
        out = out_ptr + tl.where(valid, pairs, 0).to(tl.int64)[:, None] * N + cols[None, :]
        tl.store(out, y.to(out_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])

    return grouped_gemm
