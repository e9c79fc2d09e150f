"""FP8 GEMMs that leave their scales to the kernel after them (KVRELAY_FP8_DEFER_SCALES=1):
Fp8Linear.forward_deferred against the row-scaled forward, and a tiny FP8 engine with deferred
scales against the default one, eager, on decode graphs and on piecewise mixed-step graphs
(where the recorded attention gets the scaled values). The GEMV is turned off so that decode
rows reach cuBLASLt too; logits are compared on one forced token trajectory, as in
tests/gpu/test_fp8_weights.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.quant import fp8
from engine.quant.fp8_fused import quantize_rows_cuda
from tests.gpu.test_flashinfer_backend import Recorder, logit_scale, max_logit_error, run_workload
from tests.gpu.test_fp8_weights import (  # noqa: F401 (tiny: a fixture; pytestmark: GPU, >= 8.9)
    CUDA,
    engine_on,
    layer_on_gpu,
    load,
    pytestmark,
    tiny,
)


@pytest.fixture
def switches(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """KVRELAY_FP8_GEMV=0; the test sets KVRELAY_FP8_DEFER_SCALES; both re-read on use."""
    monkeypatch.setenv(fp8.GEMV_ENV, "0")
    fp8.gemv_enabled.cache_clear()
    fp8.defer_enabled.cache_clear()
    yield
    monkeypatch.delenv(fp8.GEMV_ENV)
    monkeypatch.delenv(fp8.DEFER_SCALES_ENV, raising=False)
    fp8.gemv_enabled.cache_clear()
    fp8.defer_enabled.cache_clear()


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("num_rows", [17, 300, fp8.DEFER_MAX_ROWS])
def test_forward_deferred_equals_the_row_scaled_forward(num_rows: int, static: bool) -> None:
    gen = torch.Generator("cuda").manual_seed(0)
    weight = torch.randn(768, 1024, device=CUDA, generator=gen) * 0.02
    layer = layer_on_gpu(weight, static, None)
    x = torch.randn(num_rows, 1024, device=CUDA, generator=gen).bfloat16()
    rows = fp8.QuantizedRows(*quantize_rows_cuda(x, layer.input_scale))
    want = layer(rows).float()
    got = layer.forward_deferred(rows)
    assert isinstance(got, fp8.ScaledRows) and got.raw.shape == want.shape
    # two different cuBLASLt kernels in fast accumulation (each within ~1.4% of the largest
    # output of exact sums) and one more bf16 rounding; a wrong scale would be off by ~100%
    error = float((got.materialize().float() - want).abs().max())
    assert error <= 0.03 * float(want.abs().max())


@pytest.mark.parametrize("mode", ["eager", "graphs", "piecewise"])
def test_engine_with_deferred_scales_equals_the_default(
    tiny: Path,  # noqa: F811
    switches: None,
    monkeypatch: pytest.MonkeyPatch,
    mode: str,
) -> None:
    options = {"eager": {}, "graphs": {"cuda_graph": True}}.get(
        mode, {"cuda_graph": True, "mixed_step_graphs": True}
    )
    model = load(tiny)
    reference = engine_on(model, tiny, **options)
    rec_reference = Recorder(reference)
    tokens, _ = run_workload(reference)
    monkeypatch.setenv(fp8.DEFER_SCALES_ENV, "1")
    fp8.defer_enabled.cache_clear()
    deferred_calls = []
    forward_deferred = fp8.Fp8Linear.forward_deferred

    def counting(self, x):
        deferred_calls.append(x.q.shape[0] if isinstance(x, fp8.QuantizedRows) else x.shape[0])
        return forward_deferred(self, x)

    monkeypatch.setattr(fp8.Fp8Linear, "forward_deferred", counting)
    deferred = engine_on(model, tiny, **options)
    rec_deferred = Recorder(deferred, forced=tokens)
    run_workload(deferred)
    assert deferred_calls, "no GEMM deferred its scales"
    error = max_logit_error(rec_reference.logits, rec_deferred.logits)
    print(f"{mode}: deferred scales against row-scaled GEMMs, max logit error {error:.4f}")
    assert error <= 0.02 * logit_scale(rec_reference)
