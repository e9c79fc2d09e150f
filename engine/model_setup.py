"""Loads an engine's model (or checks the one it shares) and sizes its KV pool, in the order that
sizing by GPU memory needs: the weights first, then the pool from what memory they leave. Owns no
state.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from engine.backend_builder import (
    KVPoolSize,
    model_len_limit,
    resolve_dtype,
    size_kv_pool,
    size_kv_pool_by_memory,
    sizes_by_memory,
    with_batch_limit,
)
from engine.config import EngineConfig, ModelConfig
from engine.loader import load_model


class LoadedModel(NamedTuple):
    model: nn.Module
    pool: KVPoolSize
    config: EngineConfig  # the engine's, its batch limit (max_num_seqs) set from the pool
    dtype: torch.dtype


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
            folder, model_config, model_len, device, dtype, config.load_format, config.quantization
        )
    elif model.rope.cos.shape[0] < model_len:
        raise ValueError("the shared model's rotary table is shorter than max_model_len")
    if pool is None:
        pool = size_kv_pool_by_memory(config, model, model_config, device, dtype)
    return LoadedModel(model, pool, with_batch_limit(config, pool, by_memory), dtype)
