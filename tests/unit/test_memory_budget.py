"""KV pool sizing (engine/execution/memory_budget.py and its wrapper in backend_builder.py): the
arithmetic with numbers, the batch limit picked for a pool, the fixed CPU pool kept as it was,
and the profiling step's inputs run on CPU (the CUDA measurements themselves: tests/gpu)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.execution import backend_builder
from engine.execution.backend_builder import (
    KVPoolSize,
    model_tensor_bytes,
    run_profile_step,
    size_kv_pool,
    size_kv_pool_by_memory,
    sizes_by_memory,
    with_batch_limit,
)
from engine.execution.memory_budget import (
    CPU_KV_CACHE_BYTES,
    DEFAULT_MAX_NUM_SEQS,
    GRAPH_RESERVE_BYTES,
    MIXED_GRAPH_RESERVE_BYTES,
    GiB,
    MiB,
    default_max_num_seqs,
    graph_reserve_bytes,
    kv_pool_bytes,
    num_pool_blocks,
    profile_num_seqs,
)
from engine.models.loader import random_model
from tests.factories import make_model_config, make_tiny_checkpoint

H200 = 140 * GiB


def test_the_pool_takes_the_budget_left_after_weights_activations_and_graphs() -> None:
    budget = kv_pool_bytes(
        total=H200,
        free=H200 - 17 * GiB,  # this process's weights and context
        used_by_weights=16 * GiB,
        activation_peak=2 * GiB,
        graph_reserve=512 * MiB,
        utilization=0.9,
    )
    assert budget.budget_bytes == int(H200 * 0.9)
    assert budget.pool_bytes == int(H200 * 0.9) - 16 * GiB - 2 * GiB - 512 * MiB
    assert not budget.limited_by_free_memory


def test_two_engines_at_half_a_card_both_fit_within_the_utilization() -> None:
    weights, peak, graphs = GiB, GiB, 512 * MiB
    first = kv_pool_bytes(H200, H200 - weights, weights, peak, graphs, 0.9, fraction=0.5)
    assert first.budget_bytes == int(H200 * 0.45)
    assert first.pool_bytes == int(H200 * 0.45) - weights - peak - graphs
    first_uses = weights + first.pool_bytes + peak + graphs
    # The second loads its weights beside the first, then sizes its pool.
    free = H200 - first_uses - weights
    second = kv_pool_bytes(H200, free, weights, peak, graphs, 0.9, fraction=0.5)
    assert second.pool_bytes == first.pool_bytes > 0
    assert first_uses + weights + second.pool_bytes + peak + graphs <= 0.9 * H200


def test_what_the_card_has_free_bounds_the_pool() -> None:
    # Another process holds most of the card: this engine's budget would overcommit it.
    crowded = kv_pool_bytes(H200, 30 * GiB, GiB, GiB, 512 * MiB, 0.9, fraction=0.5)
    assert crowded.limited_by_free_memory
    assert crowded.pool_bytes == 30 * GiB - GiB - 512 * MiB
    assert "bounded by free memory on the card" in crowded.describe(10, 16)


def test_no_room_gives_an_empty_pool_not_a_negative_one() -> None:
    budget = kv_pool_bytes(16 * GiB, 15 * GiB, 15 * GiB, GiB, 0, 0.9)
    assert budget.by_budget_bytes < 0
    assert budget.pool_bytes == 0
    assert "KV pool 0.00 GiB" in budget.describe(0, 16)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"utilization": 0.0}, "gpu_memory_utilization"),
        ({"utilization": 1.5}, "gpu_memory_utilization"),
        ({"fraction": 0.0}, "GPU share"),
        ({"activation_peak": -1}, "activation_peak"),
        ({"free": 200 * GiB}, "exceeds total"),
    ],
)
def test_bad_inputs_are_refused(kwargs: dict, message: str) -> None:
    args = dict(
        total=H200,
        free=H200,
        used_by_weights=0,
        activation_peak=0,
        graph_reserve=0,
        utilization=0.9,
        fraction=1.0,
    )
    with pytest.raises(ValueError, match=message):
        kv_pool_bytes(**{**args, **kwargs})


def test_describe_names_every_part() -> None:
    budget = kv_pool_bytes(H200, H200, 16 * GiB, 2 * GiB, 512 * MiB, 0.9)
    line = budget.describe(num_blocks=1000, block_size=16)
    for part in ("1000 blocks", "16000 tokens", "weights 16.00 GiB", "activation peak 2.00 GiB"):
        assert part in line
    assert "CUDA graphs 0.50 GiB" in line and "bounded by the budget" in line


def test_blocks_leave_room_for_the_padding_block() -> None:
    assert num_pool_blocks(10 * 1024, 1024) == 10
    assert num_pool_blocks(10 * 1024 + 1023, 1024, num_extra_blocks=1) == 9
    assert num_pool_blocks(512, 1024, num_extra_blocks=1) == 0
    with pytest.raises(ValueError, match="block_bytes"):
        num_pool_blocks(1024, 0)


def test_batch_limit_for_a_pool() -> None:
    assert default_max_num_seqs(10**6, 2048, sized_by_memory=False) == DEFAULT_MAX_NUM_SEQS
    assert default_max_num_seqs(200 * 1024, 2048, sized_by_memory=True) == 200
    assert default_max_num_seqs(10**8, 2048, sized_by_memory=True) == 1024
    assert default_max_num_seqs(10**8, 512, sized_by_memory=True) == 512  # the step's budget
    assert default_max_num_seqs(100, 2048, sized_by_memory=True) == 1  # never 0
    assert profile_num_seqs(None, 2048) == 1024
    assert profile_num_seqs(None, 100) == 100
    assert profile_num_seqs(8, 2048) == 8


def test_config_defaults_and_validation() -> None:
    assert CacheConfig().kv_cache_memory_bytes is None
    assert SchedulerConfig().max_num_seqs is None
    config = EngineConfig()
    assert (config.gpu_memory_utilization, config.gpu_share) == (0.9, 1.0)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=0.0)
    with pytest.raises(ValueError, match="gpu_share"):
        EngineConfig(gpu_share=1.5)
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        CacheConfig(kv_cache_memory_bytes=0)
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)


def test_only_cuda_without_a_size_is_sized_by_memory() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert sizes_by_memory(EngineConfig(), cuda)
    assert not sizes_by_memory(EngineConfig(), cpu)
    assert not sizes_by_memory(EngineConfig(cache=CacheConfig(kv_cache_memory_bytes=GiB)), cuda)
    assert not sizes_by_memory(EngineConfig(cache=CacheConfig(num_blocks=64)), cuda)


def test_a_cpu_pool_keeps_its_fixed_gib_and_batch_limit() -> None:
    mc = make_model_config()
    config = EngineConfig()
    pool = size_kv_pool(config, mc, torch.float32)
    assert pool.num_blocks == CPU_KV_CACHE_BYTES // (mc.kv_bytes_per_token(4) * 16)
    assert with_batch_limit(config, pool, by_memory=False).scheduler.max_num_seqs == 64
    explicit = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=8))
    assert with_batch_limit(explicit, pool, by_memory=True) is explicit
    by_memory = with_batch_limit(config, KVPoolSize(1000, torch.bfloat16, 512), by_memory=True)
    assert by_memory.scheduler.max_num_seqs == 1000 * 16 // 1024


def test_the_engine_on_cpu_is_as_before(tmp_path: Path) -> None:
    from engine.engine import Engine

    folder = make_tiny_checkpoint(tmp_path / "tiny", weights=False)
    engine = Engine(EngineConfig(model=str(folder), load_format="dummy"))
    bytes_per_block = engine.model_config.kv_bytes_per_token(4) * 16
    assert engine.kv.num_blocks == CPU_KV_CACHE_BYTES // bytes_per_block
    assert engine.config.scheduler.max_num_seqs == DEFAULT_MAX_NUM_SEQS
    assert engine.scheduler.config.max_num_seqs == DEFAULT_MAX_NUM_SEQS


def test_the_profiling_step_runs_on_the_torch_backend() -> None:
    """Its inputs on CPU: prompts cut at max_model_len, a batch of logits, every filter."""
    mc = make_model_config(max_position_embeddings=40)
    model = random_model(mc, 40, "cpu", torch.float32)
    scheduler = SchedulerConfig(max_num_batched_tokens=100, max_num_seqs=None)
    config = EngineConfig(scheduler=scheduler, attention_backend="torch")
    probe_bytes = run_profile_step(config, model, mc, torch.device("cpu"), torch.float32)
    num_blocks = 3 + 3 + 2  # sequences of 40, 40 and 20 tokens in blocks of 16
    assert probe_bytes == num_blocks * mc.kv_bytes_per_token(4) * 16


def test_weights_count_each_storage_once() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4, bias=False))
    model[1].weight = model[0].weight  # tied
    model[0].weight_view = model[0].weight.detach()[:2]  # a view: no bytes of its own
    model[1].scale = torch.ones(10)  # a plain tensor attribute (a quantization scale, say)
    assert model_tensor_bytes(model, "cpu") == (16 + 4) * 4 + 10 * 4
    assert model_tensor_bytes(model) == 0  # nothing on a GPU


def test_the_memory_wrapper_turns_the_measures_into_blocks(monkeypatch, capsys) -> None:
    """The glue around the CUDA calls, with the measures stubbed (mem_get_info is free, total)."""
    mc = make_model_config()
    block_bytes = mc.kv_bytes_per_token(2) * 16
    total, free = 1000 * block_bytes, 900 * block_bytes
    monkeypatch.setattr(backend_builder, "_activation_peak", lambda *args: 100 * block_bytes)
    monkeypatch.setattr(backend_builder, "model_tensor_bytes", lambda model: 50 * block_bytes)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    config = EngineConfig(gpu_memory_utilization=0.5, attention_backend="torch", cuda_graph=False)
    pool = size_kv_pool_by_memory(config, None, mc, torch.device("cpu"), torch.bfloat16)
    assert pool.num_blocks == 500 - 50 - 100
    assert pool.max_model_len == min(350 * 16, mc.max_position_embeddings)
    assert "350 blocks" in capsys.readouterr().err
    with pytest.raises(ValueError, match="no GPU memory left for the KV cache"):
        size_kv_pool_by_memory(
            EngineConfig(gpu_memory_utilization=0.1, attention_backend="torch"),
            None,
            mc,
            torch.device("cpu"),
            torch.bfloat16,
        )


def test_graph_reserve_is_the_decode_graphs_reserve() -> None:
    assert graph_reserve_bytes(True) == GRAPH_RESERVE_BYTES
    assert graph_reserve_bytes(True, True) == GRAPH_RESERVE_BYTES + MIXED_GRAPH_RESERVE_BYTES
    assert graph_reserve_bytes(False) == 0  # no graphs at all without cuda_graph
    assert graph_reserve_bytes(False, True) == 0
