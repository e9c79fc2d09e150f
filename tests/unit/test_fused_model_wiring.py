"""The model's fused-ops path (residual carried next to the hidden states, in-place add+norm)
computes the same function as the plain path. FlashInfer's kernels are replaced by torch
stand-ins with the same in-place contracts, so this runs on CPU and checks only the wiring."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend
from engine.models import fused_gemv, fused_ops
from engine.models.llama import LlamaForCausalLM
from engine.quant import fp8_one_row
from engine.quant.config import Fp8Config
from engine.quant.fp8 import Fp8Linear, dequantize_weight, quantize_weight
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


def random_model(seed: int) -> LlamaForCausalLM:
    config = make_model_config(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3, head_dim=8
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config, 128)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.3)
    return model


def test_fused_path_computes_the_same_function(fake_kernels: None) -> None:
    model = random_model(0)
    ids = torch.randint(0, 64, (11,))
    positions = torch.randint(0, 128, (11,))
    with torch.no_grad():
        plain = model(ids, positions, EchoAttention())
        model.use_fused_ops(True)
        assert all(layer.mlp.fused for layer in model.layers)
        fused = model(ids, positions, EchoAttention())
        model.use_fused_ops(False)
        again = model(ids, positions, EchoAttention())
    torch.testing.assert_close(fused, plain, atol=1e-5, rtol=1e-5)
    assert torch.equal(again, plain)
    assert not torch.equal(plain, model.embed_tokens(ids))  # the layers did something


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="runs the Triton kernels interpreted on CPU"
)
@pytest.mark.parametrize("gate_up_on_blas", [False, True], ids=["fused-gate-up", "blas-gate-up"])
def test_one_row_steps_on_the_fused_gemvs_compute_the_same_function(
    fake_kernels: None,
    gemv_launches: list[int],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    gate_up_on_blas: bool,
) -> None:
    """engine/models/fused_gemv.py's path (each layer as four GEMVs, or three and gate_up on
    BLAS, the residual stream changed in place) against the plain path, for a one-token step;
    the kernels run in Triton's interpreter, in float32, so the wiring must match to float
    rounding."""
    pytest.importorskip("triton")
    monkeypatch.setattr(fused_gemv, "gate_up_on_blas", lambda: gate_up_on_blas)
    model = random_model(1)
    config, launches = model.config, gemv_launches
    monkeypatch.setattr(  # CPU tensors: the interpreter stands in for the GPU
        fused_gemv, "takes", lambda x, plain: x.shape[0] == 1 and bool(plain)
    )
    ids, positions = torch.tensor([5]), torch.tensor([17])
    with torch.no_grad():
        plain = model(ids, positions, EchoAttention())
        model.use_fused_ops(True)
        fused = model(ids, positions, EchoAttention())
        per_layer = 3 if gate_up_on_blas else 4
        assert len(launches) == per_layer * config.num_layers
        model(torch.tensor([5, 6]), torch.tensor([17, 18]), EchoAttention())  # two rows: not
        assert len(launches) == per_layer * config.num_layers
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


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="runs the Triton kernels interpreted on CPU"
)
def test_one_row_steps_on_the_fp8_row_kernels_compute_the_dequantized_model(
    fake_kernels: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """quant/fp8_one_row.py's path (each layer as four GEMVs that quantize their input per row)
    against the plain path over the same weights dequantized: the same function up to the
    activations' e4m3 rounding."""
    reference = random_model(3)
    fp8 = LlamaForCausalLM(reference.config, 128, Fp8Config("online", True, False))
    fp8.load_state_dict(reference.state_dict(), strict=False)  # embeddings, norms, head
    launches: list[int] = []
    launch = fp8_one_row.row_dot
    monkeypatch.setattr(
        fp8_one_row, "row_dot", lambda *a, **k: launches.append(1) or launch(*a, **k)
    )
    with torch.no_grad():
        for plain_layer, fp8_layer in zip(reference.layers, fp8.layers, strict=True):
            pairs = zip(plain_layer.projections(), fp8_layer.projections(), strict=True)
            for plain, quantized in pairs:
                weight = quantize_weight(plain.weight.float())
                quantized.weight.copy_(weight.weight)
                quantized.weight_scale.copy_(weight.scale.reshape(1, -1))
                plain.weight.copy_(dequantize_weight(weight))
        assert len(fp8.fp8_row_projections()) == 4 * fp8.config.num_layers
        monkeypatch.setattr(  # CPU tensors: the interpreter stands in for the GPU
            fp8_one_row, "takes", lambda x, projections: x.shape[0] == 1 and bool(projections)
        )
        ids, positions = torch.tensor([7]), torch.tensor([21])
        want = reference(ids, positions, EchoAttention())
        fp8.use_fused_ops(True)
        got = fp8(ids, positions, EchoAttention())
    assert len(launches) == 4 * fp8.config.num_layers
    scale = float(want.abs().max())
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.05 * scale)
    assert (got - want).abs().max() > 0, "the activations were quantized"


def test_which_fp8_models_take_the_row_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    dynamic = Fp8Linear(32, 16, bias=False, static_input_scale=False)
    assert fp8_one_row.row_linear(dynamic)
    assert not fp8_one_row.row_linear(Fp8Linear(32, 16, bias=False, static_input_scale=True))
    assert not fp8_one_row.row_linear(Fp8Linear(32, 16, bias=True, static_input_scale=False))
    assert not fp8_one_row.row_linear(torch.nn.Linear(32, 16, bias=False))
    static = LlamaForCausalLM(make_model_config(), 128, Fp8Config("compressed-tensors", True, True))
    assert static.fp8_row_projections() == []
    row = torch.zeros(1, 32, dtype=torch.bfloat16)
    for value in ("0", "1"):
        monkeypatch.setenv(fp8_one_row.ENV, value)
        fp8_one_row.enabled.cache_clear()
        assert fp8_one_row.enabled() is (value == "1")
        assert not fp8_one_row.takes(row, [dynamic]), "a CPU row"
    monkeypatch.delenv(fp8_one_row.ENV)
    fp8_one_row.enabled.cache_clear()
    assert not fp8_one_row.enabled(), "off by default"
