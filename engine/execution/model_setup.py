"""Sets up an engine's device side in the order that sizing by GPU memory needs: loads the model
(or checks the one it shares), sizes the KV pool from what memory the weights leave, then builds
the backend, the block copier and the KV manager over it. Owns no state: the engine keeps them.
With tensor parallelism every rank builds its model shard, pool and backend (build_rank_side);
rank 0 alone adds the KV manager, and a block copier that sends its copies to the others.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from engine.config import EngineConfig, ModelConfig
from engine.execution.backend_builder import (
    DeviceSide,
    KVPoolSize,
    build_backend,
    model_len_limit,
    resolve_dtype,
    size_kv_pool,
    size_kv_pool_by_memory,
    sizes_by_memory,
    with_batch_limit,
)
from engine.execution.block_copies import BlockCopies
from engine.execution.disk_setup import build_disk_tier
from engine.kv_cache.manager import KVCacheManager
from engine.models.loader import load_model
from engine.parallel.leader import Leader, LeaderCopies
from engine.parallel.tensor_parallel import (
    SINGLE,
    TensorParallel,
    rank_engine_config,
    rank_model_config,
)


class LoadedModel(NamedTuple):
    model: nn.Module
    pool: KVPoolSize
    config: EngineConfig  # the engine's, its batch limit (max_num_seqs) set from the pool
    dtype: torch.dtype


class RankSide(NamedTuple):
    """What every rank of an engine builds: its model (shard), pool and backend."""

    config: EngineConfig  # the engine's, its batch limit set (rank_engine_config at TP > 1)
    model: nn.Module
    max_model_len: int
    backend: DeviceSide


class DeviceParts(NamedTuple):
    config: EngineConfig  # the engine's, its batch limit (max_num_seqs) set from the pool
    model: nn.Module
    max_model_len: int
    backend: DeviceSide
    copies: BlockCopies
    kv: KVCacheManager


def build_device_parts(
    config: EngineConfig,
    model_config: ModelConfig,
    folder: Path,
    device: torch.device,
    model: nn.Module | None = None,
    leader: Leader | None = None,
) -> DeviceParts:
    """An engine's model, KV pool and what runs a step over them (see load_and_size).
    leader: rank 0's side of a tensor-parallel group (None: one rank)."""
    tp = SINGLE if leader is None else leader.tp
    config, model, max_model_len, backend = build_rank_side(
        config, model_config, folder, device, model, tp
    )
    host_bytes = config.cache.host_kv_cache_bytes
    if leader is None:
        copies = BlockCopies(backend.kv_cache, host_bytes)
    else:
        copies = LeaderCopies(leader, backend.kv_cache, host_bytes)
    slots, events = copies.num_host_slots, config.record_kv_events
    num_blocks, model_id = backend.kv_cache.shape[0], model_config.model_id
    disk = build_disk_tier(
        config.cache, model_id, backend.kv_cache, events, config.settings.cache_dir, leader
    )
    kv = KVCacheManager.from_config(config.cache, num_blocks, model_id, events, slots, disk)
    return DeviceParts(config, model, max_model_len, backend, copies, kv)


def build_rank_side(
    config: EngineConfig,
    model_config: ModelConfig,
    folder: Path,
    device: torch.device,
    model: nn.Module | None = None,
    tp: TensorParallel = SINGLE,
) -> RankSide:
    """One rank's model, pool and backend; every rank of a group calls it with the same
    config (the pool's size is agreed between them)."""
    config = rank_engine_config(config)
    model, pool, config, dtype = load_and_size(config, model_config, folder, device, model, tp)
    rank_config = rank_model_config(model_config, tp)  # its heads: its KV cache
    backend = build_backend(config, model, rank_config, device, dtype, pool)
    return RankSide(config, model, pool.max_model_len, backend)


def load_and_size(
    config: EngineConfig,
    model_config: ModelConfig,
    folder: Path,
    device: torch.device,
    model: nn.Module | None = None,
    tp: TensorParallel = SINGLE,
) -> LoadedModel:
    """model: weights already loaded from the same checkpoint (shared across engines); its
    rotary table must cover the pool's max_model_len. tp: the rank whose shard is loaded;
    the pool holds its KV heads, as many blocks on every rank (the least any rank sized)."""
    dtype = resolve_dtype(config.dtype, device)
    by_memory = sizes_by_memory(config, device)
    rank_config = rank_model_config(model_config, tp)
    # A pool sized by GPU memory is known only once the weights are in.
    pool = None if by_memory else size_kv_pool(config, rank_config, dtype)
    model_len = model_len_limit(config, model_config) if pool is None else pool.max_model_len
    if model is not None and tp.is_parallel:
        raise ValueError("a tensor-parallel engine loads its own shards: pass no shared model")
    if model is None:
        model = load_model(
            folder,
            model_config,
            model_len,
            device,
            dtype,
            config.load_format,
            config.quantization,
            config.settings.fp8_fast_accum,
            tp,
        )
    elif model.rope.cos.shape[0] < model_len:
        raise ValueError("the shared model's rotary table is shorter than max_model_len")
    tp.min_over_ranks(0)  # every rank's weights are in before any step's collectives
    if pool is None:
        pool = size_kv_pool_by_memory(config, model, rank_config, device, dtype)
    if tp.is_parallel:
        num_blocks = tp.min_over_ranks(pool.num_blocks)
        pool_tokens = num_blocks * config.cache.block_size
        max_len = model_len_limit(config, model_config, pool_tokens)
        pool = pool._replace(num_blocks=num_blocks, max_model_len=max_len)
    return LoadedModel(model, pool, with_batch_limit(config, pool, by_memory), dtype)
