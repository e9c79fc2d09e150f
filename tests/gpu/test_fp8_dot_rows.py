"""Few quantized rows on the GPU: Fp8Linear hands QuantizedRows of up to GEMV_MAX_ROWS rows to
fp8_dot_rows (e4m3 codes on tensor cores, a fixed tile by weight width) and the result equals
the float32 product of the dequantized operands up to bf16 rounding, eager and replayed from a
CUDA graph, with the wide tile too; a bf16 input of as many rows still takes the GEMV."""

from __future__ import annotations

import pytest
import torch

from engine.quant import fp8, fp8_dot_rows
from engine.quant.fp8 import takes_quantized
from engine.quant.fp8_fused import quantize_rows_cuda
from engine.quant.fp8_gemv import GEMV_MAX_ROWS
from engine.quant.fp8_types import QuantizedRows
from tests.gpu.test_fp8_weights import CUDA, layer_on_gpu, pytestmark  # noqa: F401 (GPU, >= 8.9)


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


def test_the_wide_tile_is_right() -> None:
    """A weight wide enough for WIDE_TILE against the dequantized product."""
    gen = torch.Generator(CUDA).manual_seed(11)
    channels = fp8_dot_rows.WIDE_CHANNELS + 96  # a partial last tile
    weight = torch.randn(channels, 512, device=CUDA, generator=gen) * 0.02
    layer = layer_on_gpu(weight, False, None)
    x = torch.randn(2, 512, device=CUDA, generator=gen).bfloat16()
    rows = QuantizedRows(*quantize_rows_cuda(x, None))
    out = layer(rows).float()
    want = layer.forward_reference(rows).float()
    assert float((out - want).abs().max() / want.abs().max()) < 1e-2
