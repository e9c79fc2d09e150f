"""Sets up an engine's device side in the order that sizing by GPU memory needs: loads the model
(or checks the one it shares), sizes the KV pool from what memory the weights leave, then builds
the backend, the block copier and the KV manager over it. Owns no state: the engine keeps them.
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
from engine.kv_cache.manager import KVCacheManager
from engine.models.loader import load_model


class LoadedModel(NamedTuple):
    model: nn.Module
    pool: KVPoolSize
    config: EngineConfig  # the engine's, its batch limit (max_num_seqs) set from the pool
    dtype: torch.dtype


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
) -> DeviceParts:
    """An engine's model, KV pool and what runs a step over them (see load_and_size)."""
    model, pool, config, dtype = load_and_size(config, model_config, folder, device, model)
    backend = build_backend(config, model, model_config, device, dtype, pool)
    copies = BlockCopies(backend.kv_cache, config.cache.host_kv_cache_bytes)
    slots, events = copies.num_host_slots, config.record_kv_events
    kv = KVCacheManager.from_config(
        config.cache, pool.num_blocks, model_config.model_id, events, slots
    )
    return DeviceParts(config, model, pool.max_model_len, backend, copies, kv)


def load_and_size(
    config: EngineConfig,
    model_config: ModelConfig,
    folder: Path,
    device: torch.device,
    model: nn.Module | None = None,
) -> LoadedModel:
    """model: weights already loaded from the same checkpoint (shared across engines); its
    rotary table must cover the pool's max_model_len."""
    dtype = resolve_dtype(config.dtype, device)
    by_memory = sizes_by_memory(config, device)
    # A pool sized by GPU memory is known only once the weights are in.
    pool = None if by_memory else size_kv_pool(config, model_config, dtype)
    model_len = model_len_limit(config, model_config) if pool is None else pool.max_model_len
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
        )
    elif model.rope.cos.shape[0] < model_len:
        raise ValueError("the shared model's rotary table is shorter than max_model_len")
    if pool is None:
        pool = size_kv_pool_by_memory(config, model, model_config, device, dtype)
    return LoadedModel(model, pool, with_batch_limit(config, pool, by_memory), dtype)
