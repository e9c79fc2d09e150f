"""Builds an engine's device side: sizes the KV pool, allocates its storage, picks the attention
backend and captures the decode CUDA graphs. Owns no state: the engine keeps what it returns.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from engine.attention.base import AttentionBackend
from engine.attention.flashinfer_backend import FlashInferAttention, choose_backend
from engine.attention.torch_backend import TorchAttention
from engine.config import EngineConfig, ModelConfig
from engine.cuda_graph import CUDAGraphDecoder

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class KVPoolSize(NamedTuple):
    """The pool's blocks, their dtype, and the longest sequence the engine serves."""

    num_blocks: int
    kv_dtype: torch.dtype
    max_model_len: int


class DeviceSide(NamedTuple):
    """What runs a step on the device."""

    name: str  # "torch" or "flashinfer"
    # The blocks the KV manager hands out; FlashInfer's storage has one padding block past them.
    kv_cache: torch.Tensor
    attention: AttentionBackend
    graphs: CUDAGraphDecoder | None  # decode graphs (FlashInfer with cuda_graph only)


def resolve_device(name: str) -> torch.device:
    """A device name; "auto" is cuda when torch sees a GPU, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """A dtype name; "auto" is bfloat16 on CUDA and float32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"dtype must be auto or one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


def size_kv_pool(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype) -> KVPoolSize:
    """Blocks from the config (or its memory budget); max_model_len fits the pool, the model's
    positions, the configured limit and the sliding window."""
    kv_dtype = torch.float8_e4m3fn if config.cache.kv_cache_dtype == "fp8" else dtype
    block_size = config.cache.block_size
    num_blocks = config.cache.num_blocks or max(
        1,
        config.cache.kv_cache_memory_bytes
        // (model_config.kv_bytes_per_token(kv_dtype.itemsize) * block_size),
    )
    limits = [num_blocks * block_size, model_config.max_position_embeddings]
    limits += [x for x in (config.scheduler.max_model_len, model_config.sliding_window) if x]
    return KVPoolSize(num_blocks, kv_dtype, min(limits))


def build_backend(
    config: EngineConfig,
    model: nn.Module,
    model_config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    pool: KVPoolSize,
) -> DeviceSide:
    """Allocate the KV storage and build the attention backend (and graphs) over it."""
    name = choose_backend(config.attention_backend, device, dtype)
    use_flashinfer = name == "flashinfer"
    if pool.kv_dtype != dtype and not use_flashinfer:
        raise ValueError(
            "kv_cache_dtype fp8 needs the flashinfer attention backend (a CUDA device with "
            f"FlashInfer installed); this engine runs the {name} backend"
        )
    if hasattr(model, "use_fused_ops"):
        model.use_fused_ops(use_flashinfer)  # FlashInfer's fused norm and activation
    mc = model_config
    # FlashInfer: one extra block past the pool, which padded CUDA-graph rows write to.
    num_storage_blocks = pool.num_blocks + 1 if use_flashinfer else pool.num_blocks
    block_size = config.cache.block_size
    shape = (num_storage_blocks, mc.num_layers, 2, mc.num_kv_heads, block_size, mc.head_dim)
    kv_storage = torch.zeros(shape, dtype=pool.kv_dtype, device=device)
    kv_cache = kv_storage[: pool.num_blocks]
    if not use_flashinfer:
        attention = TorchAttention(kv_cache, mc.num_heads, mc.head_dim)
        return DeviceSide(name, kv_cache, attention, None)
    flashinfer = FlashInferAttention(kv_storage, mc.num_heads, mc.head_dim, dtype)
    graphs = None
    if config.cuda_graph:
        max_num_seqs = config.scheduler.max_num_seqs
        graphs = CUDAGraphDecoder(
            model, flashinfer, max_num_seqs, pool.max_model_len, pool.num_blocks
        )
    return DeviceSide(name, kv_cache, flashinfer, graphs)
