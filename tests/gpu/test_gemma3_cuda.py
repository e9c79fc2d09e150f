"""Gemma 3's sliding-window layers on the FlashInfer backend (one wrapper per window, planned
with window_left; CUDA-graph decode) against the torch backend in float32 on the same forced
trajectory, as test_flashinfer_backend checks the Llama shape; and the windows matter: the same
engine with every layer on its full-attention wrappers is far off."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.gpu.test_flashinfer_backend import (
    Recorder,
    assert_bf16_tolerance,
    build,
    float32_reference,
    forced_error,
    gpu_checkpoint,
    logit_scale,
    max_logit_error,
    pytestmark,  # noqa: F401 (gpu only)
    run_workload,
)

WINDOW = 24  # over a block and a half; the workload's prompts run to 100 tokens


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return gpu_checkpoint(
        tmp_path_factory,
        "tiny-gemma3",
        architecture="gemma3",
        num_layers=4,  # sliding, sliding, full, sliding
        sliding_window=WINDOW,
        query_pre_attn_scalar=128,
        tie_embeddings=True,
    )


def test_gemma3_on_flashinfer_matches_float32(tiny_gemma3: Path) -> None:
    fp32, rec32, ref_tokens = float32_reference(tiny_gemma3)
    assert fp32.model_config.layer_windows == (WINDOW, WINDOW, None, WINDOW)
    errors = {}
    for backend, graphs in (("torch", False), ("flashinfer", False), ("flashinfer", True)):
        engine = build(tiny_gemma3, "bfloat16", backend, cuda_graph=graphs)
        errors[(backend, graphs)] = forced_error(engine, rec32, ref_tokens)
        if backend == "flashinfer":
            attention = engine.runner.attention
            # windowed models stay off the paths that take no window
            assert attention.ragged_kernel is None and attention.decode_kernel == "fa2"
            if graphs:
                assert engine.runner.num_graph_steps > 0
    # every layer on the full-attention wrappers: the windows' effect
    unwindowed = build(tiny_gemma3, "bfloat16", "flashinfer")
    unwindowed.runner.attention.windows = (None,) * 4
    rec = Recorder(unwindowed, forced=ref_tokens)
    run_workload(unwindowed)
    off = max_logit_error(rec32.logits, rec.logits)
    scale = logit_scale(rec32)
    print(f"gemma3: max |logit| {scale:.3f}; max error vs fp32: {errors}; windows off: {off}")
    torch_error = errors[("torch", False)]
    for key in (("flashinfer", False), ("flashinfer", True)):
        assert_bf16_tolerance(errors[key], torch_error, scale, key)
    assert off > 5 * max(errors.values())
