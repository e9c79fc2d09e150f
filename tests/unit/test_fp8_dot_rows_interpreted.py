"""fp8_dot_rows (few quantized rows times an e4m3 weight on tensor cores) against the float32
product of the dequantized operands, on one fixed tile: on a GPU, or on the CPU in Triton's
interpreter (tests/conftest.py sets it)."""

from __future__ import annotations

import pytest
import torch

from engine.quant import fp8_dot_rows as dot_rows
from engine.quant.fp8 import quantize_rows_torch, quantize_weight
from engine.quant.fp8_dot_rows import MAX_ROWS, fp8_dot_rows
from tests.triton_device import DEVICE, needs_triton_kernels

pytest.importorskip("triton")

pytestmark = needs_triton_kernels


@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("num_rows", [1, 3, MAX_ROWS])
def test_few_rows_match_the_dequantized_product(num_rows: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(num_rows)
    n, k = 40, 96  # neither a multiple of the tile (16 x 64): the masks are exercised
    weight = quantize_weight(torch.randn(n, k, generator=gen) * 0.02)
    x = torch.randn(num_rows, k, generator=gen) * torch.rand(num_rows, 1, generator=gen) * 4
    q, scale = quantize_rows_torch(x.bfloat16(), None)
    bias = torch.randn(n, generator=gen).bfloat16() if with_bias else None
    w_scale = weight.scale.reshape(1, -1).float()
    want = (q.float() * scale) @ (weight.weight.float() * w_scale.t()).t()
    if bias is not None:
        want += bias.float()
    got = fp8_dot_rows(
        q.to(DEVICE), scale.to(DEVICE), weight.weight.to(DEVICE), w_scale.to(DEVICE),
        None if bias is None else bias.to(DEVICE), tile=(16, 64),
    )  # fmt: skip
    assert got.shape == (num_rows, n) and got.dtype == torch.bfloat16
    # the e4m3 products are exact in float32; what is left is the bf16 rounding of the output
    torch.testing.assert_close(got.float().cpu(), want, rtol=8e-3, atol=8e-3 * want.abs().max())


def test_more_rows_than_the_kernel_takes_are_refused() -> None:
    q = torch.zeros(MAX_ROWS + 1, 16, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=f"at most {MAX_ROWS} rows"):
        fp8_dot_rows(q, torch.ones(MAX_ROWS + 1, 1), q[:16], torch.ones(1, 16), None)


def test_fixed_tiles_by_width() -> None:
    assert dot_rows.tile_for(28672) == dot_rows.WIDE_TILE  # the 8B shape's gate_up
    assert dot_rows.tile_for(6144) == dot_rows.tile_for(4096) == dot_rows.NARROW_TILE
