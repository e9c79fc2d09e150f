"""FlashInfer's fused elementwise kernels (engine/models/fused_ops.py) against the torch ops they
replace, on the shapes the model feeds them (q/k as strided column slices of the qkv output)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.config import ModelConfig
from engine.models import fused_ops
from engine.models.llama import RMSNorm
from engine.models.rope import RotaryEmbedding

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


def test_rope_on_strided_qkv_slices() -> None:
    config = ModelConfig(
        model_id="rope-test",
        vocab_size=512,
        hidden_size=512,
        intermediate_size=1024,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=128,
        rope_theta=500000.0,
    )
    rope = RotaryEmbedding(config, 4096).cuda()
    q_size, kv_size = 4 * 128, 2 * 128
    gen = torch.Generator("cuda").manual_seed(1)
    qkv = torch.randn(50, q_size + 2 * kv_size, device="cuda", generator=gen).bfloat16()
    positions = torch.randint(0, 4096, (50,), device="cuda", generator=gen)
    q, k, _ = qkv.clone().split([q_size, kv_size, kv_size], dim=-1)
    want_q, want_k = rope(positions, q.view(50, 4, 128), k.view(50, 2, 128))
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    v_before = v.clone()
    fused_ops.rope_(positions, q, k, 128, rope.cos_sin)
    torch.testing.assert_close(q.view(50, 4, 128), want_q, **TOL)
    torch.testing.assert_close(k.view(50, 2, 128), want_k, **TOL)
    assert torch.equal(v, v_before)  # the V columns are untouched
