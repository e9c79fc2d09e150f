"""A KV pool sized by GPU memory on a real card: the engine's allocations, the heaviest step
included, stay within gpu_memory_utilization * gpu_share of it, and two engines at share 0.5
both fit on one card (the second sees what the first took through mem_get_info)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig, SchedulerConfig
from engine.engine import Engine
from engine.execution.memory_budget import default_max_num_seqs
from engine.sampling.sampling_params import SamplingParams
from tests.conftest import run_to_completion
from tests.factories import make_tiny_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

BUDGET_TOKENS = 2048
HEAVY = SamplingParams(max_tokens=4, temperature=1.0, top_k=50, top_p=0.9, logprobs=True)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny-llama"),
        hidden_size=256,
        intermediate_size=512,
        head_dim=128,
        max_position_embeddings=4096,
        dtype=torch.bfloat16,
    )


def build(folder: Path, utilization: float, share: float = 1.0, **engine: object) -> Engine:
    config = EngineConfig(
        model=str(folder),
        device="cuda",
        scheduler=SchedulerConfig(max_num_batched_tokens=BUDGET_TOKENS),
        gpu_memory_utilization=utilization,
        gpu_share=share,
        **engine,
    )
    return Engine(config)


def run_heavy_steps(engine: Engine, tag: str) -> None:
    """A full-budget prefill, then a batch of sampling rows with every filter on."""
    engine.add_request(f"{tag}-long", [1 + i % 500 for i in range(BUDGET_TOKENS - 1)], HEAVY)
    for i in range(64):
        engine.add_request(f"{tag}-{i}", [1 + i, 2, 3, 4], HEAVY)
    run_to_completion(engine)
    engine.assert_no_leaks()


def test_a_pool_sized_by_memory_stays_within_its_part_of_the_card(tiny_llama: Path) -> None:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    engine = build(tiny_llama, utilization=0.5)
    pool_tokens = engine.kv.num_blocks * engine.kv.block_size
    assert engine.config.scheduler.max_num_seqs == default_max_num_seqs(
        pool_tokens, BUDGET_TOKENS, sized_by_memory=True
    )
    run_heavy_steps(engine, "a")
    free, total = torch.cuda.mem_get_info()
    assert free >= 0
    assert torch.cuda.max_memory_allocated() - base <= 0.5 * total
    del engine
    torch.cuda.empty_cache()


def test_two_engines_at_half_a_card_both_fit(tiny_llama: Path) -> None:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    first = build(tiny_llama, utilization=0.9, share=0.5, cuda_graph=False)
    second = build(tiny_llama, utilization=0.9, share=0.5, cuda_graph=False)
    assert first.kv.num_blocks > 0 and second.kv.num_blocks > 0
    # Both pools got about the same half: neither was squeezed by the other.
    assert second.kv.num_blocks >= 0.9 * first.kv.num_blocks
    run_heavy_steps(first, "first")
    run_heavy_steps(second, "second")
    free, total = torch.cuda.mem_get_info()
    assert free > 0
    assert torch.cuda.max_memory_allocated() - base <= 0.9 * total
    del first, second
    torch.cuda.empty_cache()
