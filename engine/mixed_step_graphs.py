"""MixedStepGraphs: steps that carry prefill chunks, replayed from piecewise CUDA graphs; owns
the static inputs (token ids, positions, KV slots), the static q|k|v that each piece leaves for
the attention call after it, the static attention output and hidden-state output (all sized for
the largest token bucket), and per bucket the captured pieces.

A decoder's forward is cut at its attention calls into 1 + num_layers pieces: embeddings to the
first q|k|v projection, then o_proj, MLP and the next q|k|v projection, and so on. The model's
own code is captured once per token bucket, under a stand-in attention backend whose every call
ends the piece being captured and begins the next one (the graphs share one memory pool). A
step of T tokens replays the pieces of the smallest bucket >= T with the real attention backend
run eagerly in between over the first T rows (its plan and kernels change with every step's
sequences); the padding rows go through the GEMMs and norms only, their results are dropped
and they write no KV. This removes the launches and host work of everything but attention.

Each piece copies its q|k|v projection into one static buffer, which the attention call after
it reads, so that no piece's output outlives the next piece: the pool then holds about one
step's activations, not one q|k|v per layer per bucket (13 GiB for the 8B shape at 16,384
tokens).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.attention.base import AttentionMetadata
from engine.host_tensors import copy_from_host
from engine.step_inputs import StepInputs, TokenFill, padded_rows, smallest_fit

if TYPE_CHECKING:
    from engine.attention.flashinfer_backend import FlashInferAttention
    from engine.models.rope import RotaryEmbedding

MIN_BUCKET = 16


def token_buckets(max_tokens: int) -> list[int]:
    """16, 32, 64 ... (powers of two) below max_tokens, then max_tokens itself."""
    buckets, size = [], MIN_BUCKET
    while size < max_tokens:
        buckets.append(size)
        size *= 2
    return [*buckets, max_tokens]


@dataclass(frozen=True)
class AttentionCall:
    """One attention call of a captured forward: the layer, the static q|k|v rows the piece
    before it writes and the model's rotary tables."""

    layer: int
    qkv: torch.Tensor
    rope: RotaryEmbedding


@dataclass
class CapturedBucket:
    """A bucket's pieces, in replay order, and the attention calls between them."""

    graphs: list[torch.cuda.CUDAGraph] = field(default_factory=list)
    calls: list[AttentionCall] = field(default_factory=list)


class PieceCutter:
    """Stands in for the attention backend while a forward is captured (or warmed up): copies
    each call's q|k|v into the static buffer (stash), records the call and returns the static
    output buffer that the next piece reads; when capturing, ends the piece being captured and
    begins the next."""

    def __init__(
        self,
        out: torch.Tensor,
        pool: tuple[int, int] | None,
        bucket: CapturedBucket,
        stash: Callable[[torch.Tensor], torch.Tensor],
    ):
        self.out, self.pool, self.bucket, self.stash = out, pool, bucket, stash

    def forward_qkv(
        self, layer: int, qkv: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding
    ) -> torch.Tensor:
        self.bucket.calls.append(AttentionCall(layer, self.stash(qkv), rope))
        if self.pool is not None:
            self.bucket.graphs[-1].capture_end()
            self.begin_piece()
        return self.out

    def begin_piece(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
        self.bucket.graphs.append(graph)


class MixedStepGraphs:
    def __init__(
        self,
        model: nn.Module,
        attention: FlashInferAttention,
        max_num_batched_tokens: int,
        pad_block_id: int,
    ):
        self.model = model
        self.attention = attention
        self.block_size = attention.block_size
        self.pad_block_id = pad_block_id
        self.buckets = token_buckets(max_num_batched_tokens)
        max_tokens = self.buckets[-1]
        device = attention.device
        hidden_size = model.config.hidden_size
        with torch.inference_mode():
            # rows: input ids, positions, slot block ids, slot offsets
            self._inputs = torch.zeros((4, max_tokens), dtype=torch.long, device=device)
            self._hidden = torch.zeros(
                (max_tokens, hidden_size), dtype=attention.q_dtype, device=device
            )
            self._attn_out = torch.zeros(
                (max_tokens, attention.num_heads, attention.head_dim),
                dtype=attention.q_dtype,
                device=device,
            )
            qkv_width = (attention.num_heads + 2 * attention.num_kv_heads) * attention.head_dim
            self._qkv = torch.zeros((max_tokens, qkv_width), dtype=attention.q_dtype, device=device)
        self._pool = torch.cuda.graph_pool_handle()
        self._captured: dict[int, CapturedBucket] = {}
        self._capture_all()

    def bucket_for(self, num_tokens: int) -> int | None:
        """The captured token count a step of num_tokens runs at; None: run eager."""
        return smallest_fit(self.buckets, num_tokens)

    def _stash(self, qkv: torch.Tensor) -> torch.Tensor:
        """Copy a piece's q|k|v projection [T, width] into the static buffer; its rows there."""
        rows = self._qkv[: qkv.shape[0]]
        rows.copy_(qkv)
        return rows

    @torch.inference_mode()
    def _capture_all(self) -> None:
        device = self.attention.device
        stream = torch.cuda.Stream(device)
        for size in reversed(self.buckets):  # largest first: the pool is sized once
            warm_up = PieceCutter(self._attn_out[:size], None, CapturedBucket(), self._stash)
            self._forward(size, warm_up)
            torch.cuda.synchronize(device)  # warmed up: cuBLAS handles, Triton's autotuning
            torch.cuda.empty_cache()  # the warm-up's activations: the graph pool takes their place
            bucket = CapturedBucket()
            cutter = PieceCutter(self._attn_out[:size], self._pool, bucket, self._stash)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                cutter.begin_piece()
                self._forward(size, cutter)
                bucket.graphs[-1].capture_end()
            torch.cuda.current_stream(device).wait_stream(stream)
            self._captured[size] = bucket
        torch.cuda.synchronize(device)

    def _forward(self, size: int, attention: PieceCutter) -> None:
        ids, positions = self._inputs[0, :size], self._inputs[1, :size]
        self._hidden[:size] = self.model(ids, positions, attention)

    @torch.inference_mode()
    def run(self, inputs: StepInputs, fill: TokenFill | None = None) -> torch.Tensor:
        """Replay one step's pieces with attention in between; the hidden states [T, hidden]."""
        num_tokens = len(inputs.input_ids)
        size = self.bucket_for(num_tokens)
        if size is None:
            raise ValueError(f"{num_tokens} tokens exceed the largest captured bucket")
        host = padded_rows(
            inputs.input_ids,
            inputs.positions,
            inputs.slot_block_ids,
            inputs.slot_offsets,
            size,
            self.pad_block_id,
        )
        copy_from_host(self._inputs[:, :size], host)
        inputs.write_pending(self._inputs[0, :size], fill)
        positions = self._inputs[1, :num_tokens]
        self.attention.plan(
            AttentionMetadata(
                seqs=inputs.seqs,
                slot_block_ids=self._inputs[2, :num_tokens],
                slot_offsets=self._inputs[3, :num_tokens],
                block_size=self.block_size,
            )
        )
        bucket = self._captured[size]
        for piece, graph in enumerate(bucket.graphs):
            graph.replay()
            if piece < len(bucket.calls):
                call = bucket.calls[piece]
                qkv = call.qkv[:num_tokens]
                out = self.attention.forward_qkv(call.layer, qkv, positions, call.rope)
                self._attn_out[:num_tokens].copy_(out)
        return self._hidden[:num_tokens]
