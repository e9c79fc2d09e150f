"""engine/blas_choice.py on the GPU: a BlasLinear on cuBLASLt or on FlashInfer's tuned mm_bf16 gives
cuBLAS's numbers within bf16 rounding at decode and prefill row counts; tune_rows timed on the
device (graph replays) fills every layer's table with a library; a tiny bf16 engine built with
KVRELAY_BLAS_TUNE=1, its timer rigged so that cuBLASLt and FlashInfer win at some sizes, has those
choices at every captured decode size (and none at a prefill step's rows), captured those libraries
into its graphs and ran none in its eager steps, and, forced along the untuned engine's tokens,
gives its logits within bf16 rounding."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

from engine import blas_choice
from engine.blas_choice import BlasLinear, chosen_libraries, tune_rows
from engine.models import fused_gemv
from tests.gpu.test_flashinfer_backend import (
    Recorder,
    logit_scale,
    max_logit_error,
    run_workload,
)
from tests.gpu.test_fp8_weights import (  # noqa: F401 (their tiny fixture)
    CUDA,
    engine_on,
    load,
    tiny,
)

pytestmark = [  # bf16 GEMMs: any CUDA GPU (not the FP8 tests' compute capability 8.9)
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]


@pytest.fixture
def tuning(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    monkeypatch.setenv(blas_choice.ENV, "1")
    blas_choice.tuning_wanted.cache_clear()
    yield monkeypatch
    monkeypatch.delenv(blas_choice.ENV, raising=False)
    blas_choice.tuning_wanted.cache_clear()
    monkeypatch.delenv(fused_gemv.ROWS_ENV, raising=False)
    fused_gemv.max_rows.cache_clear()


@pytest.mark.parametrize("library", ["cublaslt", "flashinfer"])
@pytest.mark.parametrize("num_rows", [1, 64, 384, 2048])
def test_other_libraries_give_cublas_numbers(num_rows: int, library: str) -> None:
    gen = torch.Generator(CUDA).manual_seed(0)
    before = torch.backends.cuda.preferred_blas_library()
    layer = BlasLinear(1024, 3072, bias=False).to(CUDA, torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(3072, 1024, device=CUDA, generator=gen) * 0.03)
        x = torch.randn(num_rows, 1024, device=CUDA, generator=gen).bfloat16()
        want = layer(x).float()
        if library == "flashinfer":
            assert blas_choice.flashinfer_can_run(layer)
            blas_choice.flashinfer_linear(x, layer.weight, tune=True)
        layer.blas_by_rows[num_rows] = library
        with blas_choice.choices_in_force():
            got = layer(x).float()
    assert torch.backends.cuda.preferred_blas_library() == before
    error = float((got - want).abs().max() / want.abs().max())
    print(f"{num_rows} rows: {library} against cuBLAS, max relative error {error:.1e}")
    assert error <= 2e-2


def test_tune_rows_on_the_device_fills_every_table() -> None:
    model = torch.nn.ModuleList(
        [
            BlasLinear(2048, 2048, bias=False),
            BlasLinear(2048, 2048),
            BlasLinear(2048, 512, bias=False),
        ]
    ).to(CUDA, torch.bfloat16)
    groups = blas_choice.layers_by_shape(model)
    x = torch.zeros(256, 2048, device=CUDA, dtype=torch.bfloat16)
    assert blas_choice.candidates(groups[(2048, 2048)], x) == blas_choice.TORCH_LIBRARIES  # bias
    assert blas_choice.candidates(groups[(512, 2048)], x) == blas_choice.LIBRARIES
    seconds = blas_choice.time_on_gpu(groups[(512, 2048)], x, "cublaslt")
    assert 0 < seconds < 1  # one graph replay of a 2048 -> 512 GEMM of 256 rows
    chosen = tune_rows(model, 256)
    assert chosen.keys() == {"2048x2048", "512x2048"}
    assert chosen["2048x2048"] in blas_choice.TORCH_LIBRARIES
    assert all(layer.blas_by_rows[256] in blas_choice.LIBRARIES for layer in model)
    print(f"256 rows: {chosen}")


def rigged_timer(layers: Sequence[BlasLinear], x: torch.Tensor, library: str) -> float:
    """1 s for LIBRARIES[rows % 3] (cuBLASLt at 1 and 4 rows, FlashInfer at 2 and 8),
    2 s for the others: the tuned engine really runs the libraries other than the default."""
    return 1.0 if library == blas_choice.LIBRARIES[x.shape[0] % 3] else 2.0


def test_tiny_engine_on_graphs_tuned_gives_the_untuned_engines_logits(
    tuning: pytest.MonkeyPatch,
    tiny: Path,  # noqa: F811
) -> None:
    tuning.setenv(blas_choice.ENV, "0")
    blas_choice.tuning_wanted.cache_clear()
    tuning.setenv(fused_gemv.ROWS_ENV, "0")  # batch 1 on a BLAS library too, not the fused GEMVs
    fused_gemv.max_rows.cache_clear()
    model = load(tiny, quantization=None)
    plain = engine_on(model, tiny, cuda_graph=True)
    assert chosen_libraries(model) == {}
    rec_plain = Recorder(plain)
    plain_tokens, _ = run_workload(plain)
    tuning.setenv(blas_choice.ENV, "1")
    blas_choice.tuning_wanted.cache_clear()
    tuning.setattr(blas_choice, "time_on_gpu", rigged_timer)
    ran: set[tuple[int, str]] = set()  # (rows, library) of each product on a chosen library
    run_on = blas_choice.run_on

    def recording_run_on(library: str, x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
        ran.add((x.shape[0], library))
        return run_on(library, x, layer)

    tuning.setattr(blas_choice, "run_on", recording_run_on)
    tuned = engine_on(model, tiny, cuda_graph=True)
    table = chosen_libraries(model)
    assert sorted(table) == tuned.runner.graphs.sizes  # prefill rows keep torch's default
    assert tuned.config.scheduler.max_num_batched_tokens not in table
    for num_rows, by_shape in table.items():  # every group took the rigged winner
        assert set(by_shape.values()) == {blas_choice.LIBRARIES[num_rows % 3]}, num_rows
    # The graphs captured the chosen libraries (and no step ran one outside them).
    assert ran == {(num_rows, blas_choice.LIBRARIES[num_rows % 3]) for num_rows in table}
    rec_tuned = Recorder(tuned, forced=plain_tokens)
    ran.clear()
    run_workload(tuned)
    assert ran == set()  # eager steps (prefill, mixed) on torch's default
    assert tuned.runner.num_graph_steps > 0
    scale = logit_scale(rec_plain)
    error = max_logit_error(rec_plain.logits, rec_tuned.logits)
    print(f"tuned engine vs untuned: max logit error {error:.4f} (max |logit| {scale:.2f})")
    assert error <= 0.05 * scale
