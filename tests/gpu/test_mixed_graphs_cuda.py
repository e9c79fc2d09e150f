"""Mixed-step graphs on the GPU (engine/execution/mixed_graphs.py): steps that carry a prompt's
chunk replay per-layer graphs around eager attention and give what eager steps give (logits to
bf16 noise on the same trajectory, greedy tokens equal or parting at a near-tie), with a cached
prefix, bf16 and FP8 weights + KV, plain and overlapped steps; nothing is left behind."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.engine import Engine
from tests.conftest import build_engine
from tests.gpu.test_flashinfer_backend import (  # noqa: F401 (pytestmark: gpu only)
    Recorder,
    first_divergence,
    logit_scale,
    max_logit_error,
    pytestmark,
    run_workload,
    tiny_llama,
)


def build(folder: Path, mixed: bool, **overrides: Any) -> Engine:
    """The serving paths (FlashInfer, CUDA graphs) with a 64-token step budget: buckets 16-64;
    mixed=False: the eager reference, the same engine with its mixed-step graphs dropped."""
    engine = build_engine(
        model_path=str(folder),
        device="cuda",
        dtype="bfloat16",
        num_blocks=128,
        max_num_batched_tokens=64,
        max_num_seqs=8,
        **overrides,
    )
    if not mixed:
        engine.runner.mixed = None
    return engine


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"async_scheduling": True},
        {"quantization": "fp8", "kv_cache_dtype": "fp8"},
    ],
    ids=["bf16", "overlapped", "fp8"],
)
def test_mixed_steps_on_graphs_equal_eager_ones(
    tiny_llama: Path,  # noqa: F811
    overrides: dict[str, Any],
) -> None:
    recorded = {**overrides, "async_scheduling": False}  # the Recorder reads logits at launch
    eager = build(tiny_llama, False, **recorded)
    assert eager.runner.mixed is None
    rec_e = Recorder(eager)
    eager_tokens, cached = run_workload(eager)
    assert cached["b"] == 32  # a mixed step over a cached prefix

    forced = build(tiny_llama, True, **recorded)
    mixed = forced.runner.mixed
    assert mixed is not None and mixed.sizes == [16, 32, 48, 64]
    rec_f = Recorder(forced, forced=eager_tokens)
    run_workload(forced)  # asserts no leaks
    assert mixed.num_steps >= 2  # the first step (64 tokens) and b's and d's prompts
    error = max_logit_error(rec_e.logits, rec_f.logits)
    scale = logit_scale(rec_e)
    print(f"mixed graphs vs eager: max logit error {error:.5f} (max |logit| {scale:.3f})")
    assert error <= 0.05 * scale

    free = build(tiny_llama, True, **overrides)  # free-running, overlapped where asked
    tokens, _ = run_workload(free)
    assert free.runner.mixed is not None and free.runner.mixed.num_steps >= 2
    notes = first_divergence(eager_tokens, rec_e.logits, tokens, max(2 * error, 1e-3))
    print("mixed graphs vs eager greedy:", notes or "equal token for token")
