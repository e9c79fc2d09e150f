"""CUDAGraphDecoder: decode steps replayed from CUDA graphs captured at start-up.

Owns the static input buffers (token ids, positions, KV slots), the static hidden-state output,
one graph per captured batch size and the graphs' shared memory pool. A pure-decode step of n
sequences replays the graph of the next captured size; the padding rows read and write only the
reserved padding block, which the KV cache manager never hands out.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention.base import AttentionMetadata, SeqSpan
from engine.attention.flashinfer_backend import FlashInferAttention
from engine.execution.host_tensors import copy_from_host
from engine.execution.step_inputs import StepInputs, TokenFill, padded_rows, smallest_fit


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_num_seqs (which is always included)."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 8))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


class CUDAGraphDecoder:
    def __init__(
        self,
        model: nn.Module,
        attention: FlashInferAttention,
        max_num_seqs: int,
        max_model_len: int,
        pad_block_id: int,
    ):
        self.model = model
        self.attention = attention
        self.block_size = attention.block_size
        self.pad_block_id = pad_block_id
        self.sizes = capture_sizes(max_num_seqs)
        self.max_batch_size = self.sizes[-1]
        device = attention.device
        hidden_size = model.config.hidden_size
        with torch.inference_mode():
            # rows: input ids, positions, slot block ids, slot offsets
            self._inputs = torch.zeros((4, self.max_batch_size), dtype=torch.long, device=device)
            self._hidden = torch.zeros(
                (self.max_batch_size, hidden_size), dtype=attention.q_dtype, device=device
            )
        attention.enable_cuda_graphs(self.sizes, -(-max_model_len // self.block_size))
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._pool: tuple[int, int] | None = None
        self._capture_all()

    def padded_size(self, num_seqs: int) -> int | None:
        """The captured batch size a step of num_seqs decodes runs at; None: run eager."""
        return smallest_fit(self.sizes, num_seqs)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        for bs in reversed(self.sizes):  # largest first: the pool is sized once
            self._plan(bs, [], [], [], [], [])
            self._forward(bs)  # warm-up outside capture (lazy cuBLAS / kernel init)
            torch.cuda.synchronize(self.attention.device)
            graph = torch.cuda.CUDAGraph()
            # thread_local: CUDA calls of other threads (e.g. a KV transfer agent) stay legal.
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                self._forward(bs)
            if self._pool is None:
                self._pool = graph.pool()
            self._graphs[bs] = graph
        torch.cuda.synchronize(self.attention.device)

    def _forward(self, bs: int) -> None:
        ids, positions = self._inputs[0, :bs], self._inputs[1, :bs]
        self._hidden[:bs] = self.model(ids, positions, self.attention)

    def _plan(
        self,
        bs: int,
        input_ids: list[int],
        positions: list[int],
        slot_block_ids: list[int],
        slot_offsets: list[int],
        seqs: list[SeqSpan],
    ) -> None:
        """Fill the static inputs (padded to bs) and plan the attention of graph bs."""
        host = padded_rows(
            input_ids, positions, slot_block_ids, slot_offsets, bs, self.pad_block_id
        )
        copy_from_host(self._inputs[:, :bs], host)
        padding = [SeqSpan(i, 1, 1, [self.pad_block_id]) for i in range(len(seqs), bs)]
        metadata = AttentionMetadata(
            seqs=seqs + padding,
            slot_block_ids=self._inputs[2, :bs],
            slot_offsets=self._inputs[3, :bs],
            block_size=self.block_size,
        )
        self.attention.plan_cuda_graph(metadata)

    @torch.inference_mode()
    def run(self, inputs: StepInputs, fill: TokenFill | None = None) -> torch.Tensor:
        """Replay one pure-decode step; returns the hidden states [len(seqs), hidden]."""
        seqs = inputs.seqs
        bs = self.padded_size(len(seqs))
        if bs is None:
            raise ValueError(f"{len(seqs)} sequences exceed the largest captured graph")
        self._plan(
            bs,
            inputs.input_ids,
            inputs.positions,
            inputs.slot_block_ids,
            inputs.slot_offsets,
            seqs,
        )
        inputs.write_pending(self._inputs[0, :bs], fill)  # pending tokens, gathered on the device
        self._graphs[bs].replay()
        return self._hidden[: len(seqs)]
