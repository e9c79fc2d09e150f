"""Qwen3's per-head q/k norms on the GPU paths: FlashInfer's fused ops, CUDA-graph decode and the
one-row fused GEMVs (their attend applies the norms), against the torch backend in float32 on
the same forced trajectory, as test_flashinfer_backend checks the Llama shape."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.gpu.test_flashinfer_backend import (
    assert_bf16_tolerance,
    build,
    float32_reference,
    forced_error,
    gpu_checkpoint,
    logit_scale,
    pytestmark,  # noqa: F401 (gpu only)
)


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 4 heads x 128 = 512: q wider than the hidden size, as in Qwen3
    return gpu_checkpoint(tmp_path_factory, "tiny-qwen3", architecture="qwen3", rms_norm_eps=1e-6)


def test_qwen3_on_the_gpu_paths_matches_float32(tiny_qwen3: Path) -> None:
    _, rec32, ref_tokens = float32_reference(tiny_qwen3)
    errors = {}
    for backend, graphs in (("torch", False), ("flashinfer", True)):
        engine = build(tiny_qwen3, "bfloat16", backend, cuda_graph=graphs)
        errors[backend] = forced_error(engine, rec32, ref_tokens)
        if backend == "flashinfer":
            model = engine.runner.model
            assert model.config.qk_norm and model.fused_ops
            assert model.fused_gemv_rows() == [1]  # batch-1 decode on the fused GEMVs
            assert engine.runner.num_graph_steps > 0
    scale = logit_scale(rec32)
    print(f"qwen3: max |logit| {scale:.3f}; max error vs fp32: {errors}")
    assert_bf16_tolerance(errors["flashinfer"], errors["torch"], scale)
