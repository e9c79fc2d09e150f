"""DenseTableDecode: the page table of single-token decode rows as a dense [rows, pages] tensor
with the rows' lengths, for the decode kernel that takes it (XQA's);
owns this step's table and lengths and the static buffers the decode graphs read.

FlashInfer's wrappers take a CSR page table instead. One instance serves eager steps (a table
per step) and every decode graph (static buffers sized for the largest graph; a graph replays
right after its own plan)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.attention.base import SeqSpan
from engine.execution.host_tensors import copy_from_host, index_tensor, to_device


def dense_page_table(seqs: Sequence[SeqSpan], block_size: int, width: int) -> list[int]:
    """The rows' block ids, each row padded to width pages (the padding is never read: the
    kernel stops at the row's length), flattened row-major."""
    table: list[int] = []
    for seq in seqs:
        num_pages = -(-seq.ctx_len // block_size)
        table.extend(seq.block_ids[:num_pages])
        table.extend([0] * (width - num_pages))
    return table


class DenseTableDecode:
    """plan() uploads one step's table and lengths; subclasses' run() attends one layer.

    kv_scales: per layer (k_scale, v_scale) of an fp8 cache (1.0 without them).
    """

    name = ""  # the decode kernel's name (FlashInferAttention.decode_kernel)

    def __init__(
        self,
        head_dim: int,
        block_size: int,
        device: torch.device,
        kv_scales: Sequence[tuple[float, float]],
    ):
        self.head_dim = head_dim
        self.block_size = block_size
        self.device = device
        self.kv_scales = list(kv_scales)
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

    def planned(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's (table [rows, width], lengths [rows]) on the device."""
        assert self._table is not None and self._lens is not None, "plan() first"
        return self._table, self._lens
