"""Programmatic dependent launch (execution/pdl.py) on the GPU: with it, a chain of the engine's
few-row kernels (add + RMSNorm + quantize, fp8_dot_rows, SiLU + quantize, the GEMV), each
reading the one before's output, gives the same numbers as without, eagerly and replayed from
a CUDA graph; and a tiny FP8 model's greedy run through the engine on graphs is the same with
it and without (as on a GPU without PDL). A kernel that read before its wait would read the
previous replay's values.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.execution import pdl
from engine.quant.fp8_fused import add_rms_norm_quantize, silu_and_mul_quantize
from engine.quant.fp8_types import QuantizedRows
from tests.gpu.test_flashinfer_backend import Recorder, logit_scale, max_logit_error, run_workload
from tests.gpu.test_fp8_weights import (  # noqa: F401 (their GPU marks and tiny fixture)
    CUDA,
    engine_on,
    layer_on_gpu,
    load,
    pytestmark,
    tiny,
)

HIDDEN, INTERMEDIATE, LAYERS = 4096, 14336, 3  # the 8B shape's MLP


def require_pdl() -> None:
    if not pdl.enabled(CUDA):
        pytest.skip("PDL needs compute capability >= 9 and Triton's gdc calls")


@pytest.fixture
def pdl_switch(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """set(on): the kernels launch with PDL (where the GPU has it, as the engine does) or
    without it (as on a GPU that has not) for what follows."""
    real = pdl.enabled

    class Switch:
        def set(self, on: bool) -> None:
            monkeypatch.setattr(pdl, "enabled", real if on else lambda device: False)

    yield Switch()


def mlp_layers() -> list[tuple]:
    gen = torch.Generator(CUDA).manual_seed(3)

    def weight(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, device=CUDA, generator=gen) * cols**-0.5

    return [
        (
            torch.rand(HIDDEN, device=CUDA, generator=gen).bfloat16() + 0.5,
            layer_on_gpu(weight(2 * INTERMEDIATE, HIDDEN), False, None),
            layer_on_gpu(weight(HIDDEN, INTERMEDIATE), False, None),
            layer_on_gpu(weight(HIDDEN, HIDDEN), False, None),
        )
        for _ in range(LAYERS)
    ]


def chain(layers: list[tuple], hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """Per layer: add + RMSNorm + quantize, gate_up on fp8_dot_rows, SiLU + quantize, down on
    fp8_dot_rows, then a bf16-row GEMV (o_proj's kernel) on its output. residual changes in
    place."""
    for norm, gate_up, down, out in layers:
        rows = add_rms_norm_quantize(hidden, residual, norm, 1e-5, None)
        product = gate_up(QuantizedRows(*rows))
        hidden = out(down(QuantizedRows(*silu_and_mul_quantize(product, None))))
    return hidden


@pytest.mark.parametrize("num_rows", [1, 5])
def test_kernel_chain_is_the_same_with_pdl(pdl_switch, num_rows: int) -> None:
    require_pdl()
    layers = mlp_layers()
    gen = torch.Generator(CUDA).manual_seed(11)
    randn = lambda: torch.randn(num_rows, HIDDEN, device=CUDA, generator=gen).bfloat16()  # noqa: E731
    inputs = [(randn(), randn()) for _ in range(3)]  # (hidden, residual) of three replays
    pdl_switch.set(False)
    want = []
    for hidden, residual in inputs:
        res = residual.clone()
        want.append((chain(layers, hidden, res), res))  # compiles and autotunes without PDL
    pdl_switch.set(True)
    for (hidden, residual), (out, res) in zip(inputs, want, strict=True):
        got_res = residual.clone()
        assert torch.equal(chain(layers, hidden, got_res), out)
        assert torch.equal(got_res, res)
    static_hidden, static_residual = (t.clone() for t in inputs[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        chain(layers, static_hidden, static_residual.clone())  # PDL kernels compiled outside
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = chain(layers, static_hidden, static_residual)
    for (hidden, residual), (out, res) in zip(inputs, want, strict=True):
        static_hidden.copy_(hidden)
        static_residual.copy_(residual)
        graph.replay()
        assert torch.equal(graph_out, out), "a graph replay with PDL read stale rows"
        assert torch.equal(static_residual, res)


def test_tiny_fp8_engine_on_graphs_is_the_same_with_pdl(
    pdl_switch,
    tiny: Path,  # noqa: F811
) -> None:
    require_pdl()
    model = load(tiny)
    pdl_switch.set(False)
    plain = engine_on(model, tiny, cuda_graph=True)
    rec_plain = Recorder(plain)
    plain_tokens, _ = run_workload(plain)
    pdl_switch.set(True)
    with_pdl = engine_on(model, tiny, cuda_graph=True)
    rec_pdl = Recorder(with_pdl)
    pdl_tokens, _ = run_workload(with_pdl)
    assert with_pdl.runner.num_graph_steps > 0
    error = max_logit_error(rec_plain.logits, rec_pdl.logits)
    print(f"fp8 engine with PDL vs without: max logit error {error:.6f}")
    assert pdl_tokens == plain_tokens
    assert error <= 1e-3 * logit_scale(rec_plain)
