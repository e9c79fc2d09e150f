"""MixedStepGraphs: a step no decode graph replays (a prompt's chunk beside decodes), up to
MAX_TOKENS tokens, runs each layer's work outside attention as CUDA graphs captured at a bucket
of token counts, with attention eager between them at the step's true size. Owns the static
inputs (token ids, positions), the one attention-output buffer every piece reads, each bucket's
pieces and their memory pool.

Why: on an H100 an 8B model's step carrying a short prompt launched ~370-500 kernels eagerly,
20-25 ms of host time where its kernels needed 7-10; on these graphs 9.5-12.6 ms, and a lone
short prompt's served TTFT fell from 32.6 to 16.8 ms (bench/RESULTS.md, 2026-12-06). The
pieces: the embedding and layer 0's work up to its attention; each layer's work from its
attention's output to the next layer's attention (o_proj, the residual adds and norms, the MLP,
the next qkv projection); the last layer's to the final norm. Pieces and buckets share one
pool, one qkv, one attention-output and one hidden buffer (Recorder), so the graphs hold no
memory per bucket beyond their own. Every op in a piece is row-wise, so the padding rows past
the step's tokens compute values nothing reads; attention, which writes the KV cache, sees only
the true rows. Dense single-rank models only (a MoE layer routes tokens with host-side shapes;
tensor-parallel ranks would have to replay in step): the others' mixed steps run eager.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from engine.attention.flashinfer_backend import FlashInferAttention
from engine.execution.step_inputs import smallest_fit
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
    """One bucket's graphs (one more than the layers) and the qkv buffer its pieces write."""

    graphs: list[torch.cuda.CUDAGraph] = field(default_factory=list)
    ropes: list[RotaryEmbedding] = field(default_factory=list)
    qkv: torch.Tensor | ScaledRows | None = None


def qkv_kind(x: torch.Tensor | ScaledRows) -> tuple[bool, bool]:
    """What shape of buffer x needs: (ScaledRows, per-row scales). A bucket's row count may pick
    another kind than the next one's (FP8 weights defer their scales for some row counts)."""
    return (True, per_row(x)) if isinstance(x, ScaledRows) else (False, False)


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
    qkv buffer of its kind, ends the running piece, starts the next and returns the one
    attention-output buffer every piece reads. Layer i's piece writes the qkv buffer, attention
    i reads it and writes the output buffer, piece i + 1 reads that: in stream order, one of
    each (a qkv buffer a kind) serves every layer and bucket."""

    def __init__(self, attention: FlashInferAttention, out: torch.Tensor, pool: Any):
        self.reads_scaled_rows = getattr(attention, "reads_scaled_rows", False)
        self.out = out  # [max tokens, heads, head_dim]
        self.qkv: dict[tuple[bool, bool], torch.Tensor | ScaledRows] = {}  # by qkv_kind
        self.hidden: torch.Tensor | None = None  # the final norm's output (first eager run)
        self._pool = pool
        self.pieces: Pieces | None = None  # None: an eager run
        self.capturing: torch.cuda.CUDAGraph | None = None  # the live capture, if any

    def begin(self) -> None:
        assert self.pieces is not None and self.capturing is None
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA calls of other threads (e.g. a KV transfer agent) stay legal
        graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
        self.capturing = graph
        self.pieces.graphs.append(graph)

    def end_piece(self) -> None:
        graph, self.capturing = self.capturing, None
        if graph is not None:
            graph.capture_end()

    def forward_qkv(
        self,
        layer: int,
        qkv: torch.Tensor | ScaledRows,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
    ) -> torch.Tensor:
        kind = qkv_kind(qkv)
        if kind not in self.qkv:  # a bucket's eager run, outside any capture
            self.qkv[kind] = static_like(qkv, self.out.shape[0])
        pieces = self.pieces
        if pieces is not None:
            if layer != len(pieces.ropes):
                raise RuntimeError(f"layer {layer} attends out of order ({len(pieces.ropes)} next)")
            buffer = self.qkv[kind]
            if pieces.qkv is None:
                pieces.qkv = buffer
            elif pieces.qkv is not buffer:
                raise RuntimeError(f"layer {layer}'s qkv is of another kind than layer 0's")
            copy_rows(buffer, qkv)
            self.end_piece()
            pieces.ropes.append(rope)
            self.begin()
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
        what a capture raised, with no capture left running (the caller runs those steps
        eager)."""
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
        try:
            self._capture_all()
        finally:  # the eager runs' activations, and a failed capture's, go back to the card
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()

    def bucket(self, num_tokens: int) -> int | None:
        """The captured token count a step of num_tokens runs at; None: run eager."""
        return smallest_fit(self.sizes, num_tokens)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        device = self.attention.device
        stream = torch.cuda.Stream(device)  # a capture may not run on the default stream
        recorder = self._recorder
        for n in reversed(self.sizes):  # largest first: the pool is sized once
            ids, positions = self._inputs[0, :n], self._inputs[1, :n]
            recorder.pieces = None
            recorder.end(self.model(ids, positions, recorder))  # on the current stream
            stream.wait_stream(torch.cuda.current_stream(device))
            pieces = recorder.pieces = Pieces()
            try:
                with torch.cuda.stream(stream):
                    recorder.begin()
                    recorder.end(self.model(ids, positions, recorder))
                    recorder.end_piece()
            finally:
                if recorder.capturing is not None:  # a failure mid-capture: end it, quietly
                    with contextlib.suppress(Exception):  # the first error is the one raised
                        recorder.end_piece()
                recorder.pieces = None
                torch.cuda.current_stream(device).wait_stream(stream)
            if len(pieces.ropes) != self.num_layers:
                raise RuntimeError(
                    f"{len(pieces.ropes)} attention calls in a forward of {self.num_layers} layers"
                )
            self._pieces[n] = pieces

    @torch.inference_mode()
    def run(self, size: int, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One step of input_ids' tokens (at most size, a captured bucket), its attention
        planned: the hidden states."""
        num_tokens = input_ids.shape[0]
        pieces = self._pieces[size]
        # rows past num_tokens keep an earlier step's ids and positions: valid, never read back
        self._inputs[0, :num_tokens].copy_(input_ids)
        self._inputs[1, :num_tokens].copy_(positions)
        recorder, attention = self._recorder, self.attention
        assert pieces.qkv is not None and recorder.hidden is not None
        qkv, out = first_rows(pieces.qkv, num_tokens), recorder.out[:num_tokens]
        positions = self._inputs[1, :num_tokens]
        pieces.graphs[0].replay()
        for layer, rope in enumerate(pieces.ropes):
            attention.forward_qkv(layer, qkv, positions, rope, out=out)
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
