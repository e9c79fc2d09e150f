"""The one EngineConfig builder of the bench scripts: flat keyword settings, with engine.config's
own defaults for whatever a script leaves out; stateless and torch-free.
"""

from __future__ import annotations

from engine.config import CacheConfig, EngineConfig, SchedulerConfig

_ENGINE, _CACHE, _SCHEDULER = EngineConfig(), CacheConfig(), SchedulerConfig()


def engine_config(
    model: str = _ENGINE.model,
    *,
    device: str = _ENGINE.device,
    dtype: str = _ENGINE.dtype,
    load_format: str = _ENGINE.load_format,
    cuda_graph: bool = _ENGINE.cuda_graph,
    async_scheduling: bool | None = _ENGINE.async_scheduling,
    block_size: int = _CACHE.block_size,
    num_blocks: int | None = _CACHE.num_blocks,
    kv_cache_memory_bytes: int | None = _CACHE.kv_cache_memory_bytes,
    kv_cache_dtype: str = _CACHE.kv_cache_dtype,
    host_kv_cache_bytes: int = _CACHE.host_kv_cache_bytes,
    max_num_batched_tokens: int = _SCHEDULER.max_num_batched_tokens,
    max_num_seqs: int | None = _SCHEDULER.max_num_seqs,
    max_model_len: int | None = _SCHEDULER.max_model_len,
    tensor_parallel_size: int = _ENGINE.tensor_parallel_size,
) -> EngineConfig:
    """An EngineConfig; num_blocks None sizes the KV pool from kv_cache_memory_bytes (None too:
    from the GPU memory left), max_num_seqs None takes the engine's default for that pool."""
    cache = CacheConfig(
        block_size=block_size,
        num_blocks=num_blocks,
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        kv_cache_dtype=kv_cache_dtype,
        host_kv_cache_bytes=host_kv_cache_bytes,
    )
    scheduler = SchedulerConfig(
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
    )
    return EngineConfig(
        model,
        cache,
        scheduler,
        device=device,
        dtype=dtype,
        load_format=load_format,
        cuda_graph=cuda_graph,
        async_scheduling=async_scheduling,
        tensor_parallel_size=tensor_parallel_size,
    )


def gib(num_gib: float) -> int:
    """Bytes in num_gib GiB (for kv_cache_memory_bytes)."""
    return int(num_gib * (1 << 30))
