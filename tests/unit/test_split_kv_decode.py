"""engine/attention/split_kv_decode.py's Triton kernel (decode rows, each row's KV cut into
parts that the last program merges) against torch's attention over the same pages of a
layer-packed cache, bf16 and fp8 (with per-layer scales), one part and many (empty ones
included), eager tables and a graph's static ones: on a GPU, or on the CPU in Triton's
interpreter (tests/conftest.py sets it)."""

from __future__ import annotations

import pytest
import torch

from engine.attention.base import SeqSpan
from engine.attention.split_kv_decode import SplitKvDecode, check_shape, parts_for
from engine.quant import split_k
from tests.triton_device import DEVICE, needs_triton_kernels

pytestmark = needs_triton_kernels
PAGE, HEAD_DIM, KV_HEADS, GROUP, LAYERS, BLOCKS = 16, 32, 2, 4, 2, 24
LAYER = 1  # the second layer's strided view: pages stride over both layers


def cache_and_rows(
    ctx_lens: list[int], dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, list[SeqSpan]]:
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(BLOCKS, LAYERS, 2, KV_HEADS, PAGE, HEAD_DIM, generator=gen)
    cache = (cache * 2).to(dtype)
    order = torch.randperm(BLOCKS, generator=gen).tolist()  # pages scattered
    seqs, used = [], 0
    for row, ctx in enumerate(ctx_lens):
        pages = -(-ctx // PAGE)
        seqs.append(SeqSpan(row, 1, ctx, order[used : used + pages]))
        used += pages
    q = torch.randn(len(ctx_lens), KV_HEADS * GROUP, HEAD_DIM, generator=gen).bfloat16()
    return cache.to(DEVICE), q.to(DEVICE), seqs


def reference(
    layer_cache: torch.Tensor, q: torch.Tensor, seqs: list[SeqSpan], scales: tuple[float, float]
) -> torch.Tensor:
    """torch's attention of q [rows, Hq, D] over each row's pages of one layer's [blocks, 2,
    Hkv, page, D] cache view, K and V times scales: float32, on the CPU (the GPU test's too)."""
    layer = layer_cache.float().cpu()
    kv_heads, head_dim = layer.shape[2], layer.shape[4]
    group = q.shape[1] // kv_heads
    out = []
    for row, seq in enumerate(seqs):
        pages = layer[seq.block_ids]  # [pages, 2, Hkv, page, D]
        k = pages[:, 0].permute(1, 0, 2, 3).reshape(kv_heads, -1, head_dim)[:, : seq.ctx_len]
        v = pages[:, 1].permute(1, 0, 2, 3).reshape(kv_heads, -1, head_dim)[:, : seq.ctx_len]
        k, v = k * scales[0], v * scales[1]
        qr = q[row].float().cpu().view(kv_heads, group, head_dim)
        weights = torch.softmax(qr @ k.transpose(1, 2) * head_dim**-0.5, dim=-1)
        out.append((weights @ v).reshape(kv_heads * group, head_dim))
    return torch.stack(out)


def attend(
    cache: torch.Tensor, q: torch.Tensor, seqs: list[SeqSpan], scales: tuple[float, float],
    num_sms: int, graph: bool = False,
) -> torch.Tensor:  # fmt: skip
    decode = SplitKvDecode(HEAD_DIM, PAGE, DEVICE, [(1.0, 1.0), scales])
    decode.num_sms = num_sms  # parts_for's input: how many parts each row's KV is cut into
    if graph:
        decode.enable_graphs(8, 16)
    decode.plan(seqs, graph=graph)
    out = torch.empty_like(q)
    decode.run(LAYER, q, cache[:, LAYER], out)
    return out.float().cpu()


@pytest.mark.parametrize("num_sms", [1, 12, 64], ids=["one-part", "some-parts", "many-parts"])
def test_bf16_cache_matches_torch(num_sms: int) -> None:
    ctx_lens = [1, 17, 70]  # one token; a page and one; past four pages, partial last
    cache, q, seqs = cache_and_rows(ctx_lens, torch.bfloat16, seed=num_sms)
    got = attend(cache, q, seqs, (1.0, 1.0), num_sms)
    want = reference(cache[:, LAYER], q, seqs, (1.0, 1.0))
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    assert not split_k.counters(DEVICE, 1).any(), "an arrival counter was left set"


def test_fp8_cache_applies_the_layers_scales() -> None:
    scales = (0.5, 2.0)
    cache, q, seqs = cache_and_rows([33, 5], torch.float8_e4m3fn, seed=3)
    got = attend(cache, q, seqs, scales, num_sms=16)
    want = reference(cache[:, LAYER], q, seqs, scales)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    unscaled = reference(cache[:, LAYER], q, seqs, (1.0, 1.0))
    assert (got - unscaled).abs().max() > 0.5, "the scales were applied"


def test_a_graphs_static_table_gives_the_same() -> None:
    cache, q, seqs = cache_and_rows([40, 9], torch.bfloat16, seed=5)
    eager = attend(cache, q, seqs, (1.0, 1.0), num_sms=8)
    graphed = attend(cache, q, seqs, (1.0, 1.0), num_sms=8, graph=True)
    assert torch.equal(eager, graphed)


def test_parts_aim_at_the_sm_count() -> None:
    assert parts_for(1, 8, 132) == 16  # the 8B shape at batch 1 on an H200
    assert parts_for(4, 8, 132) == 4
    assert parts_for(64, 8, 132) == 1
    assert parts_for(1, 1, 1000) == 32  # at most MAX_PARTS


def test_shapes_it_cannot_take_are_refused_by_the_setting() -> None:
    cpu = torch.device("cpu")
    check_shape(128, 16, 4, torch.bfloat16, cpu)  # the 8B shape
    for head_dim, block_size, group, match in (
        (96, 16, 4, "head_dim a power of two"),
        (128, 12, 4, "block size a power of two"),
        (128, 4, 4, "block size a power of two >= 8"),
        (128, 16, 32, "1..16 query heads"),
    ):
        with pytest.raises(ValueError) as refused:
            check_shape(head_dim, block_size, group, torch.bfloat16, cpu)
        assert "KVRELAY_DECODE_KERNEL=triton" in str(refused.value)
        assert match in str(refused.value)


def test_a_cache_view_it_would_misread_is_refused() -> None:
    cache, q, seqs = cache_and_rows([20], torch.bfloat16, seed=7)
    decode = SplitKvDecode(HEAD_DIM, PAGE, DEVICE, [(1.0, 1.0)] * LAYERS)
    decode.plan(seqs)
    nhd = cache[:, LAYER].transpose(2, 3)  # [blocks, 2, PAGE, Hkv, D]: tokens before heads
    with pytest.raises(ValueError, match="cache view must be"):
        decode.run(LAYER, q, nhd, torch.empty_like(q))
    with pytest.raises(ValueError, match="alike"):
        decode.run(LAYER, q, cache[:, LAYER], torch.empty_like(q[:, :4]))
