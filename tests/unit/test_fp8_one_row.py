"""engine/quant/fp8_one_row.py's GEMV that quantizes its own input against the engine's other
path (quantize_rows of the made row, then the product of the dequantized operands): on a GPU,
or on the CPU in Triton's interpreter (tests/conftest.py sets it)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.quant.fp8 import quantize_rows_torch, quantize_weight
from engine.quant.fp8_one_row import row_dot
from tests.triton_device import DEVICE, needs_triton_kernels

pytest.importorskip("triton")

pytestmark = needs_triton_kernels
TILE = (16, 64, 4, 2)  # n and k below are neither a multiple of it: the masks are exercised
EPS = 1e-5


def engine_path(row: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The engine's math: the made row in bf16, quantized per row, times the dequantized
    weight, in float32."""
    q, row_scale = quantize_rows_torch(row.bfloat16(), None)
    return (q.float() * row_scale) @ (weight.float() * scale.reshape(-1, 1)).t()


def operands(num_rows: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    weight = quantize_weight(torch.randn(n, k, generator=gen) * 0.02)
    x = torch.randn(num_rows, k, generator=gen) * torch.rand(num_rows, 1, generator=gen) * 4
    norm = torch.rand(k, generator=gen) + 0.5
    return weight.weight, weight.scale.float(), x.bfloat16(), norm.bfloat16()


def run(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, n: int, **kw) -> torch.Tensor:
    out = kw.pop("out", torch.zeros(x.shape[0], n, dtype=torch.bfloat16))
    out = out.to(DEVICE)
    row_dot(x.to(DEVICE), weight.to(DEVICE), scale.to(DEVICE), out, TILE, **kw)
    return out.float().cpu()


def close(got: torch.Tensor, want: torch.Tensor, rtol: float) -> None:
    torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * float(want.abs().max()))


@pytest.mark.parametrize("seed", [1, 2])
def test_a_plain_row_is_quantized_as_the_engine_does(seed: int) -> None:
    n, k = 40, 96
    weight, scale, x, _ = operands(1, n, k, seed=seed)
    # the same codes as the engine's: only the bf16 rounding of the output is left
    close(run(x, weight, scale, n), engine_path(x.float(), weight, scale), 8e-3)


def test_norm_then_silu_pairs_gate_and_up_channels() -> None:
    n, k = 24, 96
    weight, scale, x, norm = operands(1, 2 * n, k, seed=2)
    made = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + EPS) * norm.float()
    product = engine_path(made, weight, scale)
    want = F.silu(product[:, :n]) * product[:, n:]
    got = run(x, weight, scale, n, norm=norm.to(DEVICE), eps=EPS, silu=True)
    assert got.shape == (1, n)
    # its row scale comes from amax(x * norm) / rms: a code may round the other way
    close(got, want, 3e-2)
    assert (got - want).abs().max() < 0.1 * want.abs().max(), "not merely the right size"


def test_add_goes_into_the_residual_in_place() -> None:
    n, k = 40, 200  # K over two of the interpreter's prologue steps
    weight, scale, x, _ = operands(1, n, k, seed=3)
    residual = torch.randn(1, n).bfloat16()
    want = residual.float() + engine_path(x.float(), weight, scale)
    close(run(x, weight, scale, n, out=residual.clone(), add=True), want, 8e-3)


def test_it_refuses_what_it_would_misread() -> None:
    weight, scale, x, _ = operands(1, 8, 32, seed=4)
    out = torch.zeros(1, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"contiguous \[16, 32\]"):
        row_dot(x, weight, scale, out, TILE, silu=True)
    with pytest.raises(ValueError, match="one scale per output channel"):
        row_dot(x, weight, scale[:4], out, TILE)
    with pytest.raises(ValueError, match="one row each"):
        row_dot(torch.zeros(2, 32), weight, scale, torch.zeros(2, 8), TILE)


def test_the_codes_are_e4m3s_nearest_from_subnormals_to_448() -> None:
    """An identity weight hands the codes back: the row's amax is 448 (scale 1), the rest
    spread over e4m3's whole range, subnormals (below 2^-6) and halfway cases included; each
    must be torch's round-to-nearest-even cast."""
    k = 256
    gen = torch.Generator().manual_seed(5)
    magnitudes = torch.logspace(-12, 8.8, k - 1, base=2.0)  # 2^-12 .. ~445
    ties = torch.tensor([7.5, 9.5, 13.0, 0.5 + 2**-10]) * 2.0**-9  # halfway between codes
    magnitudes[: len(ties)] = ties
    signs = torch.randint(0, 2, (k - 1,), generator=gen) * 2 - 1
    x = torch.cat([torch.tensor([448.0]), magnitudes * signs]).bfloat16().reshape(1, k)
    weight = torch.eye(k).to(torch.float8_e4m3fn)
    got = run(x, weight, torch.ones(k), k)
    want = x.float().to(torch.float8_e4m3fn).float()
    assert (want.abs() < 2**-6).sum() > 20, "subnormals covered"
    assert torch.equal(got, want)
