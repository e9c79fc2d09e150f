"""XqaDecode: FlashInfer's XQA decode kernel over the fp8 paged cache (Hopper); owns its zeroed
workspace (semaphores + split scratch), and (DenseTableDecode) the dense page table and lengths;
also the choice of decode kernel by hardware and cache dtype.

FlashInfer's fa2 decode template reads an e4m3 cache no faster per token than a bf16 one (it
converts tiles to 16 bits before the tensor cores), so an fp8 cache bought batch size, not
speed. XQA's SM90 kernel (TensorRT-LLM's, JIT-built by FlashInfer) loads e4m3 pages with TMA
and multiplies them in fp8. It wants a dense [batch, pages] table instead of FlashInfer's CSR
one; the layer-packed cache is passed as strided K and V views (the kernel takes strides).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.attention.dense_table import DenseTableDecode

FP8_KV_DTYPE = torch.float8_e4m3fn
XQA_WORKSPACE_BYTES = 64 << 20  # 8 MiB of semaphores, then the multi-block scratch
XQA_PAGE_SIZES = (16, 32, 64, 128)


def use_xqa(
    kv_dtype: torch.dtype, capability: tuple[int, int], page_size: int, head_dim: int
) -> bool:
    """Whether decode rows run on XQA: for an fp8 cache on Hopper (SM90), where it has the fp8
    tensor-core kernel (4.3 TB/s of e4m3 pages at batch 488 on an H200 against fa2's 2.5), in
    the page sizes and head dims it was built for; FlashInfer's fa2 decode everywhere else."""
    fits = page_size in XQA_PAGE_SIZES and head_dim in (64, 128, 256)
    return fits and kv_dtype == FP8_KV_DTYPE and capability[0] == 9


class XqaDecode(DenseTableDecode):
    """Runs single-token decode rows on XQA over the planned dense table (DenseTableDecode).

    run() attends one layer.
    """

    name = "xqa"

    def __init__(self, *args: Any, **kwargs: Any):
        """DenseTableDecode's arguments; then FlashInfer's XQA and its zeroed workspace."""
        from flashinfer.decode import xqa_batch_decode_with_kv_cache

        super().__init__(*args, **kwargs)
        self._xqa = xqa_batch_decode_with_kv_cache
        self._workspace = torch.zeros(XQA_WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)

    def run(
        self, layer: int, q: torch.Tensor, layer_cache: torch.Tensor, out: torch.Tensor
    ) -> torch.Tensor:
        """q [rows, Hq, D] (contiguous) -> out (same shape, contiguous), over one layer's
        [blocks, 2, Hkv, block_size, D] view of the cache."""
        table, lens = self.planned()
        k_scale, v_scale = self.kv_scales[layer]
        return self._xqa(
            q,
            (layer_cache[:, 0], layer_cache[:, 1]),
            self._workspace,
            table,
            lens,
            table.shape[1] * self.block_size,
            bmm1_scale=k_scale * self.head_dim**-0.5,
            bmm2_scale=v_scale,
            out=out,
            kv_layout="HND",
        )
