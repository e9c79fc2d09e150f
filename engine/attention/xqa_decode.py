"""XqaDecode: FlashInfer's XQA decode kernel over the fp8 paged cache (Hopper); owns its zeroed
workspace (semaphores + split scratch) and the dense page-table and sequence-length buffers.

FlashInfer's fa2 decode template reads an e4m3 cache no faster per token than a bf16 one (it
converts tiles to 16 bits before the tensor cores), so an fp8 cache bought batch size, not
speed. XQA's SM90 kernel (TensorRT-LLM's, JIT-built by FlashInfer) loads e4m3 pages with TMA
and multiplies them in fp8. It wants a dense [batch, pages] table instead of FlashInfer's CSR
one; the layer-packed cache is passed as strided K and V views (the kernel takes strides).
One XqaDecode serves eager steps (a table per step) and every decode graph (static buffers sized
for the largest graph; a graph replays right after its own plan, as with the fa2 wrappers).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from engine.attention.base import SeqSpan
from engine.host_tensors import copy_from_host, index_tensor, to_device

FP8_KV_DTYPE = torch.float8_e4m3fn
XQA_WORKSPACE_BYTES = 64 << 20  # 8 MiB of semaphores, then the multi-block scratch
DECODE_KERNEL_ENV = "KVRELAY_DECODE_KERNEL"  # "auto" (default), "xqa" or "fa2"
DECODE_KERNELS = ("auto", "xqa", "fa2")
XQA_PAGE_SIZES = (16, 32, 64, 128)


def decode_kernel_choice() -> str:
    """The decode kernel asked for in the environment (auto when unset)."""
    choice = os.environ.get(DECODE_KERNEL_ENV, "auto")
    if choice not in DECODE_KERNELS:
        raise ValueError(f"{DECODE_KERNEL_ENV} must be one of {DECODE_KERNELS}, got {choice!r}")
    return choice


def use_xqa(
    choice: str, kv_dtype: torch.dtype, capability: tuple[int, int], page_size: int, head_dim: int
) -> bool:
    """Whether decode rows run on XQA: auto picks it for an fp8 cache on Hopper (SM90), where
    it has the fp8 tensor-core kernel; "xqa" forces it where XQA runs at all (SM90, SM100,
    SM120), "fa2" never. Shapes XQA was not built for are refused when forced."""
    if choice == "fa2":
        return False
    fits = page_size in XQA_PAGE_SIZES and head_dim in (64, 128, 256)
    if choice == "auto":
        return fits and kv_dtype == FP8_KV_DTYPE and capability[0] == 9
    if capability[0] not in (9, 10, 12):
        raise ValueError(f"{DECODE_KERNEL_ENV}=xqa needs an SM90/SM100/SM120 GPU")
    if not fits:
        raise ValueError(
            f"{DECODE_KERNEL_ENV}=xqa needs a block size in {XQA_PAGE_SIZES} and head_dim 64, "
            f"128 or 256; got {page_size} and {head_dim}"
        )
    return True


def dense_page_table(seqs: Sequence[SeqSpan], block_size: int, width: int) -> list[int]:
    """The rows' block ids, each row padded to width pages (the padding is never read: the
    kernel stops at the row's length), flattened row-major."""
    table: list[int] = []
    for seq in seqs:
        num_pages = -(-seq.ctx_len // block_size)
        table.extend(seq.block_ids[:num_pages])
        table.extend([0] * (width - num_pages))
    return table


class XqaDecode:
    """Plans and runs single-token decode rows on XQA.

    plan() fills the table and lengths for one step; run() attends one layer. kv_scales: per
    layer (k_scale, v_scale) of the fp8 cache (1.0 without them).
    """

    def __init__(
        self,
        head_dim: int,
        block_size: int,
        device: torch.device,
        kv_scales: Sequence[tuple[float, float]],
    ):
        from flashinfer.decode import xqa_batch_decode_with_kv_cache

        self._xqa = xqa_batch_decode_with_kv_cache
        self.head_dim = head_dim
        self.block_size = block_size
        self.device = device
        self.kv_scales = list(kv_scales)
        self._workspace = torch.zeros(XQA_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._graph_table: torch.Tensor | None = None  # [max graph rows, max pages per seq]
        self._graph_lens: torch.Tensor | None = None
        self._table: torch.Tensor | None = None  # this step's [rows, width]
        self._lens: torch.Tensor | None = None

    def enable_graphs(self, max_rows: int, max_pages_per_seq: int) -> None:
        """Static table and length buffers that the decode graphs read (one graph at a time)."""
        self._graph_table = torch.zeros(
            (max_rows, max_pages_per_seq), dtype=torch.int32, device=self.device
        )
        self._graph_lens = torch.zeros(max_rows, dtype=torch.int32, device=self.device)

    def plan(self, seqs: Sequence[SeqSpan], graph: bool = False) -> None:
        """Upload the page table of decode rows seqs (each q_len 1), as wide as this step's
        longest row: into the static buffers for a graph (whose full width the kernel is told,
        so a replay launches what was captured), else into new tensors."""
        num_rows = len(seqs)
        lens = index_tensor([seq.ctx_len for seq in seqs], torch.int32)
        width = max(-(-seq.ctx_len // self.block_size) for seq in seqs)
        if graph:
            # Only this step's columns are written: a row's pages past its length are never
            # read, and a full-width table (max_model_len / block_size pages a row) would cost
            # the host more than the step.
            assert self._graph_table is not None and self._graph_lens is not None
            host = self._host_table(seqs, width)
            copy_from_host(self._graph_table[:num_rows, :width], host)
            copy_from_host(self._graph_lens[:num_rows], lens)
            self._table, self._lens = self._graph_table[:num_rows], self._graph_lens[:num_rows]
            return
        self._table = to_device(self._host_table(seqs, width), self.device)
        self._lens = to_device(lens, self.device)

    def _host_table(self, seqs: Sequence[SeqSpan], width: int) -> torch.Tensor:
        flat = dense_page_table(seqs, self.block_size, width)
        return index_tensor(flat, torch.int32).view(len(seqs), width)

    def run(
        self, layer: int, q: torch.Tensor, layer_cache: torch.Tensor, out: torch.Tensor
    ) -> torch.Tensor:
        """q [rows, Hq, D] (contiguous) -> out (same shape, contiguous), over one layer's
        [blocks, 2, Hkv, block_size, D] view of the cache."""
        assert self._table is not None and self._lens is not None, "plan() first"
        k_scale, v_scale = self.kv_scales[layer]
        return self._xqa(
            q,
            (layer_cache[:, 0], layer_cache[:, 1]),
            self._workspace,
            self._table,
            self._lens,
            self._table.shape[1] * self.block_size,
            bmm1_scale=k_scale * self.head_dim**-0.5,
            bmm2_scale=v_scale,
            out=out,
            kv_layout="HND",
        )
