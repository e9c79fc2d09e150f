"""FlashInfer paged decode attention alone, the way FlashInferAttention calls it: ms per layer
and effective KV read bandwidth, bf16 against fp8 (e4m3) KV, tensor-core (prefill kernel)
against CUDA-core fa2 decode kernels, and XQA (the engine's choice for an fp8 cache on Hopper).
Owns no state; needs a GPU and flashinfer.

    python -m bench.attention_bench [--shapes 1x512 256x1500 488x1500] [--json out.json]

The cache is layer-packed and head-major like the engine's ([blocks, layers, 2, Hkv, 16, D],
one layer's strided view), with each sequence's pages scattered over the pool.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from engine.attention.flashinfer_backend import WORKSPACE_BYTES

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16  # Llama-3.1-8B attention
NUM_LAYERS = 4  # the page stride spans several layers, as in the engine's cache


def time_ms(op: Any, iters: int = 30) -> float:
    op()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        op()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def one_shape(batch: int, context: int) -> list[dict[str, Any]]:
    import flashinfer

    pages_per_seq = -(-context // BLOCK)
    num_blocks = batch * pages_per_seq + 1
    gen = torch.Generator("cuda").manual_seed(0)
    order = torch.randperm(num_blocks - 1, device="cuda", generator=gen).int()
    indptr = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * pages_per_seq
    last_len = torch.full((batch,), context - (pages_per_seq - 1) * BLOCK, dtype=torch.int32)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    rows = []
    for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        shape = (num_blocks, NUM_LAYERS, 2, NUM_KV_HEADS, BLOCK, HEAD_DIM)
        cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16).to(kv_dtype)
        layer = cache[:, 1]
        kv_bytes = batch * context * 2 * NUM_KV_HEADS * HEAD_DIM * cache.element_size()
        for tensor_cores in (True, False):
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                workspace, "HND", use_tensor_cores=tensor_cores, backend="fa2"
            )
            wrapper.plan(
                indptr,
                order,
                last_len.cuda(),
                NUM_HEADS,
                NUM_KV_HEADS,
                HEAD_DIM,
                BLOCK,
                q_data_type=torch.bfloat16,
                kv_data_type=kv_dtype,
            )
            ms = time_ms(lambda wrapper=wrapper, layer=layer: wrapper.run(q, layer))
            label = f"fa2, tensor cores {str(tensor_cores).lower()}"
            rows.append(timed_row(batch, context, kv_dtype, label, ms, kv_bytes))
            rows[-1]["tensor_cores"] = tensor_cores
        if torch.cuda.get_device_capability()[0] in (9, 10, 12):  # where XQA runs
            ms = xqa_ms(q, layer, order.view(batch, pages_per_seq).tolist(), context)
            rows.append(timed_row(batch, context, kv_dtype, "xqa", ms, kv_bytes))
        del cache, layer
        torch.cuda.empty_cache()
    return rows


def timed_row(
    batch: int, context: int, kv_dtype: torch.dtype, kernel: str, ms: float, kv_bytes: int
) -> dict[str, Any]:
    """One measured kernel: printed as a line, returned as a JSON row."""
    row = {
        "batch": batch,
        "context": context,
        "kv_dtype": str(kv_dtype).removeprefix("torch."),
        "kernel": kernel,
        "ms_per_layer": ms,
        "kv_GBps": kv_bytes / ms / 1e6,
    }
    print(
        f"batch {batch:4d} ctx {context:5d} {row['kv_dtype']:14s} {kernel:23s}: "
        f"{ms * 1e3:8.1f} us/layer, {row['kv_GBps']:7.0f} GB/s",
        flush=True,
    )
    return row


def xqa_ms(q: torch.Tensor, layer: torch.Tensor, pages: list[list[int]], context: int) -> float:
    """ms per call of the engine's XQA decode (engine/attention/xqa_decode.py) on these pages."""
    from engine.attention.base import SeqSpan
    from engine.attention.xqa_decode import XqaDecode

    xqa = XqaDecode(HEAD_DIM, BLOCK, q.device, [(1.0, 1.0)])
    xqa.plan([SeqSpan(i, 1, context, row) for i, row in enumerate(pages)])
    out = torch.empty_like(q)
    return time_ms(lambda: xqa.run(0, q, layer, out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="*", default=["1x512", "64x1500", "256x1500", "488x1500"])
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    rows = []
    for shape in args.shapes:
        batch, context = (int(x) for x in shape.split("x"))
        rows += one_shape(batch, context)
    if args.json:
        args.json.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}))


if __name__ == "__main__":
    main()
