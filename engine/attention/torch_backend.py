"""TorchAttention: the CPU / reference backend; reads the paged cache directly, no padding.

Single-query sequences (decodes) go to the C++ paged-decode kernel (cpu_kernels.py), which
reads the cache in place. Without it they are attended all at once with torch ops, block by
block: each block gives a partial softmax (max, sum, weighted V), merged per sequence with
index_add.
Multi-token chunks (prefill) run one scaled_dot_product_attention per sequence with a causal
mask offset by the cached prefix. Owns only the per-step index tensors built by plan().

Layers with an attention window (AttentionBackend.windows, Gemma 3's sliding layers) mask the
keys older than it: prefill chunks with a windowed causal mask (one per distinct window, built
in plan() only where the context is longer than the window), decode rows on the torch-ops path
with a per-window block mask. The C++ kernel takes no window: it attends every position, so
it serves only the layers without one (changing its signature would rebuild it on every
machine for one model family; the torch path is the reference anyway).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.attention.cpu_kernels import paged_decode_op
from engine.execution.host_tensors import index_tensor


@dataclass(frozen=True)
class _DecodePlan:
    token_index: torch.Tensor  # [B] packed index of each decode query
    block_ids: torch.Tensor  # [NB] blocks of all decode sequences, concatenated
    block_starts: torch.Tensor  # [B + 1] where each sequence's blocks start in block_ids
    ctx_lens: torch.Tensor  # [B]


@dataclass(frozen=True)
class _GatherTables:
    """What the torch-ops decode path needs beyond _DecodePlan (built only without the kernel)."""

    block_seq: torch.Tensor  # [NB] which decode sequence each block belongs to
    # [NB, 1, 1, block_size] 0, or -inf for positions past ctx_len (and, with a window W,
    # before ctx_len - W)
    block_mask: torch.Tensor

    @classmethod
    def of(
        cls, plan: _DecodePlan, block_size: int, dtype: torch.dtype, window: int | None = None
    ) -> _GatherTables:
        device = plan.block_ids.device
        blocks_per_seq = plan.block_starts[1:] - plan.block_starts[:-1]
        block_seq = torch.repeat_interleave(
            torch.arange(blocks_per_seq.numel(), device=device), blocks_per_seq
        )
        block_in_seq = torch.arange(block_seq.numel(), device=device) - plan.block_starts[block_seq]
        # Tokens from each block's start to its sequence's end (>= block_size but for the last).
        valid = plan.ctx_lens[block_seq] - block_in_seq * block_size
        offsets = torch.arange(block_size, device=device)[None, :]
        invalid = offsets >= valid[:, None]
        if window is not None:  # the query sits at ctx_len - 1: keys from ctx_len - window on
            invalid |= offsets < (valid - window)[:, None]
        mask = torch.zeros(invalid.shape, dtype=dtype, device=device)
        mask.masked_fill_(invalid, float("-inf"))
        return cls(block_seq, mask[:, None, None, :])


@dataclass(frozen=True)
class _PrefillPlan:
    q_start: int
    q_len: int
    ctx_len: int
    block_ids: torch.Tensor
    causal_mask: torch.Tensor | None  # None when there is no cached prefix (plain causal)
    # window -> the windowed causal mask [q_len, ctx_len] (only windows shorter than ctx_len)
    window_masks: dict[int, torch.Tensor]


class TorchAttention(AttentionBackend):
    def __init__(
        self,
        kv_cache: torch.Tensor,
        num_heads: int,
        head_dim: int,
        use_kernel: bool = True,
        scale: float | None = None,
        windows: Sequence[int | None] = (),
    ):
        super().__init__(kv_cache, num_heads, head_dim, scale, windows)
        self._distinct_windows = sorted({w for w in self.windows if w is not None})
        usable = use_kernel and kv_cache.device.type == "cpu" and kv_cache.is_contiguous()
        self._kernel = paged_decode_op() if usable else None
        self.decode_kernel = "cpp" if self._kernel else "torch"
        self.num_layers, block_size = kv_cache.shape[1], kv_cache.shape[4]
        # Row view: one row per (block, layer, k|v, head, offset) slot: writes are row copies.
        self._rows = kv_cache.view(-1, head_dim)
        # Row offset of each kv head inside one (block, layer, k|v) tile.
        self._head_rows = torch.arange(self.num_kv_heads, device=kv_cache.device) * block_size
        self._tile_rows = self.num_kv_heads * block_size  # rows of one (block, layer, k|v) tile

    def plan(self, metadata: AttentionMetadata) -> None:
        self._meta = metadata
        device = self.kv_cache.device
        bs = metadata.block_size
        # Rows [T, Hkv] of each new token's K in layer 0; layer l adds 2 * l * tile, V adds tile.
        first_rows = metadata.slot_block_ids * (self.num_layers * 2 * self._tile_rows) + (
            metadata.slot_offsets
        )
        self._write_rows = (first_rows[:, None] + self._head_rows[None, :]).reshape(-1)
        token_index, block_ids, block_starts, ctx_lens = [], [], [0], []
        self._prefills: list[_PrefillPlan] = []
        for seq in metadata.seqs:
            num_blocks = -(-seq.ctx_len // bs)
            ids = seq.block_ids[:num_blocks]
            if seq.q_len == 1:
                token_index.append(seq.q_start)
                block_ids.extend(ids)
                block_starts.append(len(block_ids))
                ctx_lens.append(seq.ctx_len)
                continue
            q_pos = torch.arange(seq.ctx_len - seq.q_len, seq.ctx_len, device=device)[:, None]
            k_pos = torch.arange(seq.ctx_len, device=device)[None, :]
            mask = None if seq.ctx_len == seq.q_len else k_pos <= q_pos
            window_masks = {
                w: (k_pos <= q_pos) & (k_pos > q_pos - w)
                for w in self._distinct_windows
                if w < seq.ctx_len
            }
            self._prefills.append(
                _PrefillPlan(
                    seq.q_start,
                    seq.q_len,
                    seq.ctx_len,
                    index_tensor(ids, device=device),
                    mask,
                    window_masks,
                )
            )
        self._decode = None
        # window (None: every position) -> the torch-ops path's tables for the layers with it
        self._gather: dict[int | None, _GatherTables] = {}
        if token_index:
            self._decode = _DecodePlan(
                *(index_tensor(x, device=device) for x in (token_index, block_ids, block_starts)),
                index_tensor(ctx_lens, device=device),
            )
            windows = [*self._distinct_windows, *([None] if self._kernel is None else [])]
            for window in windows:
                dtype = self.kv_cache.dtype
                self._gather[window] = _GatherTables.of(self._decode, bs, dtype, window)

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        k_rows = self._write_rows + 2 * layer * self._tile_rows
        self._rows.index_copy_(0, k_rows, k.reshape(-1, self.head_dim))
        self._rows.index_copy_(0, k_rows + self._tile_rows, v.reshape(-1, self.head_dim))
        k_cache = self.kv_cache[:, layer, 0]
        v_cache = self.kv_cache[:, layer, 1]
        out = torch.empty_like(q)
        if self._decode is not None:
            out[self._decode.token_index] = self._decode_attention(layer, q, k_cache, v_cache)
        for plan in self._prefills:
            out[plan.q_start : plan.q_start + plan.q_len] = self._prefill_attention(
                plan, q, k_cache, v_cache, self.windows[layer]
            )
        return out

    def _decode_attention(
        self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        plan = self._decode
        assert plan is not None
        window = self.windows[layer]
        if self._kernel is not None and window is None:
            return self._kernel(
                q[plan.token_index],
                self.kv_cache,
                plan.block_ids,
                plan.block_starts,
                plan.ctx_lens,
                layer,
                self.scale,
            )
        tables = self._gather[window]
        num_seqs = plan.token_index.numel()
        group = self.num_heads // self.num_kv_heads
        q_dec = q[plan.token_index].view(num_seqs, self.num_kv_heads, group, self.head_dim)
        q_blk = q_dec[tables.block_seq]  # [NB, Hkv, G, D]
        k_blk = k_cache.index_select(0, plan.block_ids).transpose(-1, -2)  # [NB, Hkv, D, bs]
        scores = torch.matmul(q_blk, k_blk) * self.scale + tables.block_mask  # [NB, Hkv, G, bs]
        block_max = scores.amax(-1)
        seq_max = torch.full(
            (num_seqs, *block_max.shape[1:]), float("-inf"), dtype=q.dtype, device=q.device
        )
        index = tables.block_seq.view(-1, 1, 1).expand_as(block_max)
        seq_max.scatter_reduce_(0, index, block_max, reduce="amax")
        probs = torch.exp(scores - seq_max[tables.block_seq].unsqueeze(-1))
        denom = torch.zeros_like(seq_max).index_add_(0, tables.block_seq, probs.sum(-1))
        v_blk = v_cache.index_select(0, plan.block_ids)  # [NB, Hkv, bs, D]
        partial = torch.matmul(probs, v_blk)  # [NB, Hkv, G, D]
        out = torch.zeros_like(q_dec).index_add_(0, tables.block_seq, partial)
        out = out / denom.unsqueeze(-1)
        return out.view(num_seqs, self.num_heads, self.head_dim)

    def _prefill_attention(
        self,
        plan: _PrefillPlan,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        window: int | None = None,
    ) -> torch.Tensor:
        # [nb, Hkv, bs, D] -> [1, Hkv, ctx, D]; 4-D inputs take SDPA's fused CPU kernel.
        shape = (1, self.num_kv_heads, -1, self.head_dim)
        keys = k_cache.index_select(0, plan.block_ids).transpose(0, 1).reshape(shape)
        values = v_cache.index_select(0, plan.block_ids).transpose(0, 1).reshape(shape)
        queries = q[plan.q_start : plan.q_start + plan.q_len].transpose(0, 1).unsqueeze(0)
        mask = (
            plan.causal_mask if window is None else plan.window_masks.get(window, plan.causal_mask)
        )
        out = F.scaled_dot_product_attention(
            queries,
            keys[:, :, : plan.ctx_len],
            values[:, :, : plan.ctx_len],
            attn_mask=mask,
            is_causal=mask is None,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return out[0].transpose(0, 1)
