"""The GPU path's fused kernels against the torch ops they replace: FlashInfer's norms and
activation (engine/models/fused_ops.py), the Triton RoPE + paged KV write
(engine/attention/rope_kv_kernel.py) into bf16 and fp8 caches at both head blockings, and the
FP8 input quantization fused into add + RMSNorm and SiLU-and-mul (engine/quant/fp8_fused.py)
against the unfused chain."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.attention import rope_kv_kernel
from engine.attention.rope_kv_kernel import rope_and_write_kv
from engine.models import fused_ops
from engine.models.llama import RMSNorm
from engine.models.rope import RotaryEmbedding
from engine.quant.fp8_fused import (
    add_rms_norm_quantize,
    quantize_rows_cuda,
    silu_and_mul_quantize,
)
from engine.quant.fp8_types import QuantizedRows
from tests.factories import make_model_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

TOL = dict(atol=2e-2, rtol=2e-2)


@pytest.fixture(autouse=True)
def _needs_flashinfer() -> None:
    pytest.importorskip("flashinfer")


def test_norms_and_activation() -> None:
    gen = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(37, 256, device="cuda", generator=gen).bfloat16()
    residual = torch.randn(37, 256, device="cuda", generator=gen).bfloat16()
    norm = RMSNorm(256, 1e-5).cuda().bfloat16()
    norm.weight.data.uniform_(0.5, 1.5, generator=gen)
    torch.testing.assert_close(fused_ops.rms_norm(x, norm.weight, norm.eps), norm(x), **TOL)
    want_residual = residual + x
    want = norm(want_residual)
    fused_ops.add_rms_norm_(x, residual, norm.weight, norm.eps)
    torch.testing.assert_close(residual, want_residual, **TOL)
    torch.testing.assert_close(x, want, **TOL)
    gate_up = torch.randn(37, 2 * 512, device="cuda", generator=gen).bfloat16()
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(fused_ops.silu_and_mul(gate_up), F.silu(gate) * up, **TOL)


@pytest.mark.parametrize("programs_wanted", [1024, 1], ids=["head", "token"])
@pytest.mark.parametrize(
    "cache_dtype, kv_scales",
    [
        (torch.bfloat16, (1.0, 1.0)),
        (torch.float8_e4m3fn, (1.0, 1.0)),
        (torch.float8_e4m3fn, (2.0, 0.5)),
    ],
)
def test_rope_and_kv_write_kernel(
    cache_dtype: torch.dtype,
    kv_scales: tuple[float, float],
    programs_wanted: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One Triton kernel: q rotated in place, rotated k and plain v in the strided layer view
    (an fp8 cache stores K / k_scale and V / v_scale); one program per head or per token."""
    monkeypatch.setattr(rope_kv_kernel, "PROGRAMS_WANTED", programs_wanted)
    config = make_model_config(
        hidden_size=512, intermediate_size=1024, num_layers=1, head_dim=128, rope_theta=500000.0
    )
    rope = RotaryEmbedding(config, 4096).cuda()
    num_tokens, q_size, kv_size = 50, 4 * 128, 2 * 128
    gen = torch.Generator("cuda").manual_seed(1)
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, device="cuda", generator=gen).bfloat16()
    positions = torch.randint(0, 4096, (num_tokens,), device="cuda", generator=gen)
    slots = torch.randperm(20 * 16, device="cuda", generator=gen)[:num_tokens]
    block_ids, offsets = slots // 16, slots % 16
    q, k, v = qkv.clone().split([q_size, kv_size, kv_size], dim=-1)
    want_q, want_k = rope(positions, q.view(-1, 4, 128).float(), k.view(-1, 2, 128).float())
    cache = torch.zeros(20, 3, 2, 2, 16, 128, device="cuda", dtype=cache_dtype)  # 3 layers
    got_q = rope_and_write_kv(
        qkv, positions, rope.cos_sin, cache[:, 1], block_ids, offsets, 4, kv_scales
    )
    assert got_q.data_ptr() == qkv.data_ptr()  # q rotated in place
    torch.testing.assert_close(got_q.float(), want_q, **TOL)
    layer = cache[:, 1].float()
    tol = TOL if cache_dtype == torch.bfloat16 else dict(atol=0.07, rtol=0.07)  # e4m3: 3 bits
    k_scale, v_scale = kv_scales
    torch.testing.assert_close(layer[block_ids, 0, :, offsets], want_k / k_scale, **tol)
    want_v = (v.view(-1, 2, 128).float() / v_scale).to(cache_dtype).float()
    assert torch.equal(layer[block_ids, 1, :, offsets], want_v)
    written = torch.zeros(20, 16, dtype=torch.bool, device="cuda")
    written[block_ids, offsets] = True
    assert not cache[:, [0, 2]].float().any()  # other layers untouched
    assert not layer.permute(0, 3, 1, 2, 4)[~written].any()  # no other slot written


def assert_same_quantization(got: QuantizedRows, want: QuantizedRows) -> None:
    """Two quantizations of (nearly) the same rows: scales to float rounding, codes at most one
    e4m3 step apart and almost all equal."""
    torch.testing.assert_close(got.scale, want.scale, rtol=1e-2, atol=0.0)
    got_x, want_x = got.q.float() * got.scale, want.q.float() * want.scale
    assert (got_x - want_x).abs().le(want_x.abs() / 8 + 1e-3 * want.scale).all()
    assert (got.q.float() == want.q.float()).float().mean() >= 0.99


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("add", [True, False], ids=["add", "first-layer"])
@pytest.mark.parametrize("num_rows, width", [(1, 4096), (300, 4096), (37, 576)])
def test_norm_quantize_matches_the_unfused_chain(
    num_rows: int, width: int, add: bool, static: bool
) -> None:
    gen = torch.Generator("cuda").manual_seed(2)
    x = torch.randn(num_rows, width, device="cuda", generator=gen).bfloat16()
    residual = torch.randn(num_rows, width, device="cuda", generator=gen).bfloat16()
    weight = torch.rand(width, device="cuda", generator=gen).bfloat16() + 0.5
    static_scale = torch.tensor([[0.01]], device="cuda") if static else None
    want_residual, normed = residual.clone(), x.clone()
    if add:
        fused_ops.add_rms_norm_(normed, want_residual, weight, 1e-5)
    else:
        normed = fused_ops.rms_norm(x, weight, 1e-5)
    want = quantize_rows_cuda(normed, static_scale)
    got_residual, x_before = residual.clone(), x.clone()
    got = add_rms_norm_quantize(x, got_residual if add else None, weight, 1e-5, static_scale)
    assert got.q.dtype == torch.float8_e4m3fn and got.q.shape == (num_rows, width)
    assert torch.equal(x, x_before)
    assert torch.equal(got_residual, want_residual)  # residual + x, rounded the same way
    assert_same_quantization(got, want)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("num_rows, inter", [(1, 14336), (300, 14336), (37, 1536)])
def test_silu_quantize_matches_the_unfused_chain(num_rows: int, inter: int, static: bool) -> None:
    gen = torch.Generator("cuda").manual_seed(3)
    gate_up = torch.randn(num_rows, 2 * inter, device="cuda", generator=gen).bfloat16() * 2
    static_scale = torch.tensor([[0.02]], device="cuda") if static else None
    want = quantize_rows_cuda(fused_ops.silu_and_mul(gate_up), static_scale)
    got = silu_and_mul_quantize(gate_up, static_scale)
    assert got.q.dtype == torch.float8_e4m3fn and got.q.shape == (num_rows, inter)
    assert_same_quantization(got, want)
