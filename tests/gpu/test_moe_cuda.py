"""A sparse-MoE model (Qwen3-MoE, a dense layer then a sparse one) on the GPU paths: the experts in
moe_kernels' Triton kernels under FlashInfer's fused ops, CUDA-graph decode and the one-row
fused GEMVs (a MoE layer's attention on them, its SparseMoe beside), against the float32 path on
the same forced trajectory, and CUDA-graph decode against eager, as test_qwen3_cuda checks the
dense shape."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.models.moe import SparseMoe
from tests.gpu.test_flashinfer_backend import (
    Recorder,
    assert_bf16_tolerance,
    build,
    first_divergence,
    float32_reference,
    forced_error,
    gpu_checkpoint,
    logit_scale,
    max_logit_error,
    pytestmark,  # noqa: F401 (gpu only)
    run_workload,
)


@pytest.fixture(scope="module")
def tiny_qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return gpu_checkpoint(  # intermediate_size: the dense layer 0's
        tmp_path_factory,
        "tiny-qwen3-moe",
        architecture="qwen3_moe",
        num_experts=8,
        num_experts_per_tok=2,
        expert_size=128,
        norm_topk_prob=True,
        mlp_only_layers=(0,),
    )


def test_qwen3_moe_on_the_gpu_paths_matches_float32(tiny_qwen3_moe: Path) -> None:
    # the experts' kernels in float32
    _, rec32, ref_tokens = float32_reference(tiny_qwen3_moe)
    errors = {}
    for backend, graphs in (("torch", False), ("flashinfer", True)):
        engine = build(tiny_qwen3_moe, "bfloat16", backend, cuda_graph=graphs)
        errors[backend] = forced_error(engine, rec32, ref_tokens)
        if backend == "flashinfer":
            model = engine.runner.model
            kinds = [type(layer.mlp).__name__ for layer in model.layers]
            assert kinds == ["MLP", "SparseMoe"] and model.fused_ops
            assert model.fused_gemv_rows() == [1]  # attention's GEMVs; the MoE beside them
            assert engine.runner.num_graph_steps > 0
    scale = logit_scale(rec32)
    print(f"qwen3-moe: max |logit| {scale:.3f}; max error vs fp32: {errors}")
    assert_bf16_tolerance(errors["flashinfer"], errors["torch"], scale)
    # unforced greedy: equal to float32's, or parted first at a near-tie of the reference
    graph_tokens, _ = run_workload(build(tiny_qwen3_moe, "bfloat16", "flashinfer", True))
    notes = first_divergence(ref_tokens, rec32.logits, graph_tokens, 2 * errors["flashinfer"])
    print("graphs vs float32 greedy:", notes or "equal token for token")


def test_qwen3_moe_graph_decode_equals_eager(tiny_qwen3_moe: Path) -> None:
    """The MoE kernels replayed from CUDA graphs (their grids sized for the padded batch, the
    work for the routing of the step) give eager's greedy tokens."""
    eager = build(tiny_qwen3_moe, "bfloat16", "flashinfer", cuda_graph=False)
    graph = build(tiny_qwen3_moe, "bfloat16", "flashinfer", cuda_graph=True)
    assert isinstance(graph.runner.model.layers[1].mlp, SparseMoe)
    rec_e = Recorder(eager)
    eager_tokens, _ = run_workload(eager)
    graph_tokens, _ = run_workload(graph)
    assert eager.runner.num_graph_steps == 0 and graph.runner.num_graph_steps > 0
    forced = build(tiny_qwen3_moe, "bfloat16", "flashinfer", cuda_graph=True)
    rec_f = Recorder(forced, forced=eager_tokens)
    run_workload(forced)
    error = max_logit_error(rec_e.logits, rec_f.logits)
    assert error <= 0.05 * logit_scale(rec_e)
    notes = first_divergence(eager_tokens, rec_e.logits, graph_tokens, max(2 * error, 1e-3))
    print("graph vs eager greedy:", notes or "equal token for token")
