"""AttentionMetadata (one step's packed-batch layout) and the AttentionBackend interface.

Invariants: tokens are packed per sequence in SeqSpan order; sequence i's queries are
tokens [q_start, q_start + q_len) at positions [ctx_len - q_len, ctx_len); its K/V for all
ctx_len positions live in block_ids (the last q_len written by this step's forward).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.models.rope import RotaryEmbedding


@dataclass(frozen=True)
class SeqSpan:
    q_start: int
    q_len: int
    ctx_len: int
    block_ids: list[int]


@dataclass(frozen=True)
class AttentionMetadata:
    seqs: list[SeqSpan]
    slot_block_ids: torch.Tensor  # [num_tokens] physical block of each new token
    slot_offsets: torch.Tensor  # [num_tokens] offset inside that block
    block_size: int

    @property
    def num_tokens(self) -> int:
        return int(self.slot_block_ids.numel())


class AttentionBackend(abc.ABC):
    """Writes new K/V into the paged cache and attends over it.

    kv_cache layout: [num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]
    (layer-packed: one block holds every layer's K and V, so it is one contiguous region;
    head-major inside: each head's block_size x head_dim tile is contiguous, FlashInfer's HND).
    reads_scaled_rows: forward_qkv also takes an Fp8Linear's ScaledRows (engine/quant/fp8.py)
    and applies their scales itself; other backends get the q|k|v values.
    scale: the softmax scale (None: head_dim ** -0.5). windows: per layer, its attention window
    W (a query at position p attends to the keys at positions (p - W, p]: transformers'
    sliding_window) or None for every position (ModelConfig.layer_windows; empty: all None).
    The paged cache keeps every position of every layer either way.
    """

    reads_scaled_rows = False

    def __init__(
        self,
        kv_cache: torch.Tensor,
        num_heads: int,
        head_dim: int,
        scale: float | None = None,
        windows: Sequence[int | None] = (),
    ):
        self.kv_cache = kv_cache
        self.num_heads = num_heads
        self.num_kv_heads = kv_cache.shape[3]
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        num_layers = kv_cache.shape[1]
        if windows and len(windows) != num_layers:
            raise ValueError(f"{len(windows)} attention windows for {num_layers} layers")
        if any(w is not None and w < 1 for w in windows):
            raise ValueError(f"attention windows must be >= 1 (or None), got {list(windows)}")
        self.windows: tuple[int | None, ...] = tuple(windows) or (None,) * num_layers

    @abc.abstractmethod
    def plan(self, metadata: AttentionMetadata) -> None:
        """Prepare index tensors for this step; called once before the layers run."""

    @abc.abstractmethod
    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """q: [T, num_heads, D], k/v: [T, num_kv_heads, D] -> [T, num_heads, D]."""

    def forward_qkv(
        self, layer: int, qkv: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding
    ) -> torch.Tensor:
        """The packed q|k|v projection [T, (Hq + 2 Hkv) * D]: RoPE, K/V write, attention.

        -> [T, num_heads, D]. A backend may override this to fuse RoPE with the cache write.
        """
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q, k = rope(
            positions,
            q.view(-1, self.num_heads, self.head_dim),
            k.view(-1, self.num_kv_heads, self.head_dim),
        )
        return self.forward(layer, q, k, v.view(-1, self.num_kv_heads, self.head_dim))
