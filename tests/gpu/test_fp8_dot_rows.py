"""Few quantized rows on the GPU: Fp8Linear hands QuantizedRows of up to GEMV_MAX_ROWS rows to
fp8_dot_rows (e4m3 codes on tensor cores, a fixed tile by weight width) and the result equals
the float32 product of the dequantized operands up to bf16 rounding, eager and replayed from a
CUDA graph, with the wide tile and with the autotuner's picks too, and with K split
(KVRELAY_FP8_SPLIT_K); a bf16 input of as many rows still takes the GEMV."""

from __future__ import annotations

import pytest
import torch

from engine.quant import fp8, fp8_dot_rows, fp8_one_row, split_k
from engine.quant.fp8 import takes_quantized
from engine.quant.fp8_fused import quantize_rows_cuda
from engine.quant.fp8_gemv import GEMV_MAX_ROWS
from engine.quant.fp8_types import QuantizedRows
from tests.gpu.test_fp8_weights import CUDA, layer_on_gpu, pytestmark  # noqa: F401 (GPU, >= 8.9)
from tests.unit.test_split_k import split_on  # noqa: F401 (a fixture)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("num_rows", [1, 5, GEMV_MAX_ROWS])
@pytest.mark.parametrize(
    "in_features, out_features, with_bias",
    [(4096, 6144, False), (14336, 4096, False), (576, 960, True)],
)
def test_quantized_few_rows_take_fp8_dot_rows(
    monkeypatch: pytest.MonkeyPatch,
    num_rows: int,
    in_features: int,
    out_features: int,
    with_bias: bool,
    static: bool,
) -> None:
    gen = torch.Generator(CUDA).manual_seed(num_rows)
    weight = torch.randn(out_features, in_features, device=CUDA, generator=gen) * 0.02
    bias = torch.randn(out_features, device=CUDA, generator=gen) if with_bias else None
    layer = layer_on_gpu(weight, static, bias)
    x = torch.randn(num_rows, in_features, device=CUDA, generator=gen).bfloat16() * 0.5
    rows = QuantizedRows(*quantize_rows_cuda(x, layer.input_scale))
    assert takes_quantized(layer, x)
    calls = []
    dot_rows = fp8.fp8_dot_rows
    monkeypatch.setattr(fp8, "fp8_dot_rows", lambda *a, **k: calls.append(1) or dot_rows(*a, **k))
    out = layer(rows).float()
    assert calls, "few quantized rows did not reach fp8_dot_rows"
    want = layer.forward_reference(rows).float()
    error = float((out - want).abs().max() / want.abs().max())
    assert error < 1e-2  # exact e4m3 products; bf16 output rounding
    calls.clear()
    layer(x)  # bf16 rows: the GEMV, not fp8_dot_rows
    assert not calls


def test_fp8_dot_rows_replays_in_a_cuda_graph() -> None:
    gen = torch.Generator(CUDA).manual_seed(7)
    layer = layer_on_gpu(torch.randn(1024, 512, device=CUDA, generator=gen) * 0.05, False, None)
    x = torch.randn(3, 512, device=CUDA, generator=gen).bfloat16()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        layer(QuantizedRows(*quantize_rows_cuda(x, None)))  # compile and autotune outside
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(QuantizedRows(*quantize_rows_cuda(x, None)))
    for _ in range(3):
        x.copy_(torch.randn(3, 512, device=CUDA, generator=gen).bfloat16())
        graph.replay()
        torch.testing.assert_close(out, layer(QuantizedRows(*quantize_rows_cuda(x, None))))


@pytest.mark.parametrize("tiles", ["fixed", "tuned"])
def test_the_wide_tile_and_the_autotuners_pick_are_right(
    monkeypatch: pytest.MonkeyPatch, tiles: str
) -> None:
    """A weight wide enough for WIDE_TILE (and the autotuner's pick, KVRELAY_FP8_DOT_TILES=
    tuned) against the dequantized product."""
    monkeypatch.setenv(fp8_dot_rows.TILES_ENV, tiles)
    fp8_dot_rows.tuned.cache_clear()
    try:
        gen = torch.Generator(CUDA).manual_seed(11)
        channels = fp8_dot_rows.WIDE_CHANNELS + 96  # a partial last tile
        weight = torch.randn(channels, 512, device=CUDA, generator=gen) * 0.02
        layer = layer_on_gpu(weight, False, None)
        x = torch.randn(2, 512, device=CUDA, generator=gen).bfloat16()
        rows = QuantizedRows(*quantize_rows_cuda(x, None))
        out = layer(rows).float()
        want = layer.forward_reference(rows).float()
        assert float((out - want).abs().max() / want.abs().max()) < 1e-2
    finally:
        monkeypatch.delenv(fp8_dot_rows.TILES_ENV)
        fp8_dot_rows.tuned.cache_clear()


@pytest.mark.parametrize("num_rows", [1, 5])
def test_split_k_is_right_eager_and_replayed(
    split_on: None,  # noqa: F811 (the fixture)
    num_rows: int,
) -> None:
    """KVRELAY_FP8_SPLIT_K=1 on the 8B shape's down_proj (K = 14,336 in parts, the last part's
    program summing them): the dequantized product eager, the eager result from a CUDA graph
    replayed with new rows, and the arrival counters back at zero after each."""
    gen = torch.Generator(CUDA).manual_seed(13)
    layer = layer_on_gpu(torch.randn(4096, 14336, device=CUDA, generator=gen) * 0.02, False, None)
    block_n, block_k = fp8_dot_rows.tile_for(4096)[:2]
    assert split_k.split_for(-(-4096 // block_n), 14336, block_k, split_k.num_sms(CUDA)) > 1
    x = torch.randn(num_rows, 14336, device=CUDA, generator=gen).bfloat16()
    rows = QuantizedRows(*quantize_rows_cuda(x, None))
    out = layer(rows).float()
    want = layer.forward_reference(rows).float()
    assert float((out - want).abs().max() / want.abs().max()) < 1e-2
    assert not split_k.counters(CUDA, 1).any()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = layer(QuantizedRows(*quantize_rows_cuda(x, None)))
    for _ in range(3):
        x.copy_(torch.randn(num_rows, 14336, device=CUDA, generator=gen).bfloat16())
        graph.replay()
        eager = layer(QuantizedRows(*quantize_rows_cuda(x, None)))
        assert torch.equal(replayed, eager), "the parts are summed in a fixed order"
        assert not split_k.counters(CUDA, 1).any()


def test_one_row_split_k_adds_into_the_residual() -> None:
    """fp8_one_row's GEMV with K in 4 parts (o_proj / down_proj's residual add) against 1."""
    gen = torch.Generator(CUDA).manual_seed(17)
    layer = layer_on_gpu(torch.randn(4096, 14336, device=CUDA, generator=gen) * 0.02, False, None)
    x = torch.randn(1, 14336, device=CUDA, generator=gen).bfloat16()
    residual = torch.randn(1, 4096, device=CUDA, generator=gen).bfloat16()
    tile = fp8_one_row.tile_for(4096, False)
    outs = []
    for parts in (1, 4):
        out = residual.clone()
        fp8_one_row.row_dot(x, layer.weight, layer.weight_scale, out, tile, add=True, split_k=parts)
        outs.append(out.float())
    torch.testing.assert_close(outs[1], outs[0], rtol=8e-3, atol=8e-3 * float(outs[0].abs().max()))
    assert not torch.equal(outs[0], residual.float())
    assert not split_k.counters(CUDA, 1).any()
