"""rope_and_write_kv: RoPE on q and k plus the paged K/V write, as one Triton kernel per layer.

Owns no state; imports triton on first use. It replaces three kernels per layer on the GPU path
(RoPE, then two scattered index writes for K and V): at batch 1 an 8B decode step is bound by
its weight reads, and the ~100 small launches it saves are a measurable part of the step. The
K/V store casts to the cache's dtype, so the same kernel fills a bf16 or an fp8 (e4m3) cache;
an fp8 cache stores K / k_scale and V / v_scale (the layer's KV scales).
"""

from __future__ import annotations

import functools
from typing import Any

import torch


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def rope_write_kv(
        qkv_ptr,
        qkv_row_stride,
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
        NUM_Q_HEADS: tl.constexpr,
        NUM_KV_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
    ):
        """One program per (token, q or kv head): rotate-half RoPE in fp32; q heads are written
        back in place, kv heads write rotated K and plain V (each times its inverse scale)
        into the token's cache slot."""
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        half = tl.arange(0, HEAD_DIM // 2)
        position = tl.load(positions_ptr + token)
        cos = tl.load(cos_sin_ptr + position * cos_sin_row_stride + half)
        sin = tl.load(cos_sin_ptr + position * cos_sin_row_stride + HEAD_DIM // 2 + half)
        row = qkv_ptr + token * qkv_row_stride
        src = row + head * HEAD_DIM  # q heads, then k heads, are adjacent in the qkv row
        x1 = tl.load(src + half).to(tl.float32)
        x2 = tl.load(src + HEAD_DIM // 2 + half).to(tl.float32)
        out1 = x1 * cos - x2 * sin
        out2 = x2 * cos + x1 * sin
        if head < NUM_Q_HEADS:
            tl.store(src + half, out1.to(qkv_ptr.dtype.element_ty))
            tl.store(src + HEAD_DIM // 2 + half, out2.to(qkv_ptr.dtype.element_ty))
        else:
            kv_head = head - NUM_Q_HEADS
            block = tl.load(slot_block_ptr + token)
            slot = tl.load(slot_offset_ptr + token)
            dst = cache_ptr + block * block_stride + kv_head * head_stride + slot * slot_stride
            cache_dtype = cache_ptr.dtype.element_ty
            tl.store(dst + half, (out1 * k_inv_scale).to(cache_dtype))
            tl.store(dst + HEAD_DIM // 2 + half, (out2 * k_inv_scale).to(cache_dtype))
            dims = tl.arange(0, HEAD_DIM)
            v = tl.load(row + (NUM_Q_HEADS + NUM_KV_HEADS + kv_head) * HEAD_DIM + dims)
            v = v.to(tl.float32) * v_inv_scale
            tl.store(dst + kv_stride + dims, v.to(cache_dtype))

    return rope_write_kv


def rope_and_write_kv(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    layer_cache: torch.Tensor,
    slot_block_ids: torch.Tensor,
    slot_offsets: torch.Tensor,
    num_q_heads: int,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:
    """Rotate q in place, write rotated k and v into the paged cache; returns q [T, Hq, D].

    qkv: [T, (Hq + 2 Hkv) * D], rows contiguous; cos_sin: float32 [max_positions, D] (cos of
    the D/2 frequencies, then their sin); layer_cache: one layer's [num_blocks, 2, Hkv,
    block_size, D] view, D contiguous (any other strides); slot_*: [T] each token's block and
    offset in it; kv_scales: the layer's (k_scale, v_scale), the cache holding K / k_scale
    and V / v_scale.
    """
    _, two, num_kv_heads, _, head_dim = layer_cache.shape
    num_tokens = qkv.shape[0]
    if qkv.shape[1] != (num_q_heads + 2 * num_kv_heads) * head_dim or qkv.stride(1) != 1:
        raise ValueError(f"qkv of shape {tuple(qkv.shape)} does not match the cache's heads")
    if layer_cache.stride(4) != 1 or cos_sin.stride(1) != 1 or two != 2:
        raise ValueError("the cache's and cos_sin's last dimensions must be contiguous")
    if num_tokens:
        _kernel()[(num_tokens, num_q_heads + num_kv_heads)](
            qkv,
            qkv.stride(0),
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
            NUM_Q_HEADS=num_q_heads,
            NUM_KV_HEADS=num_kv_heads,
            HEAD_DIM=head_dim,
            num_warps=1,
        )
    return qkv[:, : num_q_heads * head_dim].view(num_tokens, num_q_heads, head_dim)
