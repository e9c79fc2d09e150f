"""The chunked SiLU-and-mul + quantize kernel (engine/quant/fp8_silu_chunked.py) against the
whole-row one in fp8_fused.py: the same codes and scales for bf16 rows and ScaledRows, dynamic
and static scales, rows wider than a chunk and not a multiple of it; on a GPU, or on the CPU in
Triton's interpreter (tests/conftest.py sets it). And which rows take it."""

from __future__ import annotations

import pytest
import torch

from engine.quant import fp8_silu_chunked
from engine.quant.fp8_fused import silu_and_mul_quantize
from engine.quant.fp8_silu_chunked import ChunkedSilu
from engine.quant.fp8_types import ScaledRows
from tests.triton_device import DEVICE, needs_triton_kernels

pytest.importorskip("triton")


@needs_triton_kernels
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("scaled", [False, True], ids=["bf16", "scaled-rows"])
def test_chunked_equals_the_whole_row_kernel(scaled: bool, static: bool) -> None:
    gen = torch.Generator().manual_seed(int(scaled) + 2 * int(static) + 4)
    num_rows, half = 3, 200  # 200 columns: three chunks of 64, the last one partly masked
    gate_up = (torch.randn(num_rows, 2 * half, generator=gen) * 3).bfloat16()
    gate_up[1] = 0.0  # an all-zero row: the amax floor
    src: torch.Tensor | ScaledRows = gate_up.to(DEVICE)
    if scaled:
        row_scale = torch.rand(num_rows, 1, generator=gen) * 0.1 + 0.01
        col_scale = torch.rand(1, 2 * half, generator=gen) * 0.1 + 0.01
        src = ScaledRows(gate_up.to(DEVICE), row_scale.to(DEVICE), col_scale.to(DEVICE))
    static_scale = torch.tensor([[0.02]], device=DEVICE) if static else None
    want = silu_and_mul_quantize(src, static_scale, chunked=None)  # 3 rows: the whole-row one
    got = silu_and_mul_quantize(src, static_scale, chunked=ChunkedSilu(64, 4))
    assert torch.equal(got.scale, want.scale)
    assert torch.equal(got.q.float(), want.q.float())
    assert want.q.float().abs().max() > 0  # not all zero: the comparison means something


@needs_triton_kernels
def test_decode_batches_take_it_few_rows_and_bf16_rows_do_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ScaledRows of MIN_ROWS to MAX_ROWS rows take the chunked kernel; fewer rows (those
    fp8_dot_rows multiplies) and plain bf16 rows keep the whole-row one."""
    calls: list[tuple[int, bool]] = []
    launch = fp8_silu_chunked.launch

    def counting(src: torch.Tensor, row_scale, *rest) -> None:
        calls.append((src.shape[0], row_scale is not None))
        launch(src, row_scale, *rest)

    monkeypatch.setattr(fp8_silu_chunked, "launch", counting)

    def scaled(num_rows: int) -> ScaledRows:
        rows = torch.randn(num_rows, 64).bfloat16().to(DEVICE)
        ones = torch.ones(num_rows, 1, device=DEVICE), torch.ones(1, 64, device=DEVICE)
        return ScaledRows(rows, *ones)

    for num_rows in (1, fp8_silu_chunked.MIN_ROWS - 1, fp8_silu_chunked.MIN_ROWS):
        silu_and_mul_quantize(scaled(num_rows), None)
        silu_and_mul_quantize(torch.randn(num_rows, 64).bfloat16().to(DEVICE), None)
    assert calls == [(fp8_silu_chunked.MIN_ROWS, True)]
