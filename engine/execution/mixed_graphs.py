"""MixedStepGraphs, an experiment (KVRELAY_MIXED_GRAPHS=1; off until a GPU run measures it): a
step the decode graphs do not cover (a prompt's chunk beside decodes), up to MAX_TOKENS tokens,
runs each layer's work outside attention as CUDA graphs captured at a bucket of token counts,
with attention eager between them at the step's true size. Owns the static inputs (token ids,
positions), the one attention-output buffer every piece reads, each bucket's pieces and their
memory pool.

Why: on an H100 an 8B model's step carrying a short prompt launched ~370-500 kernels eagerly,
10-20 ms of host time where its kernels needed 5-10 (bench/RESULTS.md, 2026-12-06). The pieces:
the embedding and layer 0's work up to its attention; each layer's work from its attention's
output to the next layer's attention (o_proj, the residual adds and norms, the MLP, the next
qkv projection); the last layer's to the final norm. Pieces and buckets share one pool, one
qkv, one attention-output and one hidden buffer (Recorder), so the graphs hold no memory per
bucket beyond their own. Every op in a piece is row-wise, so the
padding rows past the step's tokens compute values nothing reads; attention, which writes the KV
cache, sees only the true rows. Dense single-rank models only (a MoE layer routes tokens with
host-side shapes; tensor-parallel ranks would have to replay in step).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from engine.attention.base import AttentionMetadata
from engine.attention.flashinfer_backend import FlashInferAttention
from engine.execution.host_tensors import index_tensor
from engine.execution.step_inputs import StepInputs, TokenFill, smallest_fit
from engine.quant.fp8_types import ScaledRows

if TYPE_CHECKING:
    from engine.models.rope import RotaryEmbedding

MAX_TOKENS = 512  # past this a step's GEMMs, not its launches, take the time: it runs eager


def token_buckets(max_tokens: int) -> list[int]:
    """16, 32, 48, 64, then every 32 up to max_tokens (and max_tokens itself)."""
    sizes = [s for s in (16, 32, 48, 64) if s <= max_tokens]
    sizes += list(range(96, max_tokens + 1, 32))
    if not sizes or sizes[-1] != max_tokens:
        sizes.append(max_tokens)
    return sizes


def per_row(x: ScaledRows) -> bool:
    """Whether x's row scales are one a row (else one for every row, broadcast)."""
    return x.row_scale.dim() > 0 and x.row_scale.shape[0] == x.raw.shape[0]


def first_rows(x: torch.Tensor | ScaledRows, n: int) -> torch.Tensor | ScaledRows:
    """x's first n rows (ScaledRows: its raw rows and their row scales)."""
    if isinstance(x, ScaledRows):
        return ScaledRows(x.raw[:n], x.row_scale[:n] if per_row(x) else x.row_scale, x.col_scale)
    return x[:n]


@dataclass
class Pieces:
    """One bucket's graphs: one more than the layers."""

    graphs: list[torch.cuda.CUDAGraph] = field(default_factory=list)
    ropes: list[RotaryEmbedding] = field(default_factory=list)


def static_like(x: torch.Tensor | ScaledRows, rows: int) -> torch.Tensor | ScaledRows:
    """A buffer of rows rows shaped as x's (ScaledRows: raw rows, row scales and a layer's
    column scales)."""
    if isinstance(x, ScaledRows):
        raw = x.raw.new_zeros((rows, *x.raw.shape[1:]))
        row_scale = torch.zeros_like(x.row_scale)
        if per_row(x):
            row_scale = x.row_scale.new_zeros((rows, *x.row_scale.shape[1:]))
        return ScaledRows(raw, row_scale, torch.zeros_like(x.col_scale))
    return x.new_zeros((rows, *x.shape[1:]))


def copy_rows(into: torch.Tensor | ScaledRows, x: torch.Tensor | ScaledRows) -> None:
    """into's first rows = x (same kind; ScaledRows: raw rows, row scales, column scales)."""
    if isinstance(into, ScaledRows):
        assert isinstance(x, ScaledRows)
        into.raw[: x.raw.shape[0]].copy_(x.raw)
        if per_row(x):
            into.row_scale[: x.row_scale.shape[0]].copy_(x.row_scale)
        else:
            into.row_scale.copy_(x.row_scale)
        into.col_scale.copy_(x.col_scale)
        return
    assert isinstance(x, torch.Tensor)
    into[: x.shape[0]].copy_(x)


