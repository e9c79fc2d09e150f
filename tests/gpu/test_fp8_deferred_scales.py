"""FP8 GEMMs that leave their scales to the kernel after them (decode batches):
Fp8Linear.forward_deferred against the row-scaled forward, and a tiny FP8 engine with deferred
scales and one without (as larger steps run), each against the bf16 engine of its dequantized
weights, eager and on decode graphs. The few-row kernels are turned off so that small decode
batches reach cuBLASLt too; logits are compared on one forced token trajectory, as in
tests/gpu/test_fp8_weights.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.models import llama
from engine.quant import fp8
from engine.quant.fp8_fused import quantize_rows_cuda
from tests.gpu.test_flashinfer_backend import Recorder, logit_scale, max_logit_error, run_workload
from tests.gpu.test_fp8_weights import (  # noqa: F401 (tiny: a fixture; pytestmark: GPU, >= 8.9)
    CUDA,
    dequantized_twin,
    engine_on,
    layer_on_gpu,
    load,
    pytestmark,
    tiny,
)


@pytest.fixture
def switches(monkeypatch: pytest.MonkeyPatch) -> None:
    """No input takes the few-row kernels: every FP8 matmul runs on cuBLASLt (as steps of more
    than fp8_gemv.GEMV_MAX_ROWS rows do)."""
    monkeypatch.setattr(fp8, "takes_gemv", lambda rows: False)


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


@pytest.mark.parametrize("mode", ["eager", "graphs"])
def test_engine_with_deferred_scales_stays_as_close_to_bf16_as_without(
    tiny: Path,  # noqa: F811
    switches: None,
    monkeypatch: pytest.MonkeyPatch,
    mode: str,
) -> None:
    """The tiny FP8 engine with deferred scales and without, each against the bf16 engine of
    the dequantized weights on its token trajectory. The two FP8 engines are not compared with
    each other: a rounding change flips e4m3 codes of later activations (steps of 6-12%), and
    this random model amplifies that to ~0.1x its largest logit (0.82 of 7.34 measured on the
    H200 at 31aec36) whatever the path; a wrong scale moves logits by their size."""
    options = {"eager": {}, "graphs": {"cuda_graph": True}}[mode]
    model = load(tiny)
    plain = engine_on(dequantized_twin(model, tiny), tiny, **options)
    rec_plain = Recorder(plain)
    tokens, _ = run_workload(plain)
    deferred_calls = []
    forward_deferred = fp8.Fp8Linear.forward_deferred

    def counting(self, x):
        deferred_calls.append(x.q.shape[0] if isinstance(x, fp8.QuantizedRows) else x.shape[0])
        return forward_deferred(self, x)

    monkeypatch.setattr(fp8.Fp8Linear, "forward_deferred", counting)
    errors = {}
    defers_scales = llama.defers_scales
    for defer in (False, True):
        # without: every FP8 product row-scaled, as steps of more than DEFER_MAX_ROWS run
        monkeypatch.setattr(llama, "defers_scales", defers_scales if defer else lambda *a: False)
        deferred_calls.clear()
        engine = engine_on(model, tiny, **options)
        rec = Recorder(engine, forced=tokens)
        run_workload(engine)
        assert bool(deferred_calls) == defer, "deferral did not follow the test's choice"
        errors[defer] = max_logit_error(rec_plain.logits, rec.logits)
    scale = logit_scale(rec_plain)
    print(f"{mode}: max logit error against bf16 weights: deferred {errors[True]:.4f}, ", end="")
    print(f"row-scaled {errors[False]:.4f} (max |logit| {scale:.3f})")
    assert errors[False] <= 0.4 * scale and errors[True] <= 0.4 * scale
