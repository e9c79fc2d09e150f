"""Qwen3's per-head q/k norms on the GPU paths: FlashInfer's fused ops, CUDA-graph decode and the
one-row fused GEMVs (their attend applies the norms), against the torch backend in float32 on
the same forced trajectory, as test_flashinfer_backend checks the Llama shape."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.factories import make_tiny_checkpoint
from tests.gpu.test_flashinfer_backend import (
    Recorder,
    build,
    logit_scale,
    max_logit_error,
    pytestmark,  # noqa: F401 (gpu only)
    run_workload,
)


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("flashinfer")
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny-qwen3"),
        architecture="qwen3",
        hidden_size=256,
        intermediate_size=512,
        head_dim=128,  # 4 heads x 128 = 512: q wider than the hidden size, as in Qwen3
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        init_std=0.1,
        dtype=torch.bfloat16,
    )


def test_qwen3_on_the_gpu_paths_matches_float32(tiny_qwen3: Path) -> None:
    fp32 = build(tiny_qwen3, "float32", "torch")
    rec32 = Recorder(fp32)
    ref_tokens, cached = run_workload(fp32)
    assert cached["b"] == 32, "the shared prefix was not served from the cache"
    errors = {}
    for backend, graphs in (("torch", False), ("flashinfer", True)):
        engine = build(tiny_qwen3, "bfloat16", backend, cuda_graph=graphs)
        rec = Recorder(engine, forced=ref_tokens)
        assert run_workload(engine)[0] == ref_tokens  # forced: same trajectory
        errors[backend] = max_logit_error(rec32.logits, rec.logits)
        if backend == "flashinfer":
            model = engine.runner.model
            assert model.config.qk_norm and model.fused_ops
            assert model.fused_gemv_rows() == [1]  # batch-1 decode on the fused GEMVs
            assert engine.runner.num_graph_steps > 0
    scale = logit_scale(rec32)
    print(f"qwen3: max |logit| {scale:.3f}; max error vs fp32: {errors}")
    assert errors["flashinfer"] <= max(2 * errors["torch"], 0.02 * scale)
    assert errors["flashinfer"] <= 0.1 * scale
