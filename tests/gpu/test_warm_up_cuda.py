"""The start-up warm-up on the GPU paths (FlashInfer, CUDA graphs, overlapped steps), where it
is on by default: its steps wrote the padding and freed blocks of a real pool, and an engine
that ran it still generates what one that did not does, with nothing of it left behind."""

from __future__ import annotations

from pathlib import Path

from engine.sampling.sampling_params import SamplingParams
from tests.conftest import run_to_completion
from tests.gpu.test_flashinfer_backend import (  # noqa: F401 (pytestmark: gpu only)
    build_serving,
    pytestmark,
    tiny_llama,
)


def test_a_warmed_up_gpu_engine_generates_as_a_cold_one(tiny_llama: Path) -> None:  # noqa: F811
    outputs, engines = [], []
    for warm_up in (None, False):  # None: the default, on CUDA
        engine = build_serving(tiny_llama, record_kv_events=True, warm_up=warm_up)
        engines.append(engine)
        assert engine.kv.pool.num_cached_blocks == 0 and engine.drain_kv_events() == []
        assert engine.stats.num_steps == 0 and engine.runner.num_graph_steps == 0
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        for i in range(6):
            prompt = [(37 * i + 5 * t) % 200 + 1 for t in range(20 + 30 * i)]
            engine.add_request(f"r{i}", prompt, params)
        outputs.append(run_to_completion(engine))
        assert engine.runner.num_graph_steps > 0  # decode steps still replay graphs
        engine.assert_no_leaks()
    assert outputs[0] == outputs[1]
