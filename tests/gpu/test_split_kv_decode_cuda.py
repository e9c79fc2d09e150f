"""The split-KV decode kernel (engine/attention/split_kv_decode.py, KVRELAY_DECODE_KERNEL=triton)
on the GPU: on the 8B shape's heads (32 query, 8 KV, head_dim 128) against torch's attention
over the same pages, short and long rows; and in the engine on a tiny Llama against fa2 on the
same cache (bf16 and fp8), pure-decode and mixed steps, with logits along one forced trajectory,
on graphs and eager."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.attention.base import SeqSpan
from engine.attention.split_kv_decode import SplitKvDecode
from engine.attention.xqa_decode import DECODE_KERNEL_ENV
from engine.quant import split_k
from tests.gpu.test_flashinfer_backend import (  # noqa: F401 (tiny_llama: a fixture)
    Recorder,
    build,
    logit_scale,
    max_logit_error,
    pytestmark,
    run_workload,
    tiny_llama,
)
from tests.unit.test_split_kv_decode import reference

CUDA = torch.device("cuda")
PAGE, HEAD_DIM, KV_HEADS, HEADS = 16, 128, 8, 32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("ctx_lens", [[512], [1, 3000, 77, 1500]], ids=["batch-1", "batch-4"])
def test_the_8b_heads_against_torch(ctx_lens: list[int], dtype: torch.dtype) -> None:
    gen = torch.Generator(CUDA).manual_seed(len(ctx_lens))
    num_blocks = sum(-(-c // PAGE) for c in ctx_lens) + 8
    # two layers, so that a layer's pages stride over both, as in the engine's cache
    cache = torch.randn(num_blocks, 2, 2, KV_HEADS, PAGE, HEAD_DIM, device=CUDA, generator=gen)
    cache = cache.to(dtype)
    order = torch.randperm(num_blocks, device=CUDA, generator=gen).tolist()
    seqs, used = [], 0
    for row, ctx in enumerate(ctx_lens):
        pages = -(-ctx // PAGE)
        seqs.append(SeqSpan(row, 1, ctx, order[used : used + pages]))
        used += pages
    q = torch.randn(len(ctx_lens), HEADS, HEAD_DIM, device=CUDA, generator=gen).bfloat16()
    scales = (0.75, 1.5) if dtype != torch.bfloat16 else (1.0, 1.0)
    decode = SplitKvDecode(HEAD_DIM, PAGE, CUDA, [(1.0, 1.0), scales])
    decode.plan(seqs)
    out = decode.run(1, q, cache[:, 1], torch.empty_like(q)).float().cpu()
    want = reference(cache[:, 1], q, seqs, scales)
    torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)
    assert not split_k.counters(CUDA, 1).any()


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_the_engine_with_it_against_fa2(
    tiny_llama: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    kv_cache_dtype: str,
) -> None:
    monkeypatch.setenv(DECODE_KERNEL_ENV, "fa2")
    fa2 = build(tiny_llama, "bfloat16", "flashinfer", kv_cache_dtype=kv_cache_dtype)
    rec_fa2 = Recorder(fa2)
    tokens, _ = run_workload(fa2)
    monkeypatch.setenv(DECODE_KERNEL_ENV, "triton")
    errors = {}
    for graphs in (False, True):
        engine = build(tiny_llama, "bfloat16", "flashinfer", graphs, kv_cache_dtype)
        assert engine.runner.attention.decode_kernel == "triton"
        rec = Recorder(engine, forced=tokens)
        run_workload(engine)
        assert (engine.runner.num_graph_steps > 0) == graphs
        errors[graphs] = max_logit_error(rec_fa2.logits, rec.logits)
    scale = logit_scale(rec_fa2)
    print(f"split-KV vs fa2 ({kv_cache_dtype}): max logit error eager {errors[False]:.4f}, "
          f"graphs {errors[True]:.4f} (max |logit| {scale:.3f})")  # fmt: skip
    # the same attention in another order of sums: bf16 noise, where a wrong page, head or
    # scale would move the logits by about their size
    assert max(errors.values()) <= 0.05 * scale
