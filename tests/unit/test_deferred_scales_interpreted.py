"""Kernels that read an Fp8Linear's ScaledRows (the unscaled product with its row and column
scales) against the same kernels on the scaled values: add + RMSNorm + quantize, SiLU-and-mul
+ quantize, and RoPE + paged KV write. On a GPU, or on the CPU in Triton's interpreter, in
float32 (the kernels' roundings are exact there), so the two must agree to float rounding.
Also ScaledRows' own math and which layers defer their scales."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.attention import rope_kv_kernel
from engine.models.rope import RotaryEmbedding
from engine.quant import fp8_fused
from engine.quant.fp8 import Fp8Linear, defers_scales
from engine.quant.fp8_types import ScaledRows, materialized
from tests.factories import make_model_config
from tests.triton_device import DEVICE, needs_triton_kernels

pytest.importorskip("triton")


def scaled_rows(num_rows: int, num_cols: int, seed: int) -> ScaledRows:
    """Random float32 ScaledRows whose every row and column has its own scale."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randn(num_rows, num_cols, generator=gen) * 50
    row_scale = torch.rand(num_rows, 1, generator=gen) * 0.02 + 0.001
    col_scale = torch.rand(1, num_cols, generator=gen) * 0.02 + 0.001
    return ScaledRows(raw.to(DEVICE), row_scale.to(DEVICE), col_scale.to(DEVICE))


def test_scaled_rows_stand_for_raw_times_both_scales() -> None:
    rows = scaled_rows(3, 5, seed=0)
    want = rows.raw * rows.row_scale * rows.col_scale
    torch.testing.assert_close(rows.materialize(), want, atol=0, rtol=1e-6)
    assert materialized(rows).shape == rows.shape == (3, 5)
    plain = torch.ones(2, 2)
    assert materialized(plain) is plain


def test_only_cuda_fp8_layers_defer_their_scales() -> None:
    rows = torch.ones(64, 32)  # on the CPU: never deferred
    assert not defers_scales(nn.Linear(32, 32), rows)
    assert not defers_scales(Fp8Linear(32, 32, bias=False, static_input_scale=False), rows)


@needs_triton_kernels
@pytest.mark.parametrize("add", [True, False], ids=["add", "first-layer"])
def test_add_rms_norm_quantize_reads_scaled_rows(add: bool) -> None:
    x = scaled_rows(5, 96, seed=1)
    gen = torch.Generator().manual_seed(2)
    residual = torch.randn(5, 96, generator=gen).to(DEVICE) if add else None
    weight = (torch.rand(96, generator=gen) + 0.5).to(DEVICE)
    want_residual = None if residual is None else residual.clone()
    got = fp8_fused.add_rms_norm_quantize(x, residual, weight, 1e-5, None, torch.float32)
    want = fp8_fused.add_rms_norm_quantize(
        x.materialize(), want_residual, weight, 1e-5, None, torch.float32
    )
    torch.testing.assert_close(got.scale, want.scale, atol=0, rtol=1e-5)
    torch.testing.assert_close(got.q, want.q, atol=1e-3, rtol=1e-5)
    if residual is not None:
        torch.testing.assert_close(residual, want_residual, atol=1e-6, rtol=1e-6)


@needs_triton_kernels
def test_silu_and_mul_quantize_reads_scaled_rows() -> None:
    gate_up = scaled_rows(7, 2 * 80, seed=3)  # gate and up columns scaled apart
    got = fp8_fused.silu_and_mul_quantize(gate_up, None, out_dtype=torch.float32)
    want = fp8_fused.silu_and_mul_quantize(gate_up.materialize(), None, torch.float32)
    torch.testing.assert_close(got.scale, want.scale, atol=0, rtol=1e-5)
    torch.testing.assert_close(got.q, want.q, atol=1e-3, rtol=1e-5)


@needs_triton_kernels
@pytest.mark.parametrize("programs_wanted", [1024, 1], ids=["one-head", "token"])
def test_rope_and_kv_write_reads_scaled_rows(
    monkeypatch: pytest.MonkeyPatch, programs_wanted: int
) -> None:
    monkeypatch.setattr(rope_kv_kernel, "PROGRAMS_WANTED", programs_wanted)
    num_heads, num_kv_heads, head_dim, num_tokens, block_size = 4, 2, 16, 6, 4
    config = make_model_config(
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, rope_theta=10000.0
    )
    rope = RotaryEmbedding(config, 64).to(DEVICE)
    qkv = scaled_rows(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, seed=4)
    gen = torch.Generator().manual_seed(5)
    positions = torch.randint(0, 64, (num_tokens,), generator=gen).to(DEVICE)
    slots = torch.randperm(4 * block_size, generator=gen)[:num_tokens].to(DEVICE)
    block_ids, offsets = slots // block_size, slots % block_size
    caches = [torch.zeros(4, 2, num_kv_heads, block_size, head_dim, device=DEVICE) for _ in "ab"]
    scales = (2.0, 0.5)
    want_q = rope_kv_kernel.rope_and_write_kv(
        qkv.materialize(), positions, rope.cos_sin, caches[0], block_ids, offsets, 4, scales
    )
    got_q = rope_kv_kernel.rope_and_write_kv(
        qkv, positions, rope.cos_sin, caches[1], block_ids, offsets, num_heads, scales
    )
    torch.testing.assert_close(got_q, want_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(caches[1], caches[0], atol=1e-5, rtol=1e-5)
    assert caches[1].abs().sum() > 0
