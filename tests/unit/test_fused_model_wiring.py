"""The model's fused-ops path (residual carried next to the hidden states, in-place add+norm)
and its one-row fused GEMV path compute the same function as the plain path, with and without
Qwen3's q/k norms, and with a sparse MoE layer between dense ones. FlashInfer's kernels are
replaced by torch stand-ins with the same in-place contracts, so this runs on CPU and checks only
the wiring."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend
from engine.models import fused_gemv, fused_ops
from engine.models.llama import LlamaForCausalLM
from engine.quant.config import Fp8Config
from tests.factories import make_model_config
from tests.unit.test_fused_gemv import gemv_launches  # noqa: F401 (fixture)


class EchoAttention(AttentionBackend):
    """Stand-in attention: returns q mixed with the mean of k and v (enough to reach q/k/v)."""

    def __init__(self) -> None:  # no cache
        self.num_heads, self.num_kv_heads, self.head_dim = 4, 2, 8

    def plan(self, metadata) -> None:  # pragma: no cover - unused
        pass

    def forward(self, layer, q, k, v):
        kv = (k.mean(1, keepdim=True) + v.mean(1, keepdim=True)).expand(-1, q.shape[1], -1)
        return q + kv


def _norm(x, weight, eps):
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def fake_add_rms_norm_(x, residual, weight, eps):
    residual.add_(x)
    x.copy_(_norm(residual, weight, eps))


def fake_silu_and_mul(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.fixture
def fake_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fused_ops, "rms_norm", _norm)
    monkeypatch.setattr(fused_ops, "add_rms_norm_", fake_add_rms_norm_)
    monkeypatch.setattr(fused_ops, "silu_and_mul", fake_silu_and_mul)


MOE = dict(  # layer 1 of 3 sparse: 4 experts 16 wide, top-2
    architecture="Qwen3MoeForCausalLM",
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    norm_topk_prob=True,
    moe_layers=(1,),
)


def random_model(seed: int, qk_norm: bool = False, moe: bool = False) -> LlamaForCausalLM:
    config = make_model_config(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3, head_dim=8
    )
    config = dataclasses.replace(config, qk_norm=qk_norm, **(MOE if moe else {}))
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config, 128)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.3)
    return model


@pytest.mark.parametrize(
    "qk_norm, moe", [(False, False), (True, False), (True, True)], ids=["llama", "qk-norm", "moe"]
)
def test_fused_path_computes_the_same_function(
    fake_kernels: None, qk_norm: bool, moe: bool
) -> None:
    model = random_model(0, qk_norm, moe)
    ids = torch.randint(0, 64, (11,))
    positions = torch.randint(0, 128, (11,))
    with torch.no_grad():
        plain = model(ids, positions, EchoAttention())
        model.use_fused_ops(True)
        assert all(getattr(layer.mlp, "fused", True) for layer in model.layers)
        fused = model(ids, positions, EchoAttention())
        model.use_fused_ops(False)
        again = model(ids, positions, EchoAttention())
    torch.testing.assert_close(fused, plain, atol=1e-5, rtol=1e-5)
    assert torch.equal(again, plain)
    assert not torch.equal(plain, model.embed_tokens(ids))  # the layers did something


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="runs the Triton kernels interpreted on CPU"
)
@pytest.mark.parametrize(
    "qk_norm, moe", [(False, False), (True, False), (True, True)], ids=["llama", "qk-norm", "moe"]
)
def test_one_row_steps_on_the_fused_gemvs_compute_the_same_function(
    fake_kernels: None,
    gemv_launches: list[int],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    qk_norm: bool,
    moe: bool,
) -> None:
    """engine/models/fused_gemv.py's path (each layer as four GEMVs, the residual stream
    changed in place) against the plain path, for a one-token step; the kernels run in
    Triton's interpreter, in float32, so the wiring must match to float rounding. A MoE layer
    runs its attention's two GEMVs, then its SparseMoe (the torch reference on CPU)."""
    pytest.importorskip("triton")
    model = random_model(1, qk_norm, moe)
    config, launches = model.config, gemv_launches
    monkeypatch.setattr(  # CPU tensors: the interpreter stands in for the GPU
        fused_gemv, "takes", lambda x, plain: x.shape[0] == 1 and bool(plain)
    )
    ids, positions = torch.tensor([5]), torch.tensor([17])
    with torch.no_grad():
        plain = model(ids, positions, EchoAttention())
        model.use_fused_ops(True)
        fused = model(ids, positions, EchoAttention())
        per_step = 4 * config.num_layers - 2 * len(config.moe_layers)
        assert len(launches) == per_step
        model(torch.tensor([5, 6]), torch.tensor([17, 18]), EchoAttention())  # two rows: not
        assert len(launches) == per_step
    torch.testing.assert_close(fused, plain, atol=1e-5, rtol=1e-5)
    assert not torch.equal(plain, model.embed_tokens(ids))


@pytest.mark.parametrize(
    "overrides, quant",
    [
        ({"attention_bias": True}, None),  # Qwen2's q/k/v bias
        ({"o_proj_bias": True}, None),
        ({}, Fp8Config("online", True, False)),
    ],
    ids=["qkv-bias", "o-bias", "fp8"],
)
def test_models_with_biased_or_quantized_projections_keep_the_plain_kernels(
    overrides: dict, quant: Fp8Config | None
) -> None:
    config = make_model_config(hidden_size=32, intermediate_size=48, head_dim=8, **overrides)
    model = LlamaForCausalLM(config, 128, quant)
    assert model.plain_projections(torch.float32) == []
    model.use_fused_ops(True)
    assert model.fused_gemv_rows() == []
    plain = LlamaForCausalLM(make_model_config(hidden_size=32, intermediate_size=48), 128)
    assert len(plain.plain_projections(torch.float32)) == 4 * plain.config.num_layers
    plain.use_fused_ops(True)
    assert plain.fused_gemv_rows() == []  # a CPU model: the GEMVs are CUDA kernels


def test_the_q_and_k_norms_count_on_every_path(fake_kernels: None) -> None:
    """Scaling the k_norm weights changes the output on the plain and the fused path: neither
    skips the norm (fused == plain alone would not show that)."""
    model = random_model(2, qk_norm=True)
    ids, positions = torch.randint(0, 64, (7,)), torch.arange(7)
    with torch.no_grad():
        before = [model(ids, positions, EchoAttention())]
        model.use_fused_ops(True)
        before.append(model(ids, positions, EchoAttention()))
        for layer in model.layers:
            layer.self_attn.k_norm.weight.mul_(3.0)
        after = [model(ids, positions, EchoAttention())]
        model.use_fused_ops(False)
        after.insert(0, model(ids, positions, EchoAttention()))
    for old, new in zip(before, after, strict=True):
        assert not torch.allclose(old, new, atol=1e-3)
