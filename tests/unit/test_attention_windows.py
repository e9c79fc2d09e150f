"""Per-layer attention windows in TorchAttention (Gemma 3's sliding layers) against a dense
reference: a query at position p attends to the keys at positions (p - W, p], in prefill chunks
(with and without a cached prefix) and decode rows, with the C++ decode kernel and without."""

from __future__ import annotations

import pytest
import torch

from engine.attention.base import AttentionMetadata, SeqSpan
from engine.attention.torch_backend import TorchAttention

BLOCK_SIZE = 16
HEAD_DIM = 16
NUM_HEADS, NUM_KV_HEADS = 4, 2
WINDOWS = (7, None, 16, 1)  # shorter than a block, none, a block, only the query's own key
SCALE = 0.3
# (q_len, ctx_len): decode rows, a chunk after a cached prefix, a whole prompt, short ones
SEQS = [(1, 1), (1, 5), (1, 17), (1, 40), (10, 30), (25, 25), (3, 3), (1, 7)]


def mixed_step(seed: int) -> tuple[torch.Tensor, AttentionMetadata]:
    """A random cache and one step of SEQS over scattered blocks, tokens packed in order."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-ctx // BLOCK_SIZE) for _, ctx in SEQS) + 3
    shape = (num_blocks, len(WINDOWS), 2, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    cache = torch.randn(shape, generator=gen)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    seqs, slot_blocks, slot_offsets, start = [], [], [], 0
    for q_len, ctx in SEQS:
        count = -(-ctx // BLOCK_SIZE)
        blocks, order = order[:count], order[count:]
        seqs.append(SeqSpan(start, q_len, ctx, blocks))
        for pos in range(ctx - q_len, ctx):
            slot_blocks.append(blocks[pos // BLOCK_SIZE])
            slot_offsets.append(pos % BLOCK_SIZE)
        start += q_len
    meta = AttentionMetadata(
        seqs, torch.tensor(slot_blocks), torch.tensor(slot_offsets), BLOCK_SIZE
    )
    return cache, meta


def reference(
    cache: torch.Tensor, meta: AttentionMetadata, layer: int, q: torch.Tensor
) -> torch.Tensor:
    """Dense attention of every query over its sequence's keys in (p - W, p], from the cache
    (after the step's writes)."""
    window = WINDOWS[layer]
    out = torch.empty_like(q)
    group = NUM_HEADS // NUM_KV_HEADS
    for seq in meta.seqs:
        ids = torch.tensor(seq.block_ids)
        # [Hkv, ctx, D]
        keys = cache[ids, layer, 0].transpose(0, 1).reshape(NUM_KV_HEADS, -1, HEAD_DIM)
        values = cache[ids, layer, 1].transpose(0, 1).reshape(NUM_KV_HEADS, -1, HEAD_DIM)
        keys = keys[:, : seq.ctx_len].repeat_interleave(group, 0)
        values = values[:, : seq.ctx_len].repeat_interleave(group, 0)
        for i in range(seq.q_len):
            p = seq.ctx_len - seq.q_len + i
            first = 0 if window is None else max(0, p - window + 1)
            query = q[seq.q_start + i]  # [H, D]
            scores = torch.einsum("hd,hkd->hk", query, keys[:, first : p + 1]) * SCALE
            probs = scores.softmax(-1)
            out[seq.q_start + i] = torch.einsum("hk,hkd->hd", probs, values[:, first : p + 1])
    return out


@pytest.mark.parametrize("use_kernel", [True, False])
def test_windowed_layers_attend_only_to_their_window(use_kernel: bool) -> None:
    cache, meta = mixed_step(seed=1)
    gen = torch.Generator().manual_seed(2)
    tokens = meta.num_tokens
    backend = TorchAttention(
        cache.clone(), NUM_HEADS, HEAD_DIM, use_kernel, scale=SCALE, windows=WINDOWS
    )
    backend.plan(meta)
    for layer in range(len(WINDOWS)):
        q = torch.randn(tokens, NUM_HEADS, HEAD_DIM, generator=gen)
        k = torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen)
        v = torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen)
        got = backend.forward(layer, q, k, v)
        want = reference(backend.kv_cache, meta, layer, q)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_window_changes_the_output_only_past_it() -> None:
    """The same step with and without windows: rows whose context fits the window agree, the
    others differ (the reference's check is not vacuous)."""
    cache, meta = mixed_step(seed=3)
    gen = torch.Generator().manual_seed(4)
    tokens = meta.num_tokens
    q = torch.randn(tokens, NUM_HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    windowed = TorchAttention(cache.clone(), NUM_HEADS, HEAD_DIM, windows=WINDOWS)
    full = TorchAttention(cache.clone(), NUM_HEADS, HEAD_DIM)
    outs = []
    for backend in (windowed, full):
        backend.plan(meta)
        outs.append(backend.forward(0, q, k, v))  # layer 0: a window of 7
    positions = [s.ctx_len - s.q_len + i for s in meta.seqs for i in range(s.q_len)]
    inside = torch.tensor([p < WINDOWS[0] for p in positions])
    torch.testing.assert_close(outs[0][inside], outs[1][inside], atol=1e-5, rtol=1e-5)
    differs = (outs[0] - outs[1]).abs().amax(dim=(1, 2)) > 1e-3
    assert differs[~inside].all()


def test_windows_are_checked() -> None:
    cache, _ = mixed_step(seed=0)
    with pytest.raises(ValueError, match="3 attention windows for 4 layers"):
        TorchAttention(cache, NUM_HEADS, HEAD_DIM, windows=(1, 2, 3))
    with pytest.raises(ValueError, match="must be >= 1"):
        TorchAttention(cache, NUM_HEADS, HEAD_DIM, windows=(0, None, None, None))
