"""gpu_engine_bench's "mixed" section on the GPU paths (FlashInfer, CUDA graphs, overlapped
steps): the CUDA-only parts (CUDA events around each launch, torch.profiler windows of single
calls) give every cell its kernel counts and GPU spans, and nothing is left behind."""

from __future__ import annotations

from pathlib import Path

from bench.lib.mixed_steps import mixed_steps
from tests.gpu.test_flashinfer_backend import (  # noqa: F401 (pytestmark: gpu only)
    build_serving,
    pytestmark,
    tiny_llama,
)


def test_the_mixed_section_profiles_its_calls_on_the_gpu(tiny_llama: Path) -> None:  # noqa: F811
    engine = build_serving(tiny_llama)
    assert engine.overlap_steps  # the CUDA default
    result = mixed_steps(engine, [4], [32], reps=1, context_len=40, cuda=True)
    (cell,) = result["cells"]
    over = cell["overlapped"]["groups"]
    assert over["launch_mixed"]["calls"] == over["finish_mixed"]["calls"] == 1
    assert over["finish_mixed"]["finished_gpu_span_ms"] > 0
    assert over["decode"]["host_ms"]["graph_replay"] > 0  # pure decode replays its graph
    assert over["launch_mixed"]["host_ms"]["forward_eager"] > 0
    kernels = cell["serial_kernels"]["groups"]
    assert kernels["mixed"]["calls"] == 2 and kernels["decode"]["calls"] == 4
    for label in ("mixed", "decode"):
        k = kernels[label]
        assert k["num_kernels"] > 0 and 0 < k["kernel_busy_ms"] <= k["gpu_span_ms"] + 1e-6
        assert k["kernel_busy_ms"] <= k["wall_ms"]
    assert kernels["mixed"]["num_kernels"] > kernels["decode"]["num_kernels"]  # eager launches
    assert engine.runner.num_graph_steps > 0 and engine.overlap_steps
    engine.assert_no_leaks()
