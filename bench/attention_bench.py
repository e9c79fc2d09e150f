"""Paged decode attention alone, the way FlashInferAttention calls it: ms per layer and effective
KV read bandwidth, bf16 against fp8 (e4m3) KV, FlashInfer's tensor-core (prefill kernel) against
its CUDA-core fa2 decode kernels, XQA (the engine's choice for an fp8 cache on Hopper) and the
split-KV Triton kernel (KVRELAY_DECODE_KERNEL=triton). Each is timed eagerly (launch-bound at
small batches); fa2 with tensor cores, XQA and the Triton kernel also as a decode graph runs
them ("graph" rows): one call a layer, over enough layers that the chain reads CHAIN_BYTES of KV
(so that L2 does not hold the next call's pages), captured into one CUDA graph. Owns no state;
needs a GPU and flashinfer.

    python -m bench.attention_bench [--shapes 1x512 256x1500 488x1500] [--json out.json]

The cache is layer-packed and head-major like the engine's ([blocks, layers, 2, Hkv, 16, D],
one layer's strided view), with each sequence's pages scattered over the pool.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.lib.gpu_timing import chain_us
from engine.attention.base import SeqSpan
from engine.attention.dense_table import DenseTableDecode
from engine.attention.flashinfer_backend import WORKSPACE_BYTES
from engine.attention.split_kv_decode import SplitKvDecode

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16  # Llama-3.1-8B attention
NUM_LAYERS = 4  # at least: the page stride spans several layers, as in the engine's cache
MAX_LAYERS = 64
CHAIN_BYTES = 256 << 20  # KV a graph chain reads: 5x the H200's L2


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
    pages_per_seq = -(-context // BLOCK)
    num_blocks = batch * pages_per_seq + 1
    gen = torch.Generator("cuda").manual_seed(0)
    order = torch.randperm(num_blocks - 1, device="cuda", generator=gen).int()
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    rows = []
    for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        rows += on_cache(q, context, order, kv_dtype)
        torch.cuda.empty_cache()
    return rows


def on_cache(
    q: torch.Tensor, context: int, order: torch.Tensor, kv_dtype: torch.dtype
) -> list[dict[str, Any]]:
    """Every kernel's rows over a cache of kv_dtype whose pages `order` holds, row by row."""
    import flashinfer

    batch = q.shape[0]
    pages_per_seq = -(-context // BLOCK)
    kv_bytes = batch * context * 2 * NUM_KV_HEADS * HEAD_DIM * kv_dtype.itemsize
    num_layers = max(NUM_LAYERS, min(MAX_LAYERS, -(-CHAIN_BYTES // kv_bytes)))
    shape = (order.numel() + 1, num_layers, 2, NUM_KV_HEADS, BLOCK, HEAD_DIM)
    cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16).to(kv_dtype)
    layers = [cache[:, i] for i in range(num_layers)]
    rows = []

    def record(kernel: str, run: Callable[[torch.Tensor], Any], graph: bool) -> None:
        ms = time_ms(lambda: run(layers[1]))
        rows.append(timed_row(batch, context, kv_dtype, kernel, ms, kv_bytes))
        if graph:
            us = chain_us([lambda layer=layer: run(layer) for layer in layers])
            rows.append(timed_row(batch, context, kv_dtype, f"{kernel}, graph", us / 1e3, kv_bytes))

    indptr = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * pages_per_seq
    last_len = torch.full((batch,), context - (pages_per_seq - 1) * BLOCK, dtype=torch.int32)
    last_len = last_len.cuda()
    workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    for tensor_cores in (True, False):
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "HND", use_tensor_cores=tensor_cores, backend="fa2", use_cuda_graph=True,
            paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=order,
            paged_kv_last_page_len_buffer=last_len,
        )  # fmt: skip
        wrapper.plan(
            indptr, order, last_len, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK,
            q_data_type=torch.bfloat16, kv_data_type=kv_dtype,
        )  # fmt: skip
        label = f"fa2, tensor cores {str(tensor_cores).lower()}"
        record(label, lambda layer, wrapper=wrapper: wrapper.run(q, layer), tensor_cores)
    decoders: list[DenseTableDecode] = [SplitKvDecode(HEAD_DIM, BLOCK, q.device, [(1.0, 1.0)])]
    if torch.cuda.get_device_capability()[0] in (9, 10, 12):  # where XQA runs
        from engine.attention.xqa_decode import XqaDecode

        decoders.append(XqaDecode(HEAD_DIM, BLOCK, q.device, [(1.0, 1.0)]))
    seqs = [SeqSpan(i, 1, context, row) for i, row in enumerate(order.view(batch, -1).tolist())]
    out = torch.empty_like(q)
    for decoder in decoders:
        decoder.plan(seqs)
        record(decoder.name, lambda layer, d=decoder: d.run(0, q, layer, out), True)
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
        f"batch {batch:4d} ctx {context:5d} {row['kv_dtype']:14s} {kernel:30s}: "
        f"{ms * 1e3:8.1f} us/layer, {row['kv_GBps']:7.0f} GB/s",
        flush=True,
    )
    return row


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
