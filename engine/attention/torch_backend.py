"""TorchAttention: the CPU / reference backend; reads the paged cache directly, no padding.

Single-query sequences (decodes) are attended all at once, block by block: each block gives a
partial softmax (max, sum, weighted V) and partials are merged per sequence with index_add.
Multi-token chunks (prefill) run one scaled_dot_product_attention per sequence with a causal
mask offset by the cached prefix. Owns only the per-step index tensors built by plan().
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, AttentionMetadata


@dataclass(frozen=True)
class _DecodePlan:
    token_index: torch.Tensor  # [B] packed index of each decode query
    block_ids: torch.Tensor  # [NB] blocks of all decode sequences, concatenated
    block_seq: torch.Tensor  # [NB] which decode sequence each block belongs to
    block_mask: torch.Tensor  # [NB, 1, 1, block_size] 0 or -inf for positions past ctx_len


@dataclass(frozen=True)
class _PrefillPlan:
    q_start: int
    q_len: int
    ctx_len: int
    block_ids: torch.Tensor
    causal_mask: torch.Tensor | None  # None when there is no cached prefix (plain causal)


class TorchAttention(AttentionBackend):
    def __init__(self, kv_cache: torch.Tensor, num_heads: int, head_dim: int):
        super().__init__(kv_cache, num_heads, head_dim)
        num_blocks, self.num_layers, _, block_size = kv_cache.shape[:4]
        # Row view: one row per (block, layer, k|v, offset) slot, so writes are row copies.
        self._rows = kv_cache.view(num_blocks * self.num_layers * 2 * block_size, -1)

    def plan(self, metadata: AttentionMetadata) -> None:
        self._meta = metadata
        device = self.kv_cache.device
        bs = metadata.block_size
        # Row of the K slot of each new token in layer 0; layer l adds 2 * l * bs, V adds bs.
        self._write_rows = metadata.slot_block_ids * (self.num_layers * 2 * bs) + (
            metadata.slot_offsets
        )
        token_index, block_ids, block_seq, valid = [], [], [], []
        self._prefills: list[_PrefillPlan] = []
        for seq in metadata.seqs:
            num_blocks = -(-seq.ctx_len // bs)
            ids = seq.block_ids[:num_blocks]
            if seq.q_len == 1:
                idx = len(token_index)
                token_index.append(seq.q_start)
                block_ids.extend(ids)
                block_seq.extend([idx] * num_blocks)
                valid.extend([bs] * (num_blocks - 1) + [seq.ctx_len - (num_blocks - 1) * bs])
                continue
            mask = None
            if seq.ctx_len != seq.q_len:
                q_pos = torch.arange(seq.ctx_len - seq.q_len, seq.ctx_len, device=device)
                mask = torch.arange(seq.ctx_len, device=device)[None, :] <= q_pos[:, None]
            self._prefills.append(
                _PrefillPlan(
                    seq.q_start,
                    seq.q_len,
                    seq.ctx_len,
                    torch.tensor(ids, dtype=torch.long, device=device),
                    mask,
                )
            )
        self._decode = None
        if token_index:
            counts = torch.tensor(valid, device=device)
            positions = torch.arange(bs, device=device)
            invalid = positions[None, :] >= counts[:, None]
            mask = torch.zeros(invalid.shape, dtype=self.kv_cache.dtype, device=device)
            mask.masked_fill_(invalid, float("-inf"))
            self._decode = _DecodePlan(
                torch.tensor(token_index, dtype=torch.long, device=device),
                torch.tensor(block_ids, dtype=torch.long, device=device),
                torch.tensor(block_seq, dtype=torch.long, device=device),
                mask[:, None, None, :],
            )

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        bs = self._meta.block_size
        k_rows = self._write_rows + 2 * layer * bs
        num_tokens = k.shape[0]
        self._rows.index_copy_(0, k_rows, k.reshape(num_tokens, -1))
        self._rows.index_copy_(0, k_rows + bs, v.reshape(num_tokens, -1))
        k_cache = self.kv_cache[:, layer, 0]
        v_cache = self.kv_cache[:, layer, 1]
        out = torch.empty_like(q)
        if self._decode is not None:
            out[self._decode.token_index] = self._decode_attention(q, k_cache, v_cache)
        for plan in self._prefills:
            out[plan.q_start : plan.q_start + plan.q_len] = self._prefill_attention(
                plan, q, k_cache, v_cache
            )
        return out

    def _decode_attention(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        plan = self._decode
        assert plan is not None
        num_seqs = plan.token_index.numel()
        group = self.num_heads // self.num_kv_heads
        q_dec = q[plan.token_index].view(num_seqs, self.num_kv_heads, group, self.head_dim)
        q_blk = q_dec[plan.block_seq]  # [NB, Hkv, G, D]
        k_blk = k_cache.index_select(0, plan.block_ids).permute(0, 2, 3, 1)  # [NB, Hkv, D, bs]
        scores = torch.matmul(q_blk, k_blk) * self.scale + plan.block_mask  # [NB, Hkv, G, bs]
        block_max = scores.amax(-1)
        seq_max = torch.full(
            (num_seqs, *block_max.shape[1:]), float("-inf"), dtype=q.dtype, device=q.device
        )
        index = plan.block_seq.view(-1, 1, 1).expand_as(block_max)
        seq_max.scatter_reduce_(0, index, block_max, reduce="amax")
        probs = torch.exp(scores - seq_max[plan.block_seq].unsqueeze(-1))
        denom = torch.zeros_like(seq_max).index_add_(0, plan.block_seq, probs.sum(-1))
        v_blk = v_cache.index_select(0, plan.block_ids).permute(0, 2, 1, 3)  # [NB, Hkv, bs, D]
        partial = torch.matmul(probs, v_blk)  # [NB, Hkv, G, D]
        out = torch.zeros_like(q_dec).index_add_(0, plan.block_seq, partial)
        out = out / denom.unsqueeze(-1)
        return out.view(num_seqs, self.num_heads, self.head_dim)

    def _prefill_attention(
        self, plan: _PrefillPlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        shape = (-1, self.num_kv_heads, self.head_dim)
        keys = k_cache.index_select(0, plan.block_ids).reshape(shape)[: plan.ctx_len]
        values = v_cache.index_select(0, plan.block_ids).reshape(shape)[: plan.ctx_len]
        queries = q[plan.q_start : plan.q_start + plan.q_len].transpose(0, 1)
        out = F.scaled_dot_product_attention(
            queries,
            keys.transpose(0, 1),
            values.transpose(0, 1),
            attn_mask=plan.causal_mask,
            is_causal=plan.causal_mask is None,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return out.transpose(0, 1)
