"""The C++ CPU paged-decode kernel against the torch reference path of TorchAttention."""

from __future__ import annotations

import pytest
import torch

from engine.attention import cpu_kernels, torch_backend
from engine.attention.base import AttentionMetadata, SeqSpan
from engine.attention.torch_backend import TorchAttention
from engine.settings import Settings

BLOCK_SIZE = 16
HEAD_DIM = 32
NUM_LAYERS = 3


def random_step(
    num_kv_heads: int, ctx_lens: list[int], num_blocks: int, seed: int
) -> tuple[torch.Tensor, AttentionMetadata]:
    """A random cache and one pure-decode step whose sequences own scattered blocks."""
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, NUM_LAYERS, 2, num_kv_heads, BLOCK_SIZE, HEAD_DIM)
    cache = torch.randn(shape, generator=gen)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    seqs, slot_blocks, slot_offsets = [], [], []
    for i, ctx in enumerate(ctx_lens):
        count = -(-ctx // BLOCK_SIZE)
        blocks, order = order[:count], order[count:]
        seqs.append(SeqSpan(i, 1, ctx, blocks))
        slot_blocks.append(blocks[-1])
        slot_offsets.append((ctx - 1) % BLOCK_SIZE)
    meta = AttentionMetadata(
        seqs, torch.tensor(slot_blocks), torch.tensor(slot_offsets), BLOCK_SIZE
    )
    return cache, meta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (6, 2)])
def test_kernel_matches_torch_path(dtype: torch.dtype, num_heads: int, num_kv_heads: int) -> None:
    ctx_lens = [1, 15, 16, 17, 33, 200, 64, 5]
    cache, meta = random_step(num_kv_heads, ctx_lens, num_blocks=40, seed=num_heads)
    cache = cache.to(dtype)
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(len(ctx_lens), num_heads, HEAD_DIM, generator=gen).to(dtype)
    k = torch.randn(len(ctx_lens), num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(len(ctx_lens), num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
    fast = TorchAttention(cache.clone(), num_heads, HEAD_DIM)
    reference = TorchAttention(cache.clone(), num_heads, HEAD_DIM, use_kernel=False)
    assert fast.decode_kernel == "cpp", cpu_kernels.unavailable_reason()
    assert reference.decode_kernel == "torch"
    for backend in (fast, reference):
        backend.plan(meta)
    for layer in range(NUM_LAYERS):
        got = fast.forward(layer, q, k, v)
        want = reference.forward(layer, q, k, v)
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=tolerance)
    assert torch.equal(fast.kv_cache, reference.kv_cache)  # same K/V writes


def test_an_engine_whose_settings_turn_it_off_runs_the_torch_path(
    make_engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KVRELAY_CPU_KERNEL=0 (Settings.cpu_kernel False): the engine never asks for the kernel
    (on a machine where it cannot be built) and decodes on the torch gather path."""

    def refused() -> None:
        raise AssertionError("the kernel was asked for")

    monkeypatch.setattr(torch_backend, "paged_decode_op", refused)
    engine = make_engine(settings=Settings(cpu_kernel=False))
    assert engine.runner.attention.decode_kernel == "torch"
    cache, _ = random_step(2, [3], num_blocks=4, seed=0)
    assert TorchAttention(cache, 2, HEAD_DIM, use_kernel=False).decode_kernel == "torch"