class Recorder:
    """The attention the model calls while a bucket's pieces are captured (or run eagerly just
    before, so kernels compile and load outside the capture): forward_qkv copies qkv into the
    one qkv buffer every piece writes, ends the running piece, starts the next and returns the
    one attention-output buffer every piece reads. Layer i's piece writes the qkv buffer,
    attention i reads it and writes the output buffer, piece i + 1 reads that: in stream order,
    one of each serves every layer and bucket."""

    def __init__(self, attention: FlashInferAttention, out: torch.Tensor, pool: Any):
        self.reads_scaled_rows = getattr(attention, "reads_scaled_rows", False)
        self.out = out  # [max tokens, heads, head_dim]
        self.qkv: torch.Tensor | ScaledRows | None = None  # made by the first (eager) run
        self.hidden: torch.Tensor | None = None  # the final norm's output, likewise
        self._pool = pool
        self.pieces: Pieces | None = None  # None: an eager run

    def begin(self) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA calls of other threads (e.g. a KV transfer agent) stay legal
        graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
        return graph

    def forward_qkv(
        self,
        layer: int,
        qkv: torch.Tensor | ScaledRows,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
    ) -> torch.Tensor:
        if self.qkv is None:  # the largest bucket's eager run, outside any capture
            self.qkv = static_like(qkv, self.out.shape[0])
        pieces = self.pieces
        if pieces is not None:
            if layer != len(pieces.ropes):
                raise RuntimeError(f"layer {layer} attends out of order ({len(pieces.ropes)} next)")
            copy_rows(self.qkv, qkv)
            pieces.graphs[-1].capture_end()
            pieces.ropes.append(rope)
            pieces.graphs.append(self.begin())
        return self.out[: qkv.shape[0]]

    def end(self, hidden: torch.Tensor) -> None:
        """The forward's last output: into the hidden buffer (captured in the last piece)."""
        if self.hidden is None:
            self.hidden = hidden.new_zeros((self.out.shape[0], *hidden.shape[1:]))
        if self.pieces is not None:
            self.hidden[: hidden.shape[0]].copy_(hidden)


class MixedStepGraphs:
    def __init__(self, model: nn.Module, attention: FlashInferAttention, max_tokens: int):
        """max_tokens: the step's token budget (buckets stop at it or at MAX_TOKENS). Raises
        what a capture raised (the caller runs those steps eager)."""
        self.model = model
        self.attention = attention
        self.sizes = token_buckets(min(max_tokens, MAX_TOKENS))
        self.num_layers = model.config.num_layers
        device = attention.device
        largest = self.sizes[-1]
        with torch.inference_mode():
            self._inputs = torch.zeros((2, largest), dtype=torch.long, device=device)  # ids, pos
            out = torch.zeros(
                (largest, attention.num_heads, attention.head_dim),
                dtype=attention.q_dtype,
                device=device,
            )
        self._recorder = Recorder(attention, out, torch.cuda.graph_pool_handle())
        self._pieces: dict[int, Pieces] = {}
        self.num_steps = 0  # steps replayed from these graphs
        self._capture_all()

    def bucket(self, num_tokens: int) -> int | None:
        """The captured token count a step of num_tokens runs at; None: run eager."""
        return smallest_fit(self.sizes, num_tokens)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        device = self.attention.device
        stream = torch.cuda.Stream(device)  # a capture may not run on the default stream
        stream.wait_stream(torch.cuda.current_stream(device))
        recorder = self._recorder
        with torch.cuda.stream(stream):
            for n in reversed(self.sizes):  # largest first: the pool is sized once
                ids, positions = self._inputs[0, :n], self._inputs[1, :n]
                recorder.pieces = None
                recorder.end(self.model(ids, positions, recorder))
                stream.synchronize()
                pieces = recorder.pieces = Pieces()
                pieces.graphs.append(recorder.begin())
                try:
                    recorder.end(self.model(ids, positions, recorder))
                finally:
                    pieces.graphs[-1].capture_end()
                    recorder.pieces = None
                if len(pieces.ropes) != self.num_layers:
                    raise RuntimeError(
                        f"{len(pieces.ropes)} attention calls in a forward of "
                        f"{self.num_layers} layers"
                    )
                self._pieces[n] = pieces
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)

    @torch.inference_mode()
    def run(self, inputs: StepInputs, block_size: int, fill: TokenFill | None) -> torch.Tensor:
        """One step of len(inputs.input_ids) tokens (a bucket holds them): the hidden states."""
        num_tokens = len(inputs.input_ids)
        size = self.bucket(num_tokens)
        if size is None:
            raise ValueError(f"{num_tokens} tokens exceed the largest captured bucket")
        pieces = self._pieces[size]
        packed = index_tensor(
            [inputs.input_ids, inputs.positions, inputs.slot_block_ids, inputs.slot_offsets],
            device=self.attention.device,
        )
        inputs.write_pending(packed[0], fill)
        # rows past num_tokens keep an earlier step's ids and positions: valid, never read back
        self._inputs[:, :num_tokens].copy_(packed[:2])
        self.attention.plan(
            AttentionMetadata(
                seqs=inputs.seqs,
                slot_block_ids=packed[2],
                slot_offsets=packed[3],
                block_size=block_size,
            )
        )
        recorder, attention = self._recorder, self.attention
        assert recorder.qkv is not None and recorder.hidden is not None
        positions, out = self._inputs[1, :num_tokens], recorder.out[:num_tokens]
        qkv = first_rows(recorder.qkv, num_tokens)
        pieces.graphs[0].replay()
        for layer, rope in enumerate(pieces.ropes):
            out.copy_(attention.forward_qkv(layer, qkv, positions, rope))
            pieces.graphs[layer + 1].replay()
        self.num_steps += 1
        return recorder.hidden[:num_tokens]


def mixed_graphs_for(model: nn.Module) -> str | None:
    """Why this model's mixed steps cannot run on these graphs; None: they can."""
    config = model.config
    if getattr(config, "moe_layers", None):
        return "MoE layers route tokens with host-side shapes"
    tp = getattr(model, "tp", None)
    if tp is not None and tp.world_size > 1:
        return "tensor-parallel ranks would have to replay in step"
    return None
