"""FP8 math on CPU: weight quantization's error bound, exact fusing of per-tensor parts, per-row
input quantization, and Fp8Linear against its float32 reference, through a torch._scaled_mm
stand-in that asserts the CUDA kernel's argument contract (layouts, scale shapes, dtypes)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.quant import fp8
from engine.quant.fp8 import (
    Fp8Linear,
    Fp8Weight,
    check_fp8_device,
    dequantize_weight,
    fuse_weights,
    linear_state,
    make_linear,
    per_row_scale,
    quantize_rows_torch,
    quantize_weight,
)
from engine.quant.fp8_types import FP8_DTYPE, FP8_MAX

HALF_ULP = 2.0**-4  # e4m3 has 3 mantissa bits: rounding moves a normal value by <= 1/16 of it
SUBNORMAL_STEP = 2.0**-9  # the spacing below e4m3's smallest normal (2**-6), in scale units


def scaled_mm_cuda_contract(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    **_: object,
) -> torch.Tensor:
    """torch._scaled_mm with the checks CUDA makes (ATen's cuda Blas.cpp: row-major mat1,
    column-major mat2, dimensions divisible by 16, float32 scales either both single elements
    (tensor-wise) or [M, 1] and [1, N] contiguous (row-wise, bf16 out), bf16 bias), computed in
    float32 on any device."""
    assert a.dtype == FP8_DTYPE and b.dtype == FP8_DTYPE
    assert a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[0]
    (m, k), n = a.shape, b.shape[1]
    assert a.is_contiguous(), "mat1 must be row-major"
    assert b.t().is_contiguous(), "mat2 must be column-major"
    assert k % 16 == 0 and n % 16 == 0, "dimensions must be divisible by 16"
    assert scale_a.dtype == torch.float32 and scale_b.dtype == torch.float32
    tensorwise = scale_a.numel() == 1 and scale_b.numel() == 1
    rowwise = (
        tuple(scale_a.shape) == (m, 1)
        and scale_a.is_contiguous()
        and tuple(scale_b.shape) == (1, n)
        and scale_b.t().is_contiguous()
    )
    assert tensorwise or rowwise, f"scales {tuple(scale_a.shape)}, {tuple(scale_b.shape)}"
    assert tensorwise or out_dtype == torch.bfloat16, "row-wise scaling writes bf16"
    out = (a.float() * scale_a) @ (b.float() * scale_b)
    if bias is not None:
        assert bias.dtype == torch.bfloat16 and bias.numel() == n
        out = out + bias.float()
    return out.to(out_dtype or torch.float32)


@pytest.fixture
def cuda_contract(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm_cuda_contract)


def fp8_layer(
    weight: torch.Tensor, input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None
) -> Fp8Linear:
    """An Fp8Linear holding weight [N, K] quantized per channel."""
    out_features, in_features = weight.shape
    layer = Fp8Linear(in_features, out_features, bias is not None, input_scale is not None)
    state = linear_state("l", quantize_weight(weight), input_scale)
    state = {name.removeprefix("l."): t for name, t in state.items()}
    if bias is not None:
        state["bias"] = bias.bfloat16()
    layer.load_state_dict(state, strict=True, assign=True)
    return layer


def test_weight_round_trip_is_within_half_an_e4m3_step() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 64, generator=gen) * torch.logspace(-3, 1, 48).unsqueeze(1)
    weight[3, 5] = 0.0
    q = quantize_weight(weight)
    assert q.weight.dtype == FP8_DTYPE and q.scale.shape == (48, 1)
    assert q.weight.float().abs().amax(dim=1).eq(FP8_MAX).all()  # each row's amax -> 448
    error = (dequantize_weight(q) - weight).abs()
    bound = torch.maximum(weight.abs() * HALF_ULP, q.scale * SUBNORMAL_STEP / 2)
    assert (error <= bound * (1 + 1e-6)).all()
    assert dequantize_weight(q)[3, 5] == 0.0


def test_fusing_per_tensor_parts_is_exact() -> None:
    """Parts with different per-tensor scales keep them row by row: the fused weight
    dequantizes to exactly the concatenation of the dequantized parts."""
    gen = torch.Generator().manual_seed(1)
    parts = []
    for rows, scale in ((32, 0.01), (16, 0.003), (16, 0.2)):
        weight = torch.randn(rows, 64, generator=gen).mul(scale * 100).to(FP8_DTYPE)
        parts.append(Fp8Weight(weight, torch.tensor([scale])))  # one scale for the tensor
    per_channel = [Fp8Weight(p.weight, per_row_scale(p.scale, p.weight.shape[0])) for p in parts]
    fused = fuse_weights(per_channel)
    assert fused.weight.shape == (64, 64) and fused.scale.shape == (64, 1)
    want = torch.cat([p.weight.float() * p.scale for p in parts])
    assert torch.equal(dequantize_weight(fused), want)


def test_per_row_scale_shapes() -> None:
    assert per_row_scale(torch.tensor(0.5), 3).tolist() == [[0.5]] * 3
    assert per_row_scale(torch.tensor([[1.0], [2.0]]).bfloat16(), 2).dtype == torch.float32
    with pytest.raises(ValueError, match="fits neither"):
        per_row_scale(torch.ones(4), 3)


def test_input_rows_quantize_per_token_or_with_the_static_scale() -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 32, generator=gen).bfloat16()
    x[2] = 0.0
    q, scale = quantize_rows_torch(x, None)
    assert q.shape == (5, 32) and scale.shape == (5, 1) and scale.dtype == torch.float32
    amax = x.float().abs().amax(dim=1, keepdim=True)
    torch.testing.assert_close(scale[[0, 1, 3, 4]], amax[[0, 1, 3, 4]] / FP8_MAX)
    assert q.float()[2].eq(0).all() and torch.isfinite(scale).all()
    q, scale = quantize_rows_torch(x * 100, torch.tensor([[0.05]]))
    assert scale.shape == (5, 1) and scale.eq(0.05).all() and scale.is_contiguous()
    assert q.float().abs().max() == FP8_MAX  # clamped, not inf or nan


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_fp8_linear_matches_its_reference(cuda_contract: None, static: bool, with_bias: bool):
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(48, 64, generator=gen) * 0.05
    bias = torch.randn(48, generator=gen) if with_bias else None
    x = torch.randn(2, 7, 64, generator=gen).bfloat16()
    layer = fp8_layer(weight, torch.tensor(0.01) if static else None, bias)
    out = layer(x)
    assert out.shape == (2, 7, 48) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out, layer.forward_reference(x), rtol=1e-2, atol=1e-2)
    exact = x.float() @ weight.t() + (0 if bias is None else bias)
    relative = (out.float() - exact).norm() / exact.norm()
    assert relative < 0.05, relative  # fp8 weights and inputs: a few percent


def test_a_single_row_still_runs_rowwise(cuda_contract: None) -> None:
    """Batch-1 decode: scale_a is [1, 1] (one element) but scale_b is [1, N]: row-wise."""
    layer = fp8_layer(torch.randn(32, 16))
    x = torch.randn(1, 16).bfloat16()
    torch.testing.assert_close(layer(x), layer.forward_reference(x), rtol=1e-2, atol=1e-2)


def test_cpu_scaled_mm_has_the_same_scale_semantics() -> None:
    """Where torch has a CPU _scaled_mm, it agrees with the stand-in (scales multiply)."""
    gen = torch.Generator().manual_seed(4)
    a = torch.randn(8, 32, generator=gen).to(FP8_DTYPE)
    b = torch.randn(16, 32, generator=gen).to(FP8_DTYPE).t()
    scale_a, scale_b = torch.rand(8, 1, generator=gen), torch.rand(1, 16, generator=gen)
    try:
        got = torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError) as err:
        pytest.skip(f"no CPU torch._scaled_mm here: {err}")
    want = scaled_mm_cuda_contract(a, b, scale_a, scale_b, out_dtype=torch.bfloat16)
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


def test_fp8_is_refused_off_cuda() -> None:
    with pytest.raises(ValueError, match=r"compute capability >= 8.9\); this engine runs on cpu"):
        check_fp8_device(torch.device("cpu"))


def test_make_linear_and_shape_rules() -> None:
    assert type(make_linear(32, 16, False, None)) is nn.Linear
    with pytest.raises(ValueError, match="divisible by 16"):
        Fp8Linear(24, 16, bias=False, static_input_scale=False)
    with torch.device("meta"):
        layer = Fp8Linear(32, 16, bias=True, static_input_scale=True)
    assert layer.weight.dtype == FP8_DTYPE and layer.weight_scale.shape == (1, 16)
    assert layer.input_scale.shape == (1, 1) and layer.bias.dtype == torch.bfloat16
    assert fp8.SCALE_NAMES == ("weight_scale", "input_scale")
