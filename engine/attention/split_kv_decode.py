"""SplitKvDecode: single-token decode rows attended by one Triton kernel that splits each row's
KV into parts and merges them itself; owns nothing but (DenseTableDecode) the dense page table
and lengths (the arrival counters are engine/quant/split_k.py's). Imports triton on first use.

Why: at batch 1 on the 8B shape a layer's attention reads ~2.5 MB of KV (0.6 us at the HBM
rate) but took 6.8 us in FlashInfer's split kernel plus 2.7 us in its merge kernel, ~0.3 ms of
a 4.1 ms step (bench/RESULTS.md, issue 12's seventeenth round); XQA's over an fp8 cache, 6.4 us.
Here a program takes one (row, KV head, part of the row's pages): the GROUP query heads that
share the KV head against its part's tokens on tensor cores (online softmax in base 2), then
stores its partial (max, sum, weighted V); the last program of a (row, KV head) to arrive merges
the parts in order and writes the output, so there is no second kernel. Parts are sized so that
rows x KV heads x parts is about the SM count. An fp8 (e4m3) cache is read as is, converted to
the queries' dtype in registers; k_scale goes into the score scale and v_scale into the output.

KVRELAY_DECODE_KERNEL=triton (xqa_decode.py) takes it for a step's leading decode rows (all of a
pure-decode step's); off by default until measured against FlashInfer's in the engine. The
number of parts is a runtime argument, so a step of any row count runs the one compiled kernel.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from engine import pdl
from engine.attention.dense_table import DenseTableDecode
from engine.attention.xqa_decode import DECODE_KERNEL_ENV
from engine.quant import split_k

GROUP_ROWS = 16  # query heads of a KV head padded to this (the smallest tensor-core M)
MAX_PARTS = 32  # parts a row's KV is cut into at most
PAGES_PER_STEP = 2  # pages a program attends to at a time (its loop's step)
NUM_STAGES = 3  # the loop's software pipeline: pages loaded this many steps ahead, less one


def parts_for(num_rows: int, num_kv_heads: int, num_sms: int) -> int:
    """Parts of each row's KV: about num_sms programs in all, 1..MAX_PARTS."""
    return max(1, min(MAX_PARTS, round(num_sms / (num_rows * num_kv_heads))))


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    # the table's width and the parts change from step to step: no variant per value
    @triton.jit(do_not_specialize=["table_row_stride", "parts"])
    def split_kv_decode(
        q_ptr,
        k_ptr,
        v_ptr,
        table_ptr,
        lens_ptr,
        out_ptr,
        ws_ptr,
        counter_ptr,
        table_row_stride,
        block_stride,
        head_stride,
        score_scale,
        v_scale,
        parts,
        NUM_KV_HEADS: tl.constexpr,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        MAX_PARTS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        PAGE: tl.constexpr,
        BLOCK_T: tl.constexpr,
        DOT_FP32: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """Program (row * NUM_KV_HEADS + kv head, part of `parts`, each a run of the row's
        pages as even as they divide). score_scale: head_dim^-0.5 * k_scale * log2(e). With
        parts > 1 the workspace holds per (row, kv head, part) GROUP x (HEAD_DIM + 2) floats:
        the weighted V, then the max and the sum of the part's exponentials. DOT_FP32: the
        products in float32 (Triton's interpreter multiplies bf16 wrongly), else in q's
        dtype on tensor cores."""
        row_head = tl.program_id(0)
        part = tl.program_id(1)
        row = row_head // NUM_KV_HEADS
        head = row_head % NUM_KV_HEADS
        groups = tl.arange(0, GROUP_PAD)
        group_ok = groups < GROUP
        dims = tl.arange(0, HEAD_DIM)
        if PDL:
            tl.extra.cuda.gdc_wait()
        q_rows_base = (row * NUM_KV_HEADS + head) * GROUP
        q_rows = q_rows_base + groups
        q = tl.load(q_ptr + q_rows[:, None] * HEAD_DIM + dims[None, :], group_ok[:, None], 0.0)
        if DOT_FP32:
            q = q.to(tl.float32)
        ctx = tl.load(lens_ptr + row)
        num_pages = tl.cdiv(ctx, PAGE)
        t_start = part * num_pages // parts * PAGE
        t_end = tl.minimum(ctx, (part + 1) * num_pages // parts * PAGE)
        top = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
        total = tl.zeros((GROUP_PAD,), tl.float32)
        acc = tl.zeros((GROUP_PAD, HEAD_DIM), tl.float32)
        for t0 in range(t_start, t_end, BLOCK_T):
            tokens = t0 + tl.arange(0, BLOCK_T)
            token_ok = tokens < t_end
            page = tl.load(table_ptr + row * table_row_stride + tokens // PAGE, token_ok, 0)
            at = page.to(tl.int64) * block_stride + head * head_stride + (tokens % PAGE) * HEAD_DIM
            at = at[:, None] + dims[None, :]
            k = tl.load(k_ptr + at, token_ok[:, None], 0.0).to(q.dtype)
            scores = tl.dot(q, tl.trans(k)) * score_scale
            scores = tl.where(token_ok[None, :], scores, float("-inf"))
            new_top = tl.maximum(top, tl.max(scores, axis=1))
            keep = tl.exp2(top - new_top)
            probs = tl.exp2(scores - new_top[:, None])
            total = total * keep + tl.sum(probs, axis=1)
            v = tl.load(v_ptr + at, token_ok[:, None], 0.0).to(q.dtype)
            acc = acc * keep[:, None] + tl.dot(probs.to(q.dtype), v)
            top = new_top
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        out_at = out_ptr + q_rows[:, None] * HEAD_DIM + dims[None, :]
        if parts == 1:
            out = acc / tl.where(total > 0, total, 1.0)[:, None] * v_scale
            tl.store(out_at, out.to(out_ptr.dtype.element_ty), group_ok[:, None])
        else:
            part_floats = GROUP * (HEAD_DIM + 2)
            mine = ws_ptr + (row_head * parts + part) * part_floats
            tl.store(mine + groups[:, None] * HEAD_DIM + dims[None, :], acc, group_ok[:, None])
            tl.store(mine + GROUP * HEAD_DIM + groups, top, group_ok)
            tl.store(mine + GROUP * (HEAD_DIM + 1) + groups, total, group_ok)
            tl.debug_barrier()  # every thread's part stored before the count is released
            arrived = tl.atomic_add(counter_ptr + row_head, 1, sem="acq_rel", scope="gpu")
            if arrived == parts - 1:  # the last: merge the parts, in order
                # every part's max and sum in one load each, [MAX_PARTS, GROUP_PAD]; then each
                # query head's weighted V of every part in one load: all independent loads,
                # so the merge waits for L2 about once, not once a part
                slots = tl.arange(0, MAX_PARTS)
                at = ws_ptr + (row_head * parts + slots[:, None]) * part_floats + groups[None, :]
                ok = (slots < parts)[:, None] & group_ok[None, :]
                tops = tl.load(at + GROUP * HEAD_DIM, ok, float("-inf"), cache_modifier=".cg")
                sums = tl.load(at + GROUP * (HEAD_DIM + 1), ok, 0.0, cache_modifier=".cg")
                top = tl.max(tops, axis=0)
                # an empty part's max is -inf: weigh it by 0, not by exp2(nan) (no part of a
                # padded query head has a finite max)
                weights = tl.exp2(tops - tl.where(top > float("-inf"), top, 0.0)[None, :])
                total = tl.sum(weights * sums, axis=0)
                total = tl.where(total > 0, total, 1.0)
                tl.atomic_xchg(counter_ptr + row_head, 0, sem="relaxed", scope="gpu")
                parts_ok = (slots < parts)[:, None]
                for g in tl.static_range(GROUP):
                    mine_g = groups[None, :] == g
                    weight = tl.sum(tl.where(mine_g, weights, 0.0), axis=1)  # [MAX_PARTS]
                    rows_at = ws_ptr + (row_head * parts + slots[:, None]) * part_floats
                    accs = tl.load(
                        rows_at + g * HEAD_DIM + dims[None, :], parts_ok, 0.0, cache_modifier=".cg"
                    )  # [MAX_PARTS, HEAD_DIM]
                    total_g = tl.sum(tl.where(groups == g, total, 0.0), axis=0)
                    out = tl.sum(accs * weight[:, None], axis=0) / total_g * v_scale
                    g_at = out_ptr + (q_rows_base + g) * HEAD_DIM + dims
                    tl.store(g_at, out.to(out_ptr.dtype.element_ty))

    return split_kv_decode


def check_shape(
    head_dim: int, block_size: int, group: int, kv_dtype: torch.dtype, device: torch.device
) -> None:
    """Refuse what the kernel cannot take, naming KVRELAY_DECODE_KERNEL: head_dim and the
    page size powers of two (head_dim >= 16, pages >= 8 tokens: a loop step of two pages is a
    tensor-core product of >= 16 tokens), at most GROUP_ROWS query heads a KV head, and an fp8
    cache only where Triton has e4m3 (compute capability 8.9 and up)."""
    setting = f"{DECODE_KERNEL_ENV}=triton"
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"{setting} needs head_dim a power of two >= 16, got {head_dim}")
    if block_size < 8 or block_size & (block_size - 1):
        raise ValueError(f"{setting} needs a block size a power of two >= 8, got {block_size}")
    if not 1 <= group <= GROUP_ROWS:
        raise ValueError(f"{setting} takes 1..{GROUP_ROWS} query heads a KV head, got {group}")
    fp8 = kv_dtype == torch.float8_e4m3fn
    if fp8 and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError(f"{setting} reads an fp8 cache on compute capability 8.9 and up only")


class SplitKvDecode(DenseTableDecode):
    """Runs single-token decode rows on the split-KV kernel over the planned dense table.

    run() attends one layer.
    """

    name = "triton"
    num_sms: int | None = None  # what parts_for aims at (None: the device's SM count, 4 on CPU)

    def run(
        self, layer: int, q: torch.Tensor, layer_cache: torch.Tensor, out: torch.Tensor
    ) -> torch.Tensor:
        """q [rows, Hq, D] (contiguous) -> out (same shape, contiguous), over one layer's
        [blocks, 2, Hkv, block_size, D] view of the cache (pages strided, tokens of a head
        contiguous)."""
        table, lens = self.planned()
        num_rows, num_heads, head_dim = q.shape
        _, two, num_kv_heads, page, cache_head_dim = layer_cache.shape
        contiguous_tokens = layer_cache.stride(3) == head_dim and layer_cache.stride(4) == 1
        if (two, page, cache_head_dim) != (2, self.block_size, head_dim) or not contiguous_tokens:
            raise ValueError(
                f"the cache view must be [blocks, 2, Hkv, {self.block_size}, {head_dim}] with "
                f"a head's tokens contiguous, got {tuple(layer_cache.shape)}"
            )
        if head_dim != self.head_dim or out.shape != q.shape:
            raise ValueError(f"q and out must be [rows, Hq, {self.head_dim}] alike")
        if not q.is_contiguous() or not out.is_contiguous() or num_heads % num_kv_heads:
            raise ValueError("q and out must be contiguous, with whole groups of query heads")
        group = num_heads // num_kv_heads
        if group > GROUP_ROWS:
            raise ValueError(f"at most {GROUP_ROWS} query heads a KV head, got {group}")
        k_scale, v_scale = self.kv_scales[layer]
        sms = self.num_sms or (split_k.num_sms(q.device) if q.is_cuda else 4)
        parts = parts_for(num_rows, num_kv_heads, sms)
        # one compiled kernel whatever the parts: a float32 workspace (of one float when unused)
        floats = num_rows * num_kv_heads * parts * group * (head_dim + 2) if parts > 1 else 1
        workspace = torch.empty(floats, dtype=torch.float32, device=q.device)
        counters = split_k.counters(q.device, num_rows * num_kv_heads if parts > 1 else 1)
        use_pdl = pdl.enabled(q.device)
        _kernel()[(num_rows * num_kv_heads, parts)](
            q, layer_cache[:, 0], layer_cache[:, 1], table, lens, out, workspace, counters,
            table.stride(0), layer_cache.stride(0), layer_cache.stride(2),
            head_dim**-0.5 * k_scale * math.log2(math.e), v_scale, parts,
            NUM_KV_HEADS=num_kv_heads, GROUP=group, GROUP_PAD=GROUP_ROWS, MAX_PARTS=MAX_PARTS,
            HEAD_DIM=head_dim,
            PAGE=self.block_size, BLOCK_T=PAGES_PER_STEP * self.block_size,
            DOT_FP32=not q.is_cuda, PDL=use_pdl, num_warps=4, num_stages=NUM_STAGES,
            launch_pdl=use_pdl,
        )  # fmt: skip
        return out
