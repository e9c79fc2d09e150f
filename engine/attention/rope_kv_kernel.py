"""rope_and_write_kv: RoPE on q and k plus the paged K/V write, as one Triton kernel per layer.

Owns no state; imports triton on first use. It replaces three kernels per layer on the GPU path
(RoPE, then two scattered index writes for K and V): at batch 1 an 8B decode step is bound by
its weight reads, and the ~100 small launches it saves are a measurable part of the step. The
K/V store casts to the cache's dtype, so the same kernel fills a bf16 or an fp8 (e4m3) cache;
an fp8 cache stores K / k_scale and V / v_scale (the layer's KV scales). A program takes a
block of a token's heads, sized by the token count: one head per program for a decode row (40
programs at batch 1 on the 8B shape), the whole token for a 16,384-token prefill step, where
one tiny program per (token, head) ran at a quarter of the bytes' rate. q|k|v may come as an
Fp8Linear's ScaledRows (unscaled product, row and column scales): the kernel scales as it reads.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, NamedTuple

import torch

from engine.execution import pdl
from engine.quant.fp8_types import ScaledRows

# Read one element per program (a token's position, KV slot block and offset, fp8 row scale), so
# their alignment buys no wider load. They come as rows of a step's packed [4, T] int64 inputs
# (runner.py: the slot offsets in every step that carries a prompt, the positions in eager ones
# over 512 tokens), 16-byte aligned only when T is even; specialized on it, a step of an odd
# token count built variants of their own, which the warm-up (odd counts only at 1 and 3
# tokens, one of the kernel's seven blockings) never met: compiled in a served step on a fresh
# machine, the likely ~0.2-0.6 s first-server stall of bench/RESULTS.md "What the leases found".
PER_TOKEN_POINTERS = ("positions_ptr", "slot_block_ptr", "slot_offset_ptr", "row_scale_ptr")


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    # first_token changes from step to step: no variant per value's divisibility; nor one per
    # the per-token arrays' 16-byte alignment (see PER_TOKEN_POINTERS)
    exempt = {"do_not_specialize_on_alignment": list(PER_TOKEN_POINTERS)}
    if "do_not_specialize_on_alignment" not in inspect.signature(triton.jit).parameters:
        exempt = {}  # a Triton before 3.3: the warm-up's odd token counts meet both variants

    @triton.jit(do_not_specialize=["kv_out_first_token"], **exempt)
    def rope_write_kv(
        qkv_ptr,
        qkv_row_stride,
        q_out_ptr,
        q_out_row_stride,
        positions_ptr,
        cos_sin_ptr,
        cos_sin_row_stride,
        slot_block_ptr,
        slot_offset_ptr,
        cache_ptr,
        block_stride,
        kv_stride,
        head_stride,
        slot_stride,
        k_inv_scale,
        v_inv_scale,
        row_scale_ptr,
        col_scale_ptr,
        k_out_ptr,
        v_out_ptr,
        kv_out_first_token,
        NUM_Q_HEADS: tl.constexpr,
        NUM_KV_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HEADS_PER_PROGRAM: tl.constexpr,
        DEQUANT: tl.constexpr,
        KV_OUT: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """One program per (token, group of HEADS_PER_PROGRAM q or k heads, q heads first):
        rotate-half RoPE in fp32; q heads are written to q_out (qkv itself: in place), k heads
        write rotated K and their kv head's plain V (each times its inverse scale) into the
        token's slot.
        DEQUANT: qkv holds ScaledRows' raw product; each value read is first multiplied by its
        token's and its column's scale and rounded to qkv's dtype.
        KV_OUT: tokens from kv_out_first_token on also write their rotated K and plain V,
        unscaled, in q_out's dtype to k_out / v_out ([tokens, Hkv, D] contiguous, row 0 for
        kv_out_first_token).
        PDL: the next kernel may come in at once; this one waits for the one before."""
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        token = tl.program_id(0).to(tl.int64)
        heads = tl.program_id(1) * HEADS_PER_PROGRAM + tl.arange(0, HEADS_PER_PROGRAM)
        is_q = heads < NUM_Q_HEADS
        is_k = (heads >= NUM_Q_HEADS) & (heads < NUM_Q_HEADS + NUM_KV_HEADS)
        half = tl.arange(0, HEAD_DIM // 2)
        position = tl.load(positions_ptr + token)
        cos = tl.load(cos_sin_ptr + position * cos_sin_row_stride + half)[None, :]
        sin = tl.load(cos_sin_ptr + position * cos_sin_row_stride + HEAD_DIM // 2 + half)[None, :]
        row = qkv_ptr + token * qkv_row_stride
        rotated = (is_q | is_k)[:, None]
        src = row + heads[:, None] * HEAD_DIM + half[None, :]  # q then k heads, adjacent
        x1 = tl.load(src, mask=rotated, other=0.0).to(tl.float32)
        x2 = tl.load(src + HEAD_DIM // 2, mask=rotated, other=0.0).to(tl.float32)
        if DEQUANT:
            token_scale = tl.load(row_scale_ptr + token)
            cols = heads[:, None] * HEAD_DIM + half[None, :]
            scale1 = tl.load(col_scale_ptr + cols, mask=rotated, other=0.0) * token_scale
            scale2 = tl.load(col_scale_ptr + cols + HEAD_DIM // 2, mask=rotated, other=0.0)
            scale2 *= token_scale
            x1 = (x1 * scale1).to(qkv_ptr.dtype.element_ty).to(tl.float32)
            x2 = (x2 * scale2).to(qkv_ptr.dtype.element_ty).to(tl.float32)
        out1 = x1 * cos - x2 * sin
        out2 = x2 * cos + x1 * sin
        q_mask = is_q[:, None]
        q_dst = q_out_ptr + token * q_out_row_stride + heads[:, None] * HEAD_DIM + half[None, :]
        tl.store(q_dst, out1.to(q_out_ptr.dtype.element_ty), mask=q_mask)
        tl.store(q_dst + HEAD_DIM // 2, out2.to(q_out_ptr.dtype.element_ty), mask=q_mask)
        kv_heads = tl.where(is_k, heads - NUM_Q_HEADS, 0)
        block = tl.load(slot_block_ptr + token)
        slot = tl.load(slot_offset_ptr + token)
        dst = cache_ptr + block * block_stride + slot * slot_stride + kv_heads * head_stride
        k_mask = is_k[:, None]
        cache_dtype = cache_ptr.dtype.element_ty
        k_dst = dst[:, None] + half[None, :]
        tl.store(k_dst, (out1 * k_inv_scale).to(cache_dtype), mask=k_mask)
        tl.store(k_dst + HEAD_DIM // 2, (out2 * k_inv_scale).to(cache_dtype), mask=k_mask)
        if KV_OUT:
            out_mask = (is_k & (heads * 0 + token >= kv_out_first_token))[:, None]
            out_row = (token - kv_out_first_token) * NUM_KV_HEADS * HEAD_DIM
            k_out = k_out_ptr + out_row + kv_heads[:, None] * HEAD_DIM + half[None, :]
            tl.store(k_out, out1.to(k_out_ptr.dtype.element_ty), mask=out_mask)
            tl.store(k_out + HEAD_DIM // 2, out2.to(k_out_ptr.dtype.element_ty), mask=out_mask)
        dims = tl.arange(0, HEAD_DIM)[None, :]
        v_cols = ((NUM_Q_HEADS + NUM_KV_HEADS + kv_heads) * HEAD_DIM)[:, None] + dims
        v = tl.load(row + v_cols, mask=k_mask, other=0.0).to(tl.float32)
        if DEQUANT:
            v_scale = tl.load(col_scale_ptr + v_cols, mask=k_mask, other=0.0) * token_scale
            v = (v * v_scale).to(qkv_ptr.dtype.element_ty).to(tl.float32)
        if KV_OUT:  # out_row and out_mask: the K store's above
            v_out = v_out_ptr + out_row + kv_heads[:, None] * HEAD_DIM + dims
            tl.store(v_out, v.to(v_out_ptr.dtype.element_ty), mask=out_mask)
        v = v * v_inv_scale
        tl.store(dst[:, None] + kv_stride + dims, v.to(cache_dtype), mask=k_mask)

    return rope_write_kv


class KvOut(NamedTuple):
    """Where rope_and_write_kv also leaves tokens' rotated K and V (unscaled, the activations'
    dtype): k and v [T - first_token, Hkv, D] contiguous, row 0 for token first_token."""

    k: torch.Tensor
    v: torch.Tensor
    first_token: int

    @staticmethod
    def empty(
        num_tokens: int, first_token: int, num_kv_heads: int, head_dim: int, like: torch.Tensor
    ) -> KvOut:
        shape = (num_tokens - first_token, num_kv_heads, head_dim)
        k = torch.empty(shape, dtype=like.dtype, device=like.device)
        return KvOut(k, torch.empty_like(k), first_token)

    def check(self, num_tokens: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        shape = (num_tokens - self.first_token, num_kv_heads, head_dim)
        for t in (self.k, self.v):
            if tuple(t.shape) != shape or not t.is_contiguous() or t.dtype != dtype:
                raise ValueError(
                    f"kv_out of shape {tuple(t.shape)} ({t.dtype}) is not {shape} ({dtype}), "
                    "contiguous"
                )


PROGRAMS_WANTED = 1024  # enough to fill the GPU; more only adds per-program cost


def warps_for(heads_per_program: int, head_dim: int) -> int:
    """The launch's warps: one per 1,024 elements a program rotates, 1..4."""
    return max(1, min(4, heads_per_program * head_dim // 1024))


def heads_per_program(num_tokens: int, num_heads: int) -> int:
    """How many of a token's q + k heads one program rotates: a power of two, as many as keep
    ~PROGRAMS_WANTED programs (prefill chunks: the whole token; one decode row: one head)."""
    per_program = 1
    limit = 1 << (num_heads - 1).bit_length()
    while per_program < limit and num_tokens * num_heads // (2 * per_program) >= PROGRAMS_WANTED:
        per_program *= 2
    return per_program


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def rope_and_write_kv(
    qkv: torch.Tensor | ScaledRows,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    layer_cache: torch.Tensor,
    slot_block_ids: torch.Tensor,
    slot_offsets: torch.Tensor,
    num_q_heads: int,
    kv_scales: tuple[float, float] = (1.0, 1.0),
    q_out: torch.Tensor | None = None,
    kv_out: KvOut | None = None,
) -> torch.Tensor:
    """Rotate q (into q_out [T, Hq, D] when given, else in place), write rotated k and v into
    the paged cache; returns q [T, Hq, D].

    qkv: [T, (Hq + 2 Hkv) * D], rows contiguous; cos_sin: float32 [max_positions, D] (cos of
    the D/2 frequencies, then their sin); layer_cache: one layer's [num_blocks, 2, Hkv,
    block_size, D] view, D contiguous (any other strides); slot_*: [T] each token's block and
    offset in it; kv_scales: the layer's (k_scale, v_scale), the cache holding K / k_scale
    and V / v_scale. qkv may be an Fp8Linear's ScaledRows: the kernel applies its scales as it
    reads, and the returned q holds scaled, rotated values. kv_out: where tokens from its
    first_token on also leave their rotated K and V unscaled, in q's dtype (ragged attention
    over a step's own K/V reads them there).
    """
    scaled = qkv if isinstance(qkv, ScaledRows) else None
    qkv = qkv.raw if isinstance(qkv, ScaledRows) else qkv
    _, two, num_kv_heads, _, head_dim = layer_cache.shape
    num_tokens = qkv.shape[0]
    if qkv.shape[1] != (num_q_heads + 2 * num_kv_heads) * head_dim or qkv.stride(1) != 1:
        raise ValueError(f"qkv of shape {tuple(qkv.shape)} does not match the cache's heads")
    if layer_cache.stride(4) != 1 or cos_sin.stride(1) != 1 or two != 2:
        raise ValueError("the cache's and cos_sin's last dimensions must be contiguous")
    q_view = qkv[:, : num_q_heads * head_dim].view(num_tokens, num_q_heads, head_dim)
    if q_out is None:
        q_out = q_view
    elif q_out.shape != q_view.shape or q_out.stride()[1:] != (head_dim, 1):
        raise ValueError(f"q_out of shape {tuple(q_out.shape)} is not [T, Hq, D] by rows")
    if kv_out is not None:
        kv_out.check(num_tokens, num_kv_heads, head_dim, q_out.dtype)
    if num_tokens:
        heads = num_q_heads + num_kv_heads
        per_program = heads_per_program(num_tokens, heads)
        use_pdl = pdl.enabled(qkv.device)
        _kernel()[(num_tokens, ceil_div(heads, per_program))](
            qkv,
            qkv.stride(0),
            q_out,
            q_out.stride(0),
            positions,
            cos_sin,
            cos_sin.stride(0),
            slot_block_ids,
            slot_offsets,
            layer_cache,
            layer_cache.stride(0),
            layer_cache.stride(1),
            layer_cache.stride(2),
            layer_cache.stride(3),
            1.0 / kv_scales[0],
            1.0 / kv_scales[1],
            qkv if scaled is None else scaled.row_scale,  # read only when DEQUANT
            qkv if scaled is None else scaled.col_scale,
            q_out if kv_out is None else kv_out.k,  # written only when KV_OUT
            q_out if kv_out is None else kv_out.v,
            0 if kv_out is None else kv_out.first_token,
            NUM_Q_HEADS=num_q_heads,
            NUM_KV_HEADS=num_kv_heads,
            HEAD_DIM=head_dim,
            HEADS_PER_PROGRAM=per_program,
            DEQUANT=scaled is not None,
            KV_OUT=kv_out is not None,
            PDL=use_pdl,
            launch_pdl=use_pdl,
            num_warps=warps_for(per_program, head_dim),
        )
    return q_out
