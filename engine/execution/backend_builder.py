"""Builds an engine's device side: sizes the KV pool (fixed, or from the GPU memory left after
the weights and a profiling step), allocates its storage, picks the attention backend and
captures the decode CUDA graphs. Owns no state: the engine keeps what it returns.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import replace
from itertools import chain
from typing import NamedTuple, TypeVar

import torch
from torch import nn

from engine.attention.base import AttentionBackend, AttentionMetadata, SeqSpan
from engine.attention.flashinfer_backend import (
    FLASHINFER_HEAD_DIMS,
    FlashInferAttention,
    choose_backend,
)
from engine.attention.torch_backend import TorchAttention
from engine.config import EngineConfig, ModelConfig
from engine.execution.cuda_graph import CUDAGraphDecoder
from engine.execution.host_tensors import index_tensor
from engine.execution.memory_budget import (
    CPU_KV_CACHE_BYTES,
    MiB,
    default_max_num_seqs,
    graph_reserve_bytes,
    kv_pool_bytes,
    num_pool_blocks,
    profile_num_seqs,
)
from engine.execution.mixed_graphs import MixedStepGraphs, mixed_graphs_for
from engine.sampling.sample_row import SampleRow
from engine.sampling.sampler import Sampler
from engine.sampling.sampling_params import SamplingParams
from engine.say import say

T = TypeVar("T")

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
    mixed: MixedStepGraphs | None = None  # the mixed steps' graphs (None: they run eager)


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


def sizes_by_memory(config: EngineConfig, device: torch.device) -> bool:
    """True when the pool takes what the GPU has left (CUDA, no num_blocks, no byte size)."""
    cache = config.cache
    return (
        device.type == "cuda" and cache.num_blocks is None and cache.kv_cache_memory_bytes is None
    )


def model_len_limit(
    config: EngineConfig, model_config: ModelConfig, pool_tokens: int | None = None
) -> int:
    """The longest sequence: the model's positions, the configured limit, the sliding window and
    (once known) the pool's tokens."""
    limits = [model_config.context_len]
    limits += [x for x in (config.scheduler.max_model_len, pool_tokens) if x is not None]
    return min(limits)


def _kv_dtype(config: EngineConfig, dtype: torch.dtype) -> torch.dtype:
    return torch.float8_e4m3fn if config.cache.kv_cache_dtype == "fp8" else dtype


def size_kv_pool(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype) -> KVPoolSize:
    """A fixed-size pool: blocks from the config (or its byte size, 1 GiB when unset); its
    max_model_len fits the pool as well as model_len_limit."""
    kv_dtype = _kv_dtype(config, dtype)
    block_size = config.cache.block_size
    num_bytes = config.cache.kv_cache_memory_bytes or CPU_KV_CACHE_BYTES
    num_blocks = config.cache.num_blocks or max(
        1, num_bytes // (model_config.kv_bytes_per_token(kv_dtype.itemsize) * block_size)
    )
    return KVPoolSize(
        num_blocks, kv_dtype, model_len_limit(config, model_config, num_blocks * block_size)
    )


def with_batch_limit(config: EngineConfig, pool: KVPoolSize, by_memory: bool) -> EngineConfig:
    """config with max_num_seqs set: the one given, else the default for this pool."""
    scheduler = config.scheduler
    if scheduler.max_num_seqs is not None:
        return config
    pool_tokens = pool.num_blocks * config.cache.block_size
    num_seqs = default_max_num_seqs(pool_tokens, scheduler.max_num_batched_tokens, by_memory)
    return replace(config, scheduler=replace(scheduler, max_num_seqs=num_seqs))


def size_kv_pool_by_memory(
    config: EngineConfig,
    model: nn.Module,
    model_config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
) -> KVPoolSize:
    """A pool sized by GPU memory (memory_budget.kv_pool_bytes), measured with the model loaded:
    its tensors, one profiling step at the token budget, what the card has free now."""
    kv_dtype = _kv_dtype(config, dtype)
    block_size = config.cache.block_size
    backend = choose_backend(config.attention_backend, device, dtype, model_config.head_dim)
    activation_peak = _activation_peak(config, model, model_config, device, dtype)
    free, total = torch.cuda.mem_get_info(device)
    decode_graphs = config.cuda_graph and backend == "flashinfer"
    graph_reserve = graph_reserve_bytes(
        decode_graphs, decode_graphs and mixed_graphs_for(model) is None
    )
    budget = kv_pool_bytes(
        total,
        free,
        model_tensor_bytes(model),
        activation_peak,
        graph_reserve,
        config.gpu_memory_utilization,
        config.gpu_share,
    )
    block_bytes = model_config.kv_bytes_per_token(kv_dtype.itemsize) * block_size
    num_blocks = num_pool_blocks(budget.pool_bytes, block_bytes, int(backend == "flashinfer"))
    if num_blocks < 1:
        raise ValueError(
            f"no GPU memory left for the KV cache: {budget.describe(0, block_size)}; raise "
            "gpu_memory_utilization or lower max_num_batched_tokens, or set kv_cache_memory_bytes"
        )
    say(budget.describe(num_blocks, block_size))
    pool_tokens = num_blocks * block_size
    return KVPoolSize(num_blocks, kv_dtype, model_len_limit(config, model_config, pool_tokens))


def model_tensor_bytes(model: nn.Module, device_type: str = "cuda") -> int:
    """Bytes of the model's tensors on devices of device_type: parameters, buffers and plain
    tensor attributes (quantization scales, say), each storage once (views, tied weights)."""
    tensors = chain(model.parameters(), model.buffers())
    attributes = (v for m in model.modules() for v in vars(m).values())
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in chain(tensors, attributes)
        if isinstance(t, torch.Tensor) and t.device.type == device_type
    }
    return sum(storages.values())


def _activation_peak(
    config: EngineConfig,
    model: nn.Module,
    model_config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
) -> int:
    """Peak bytes a step at the token budget allocates beyond what is held before it (the
    throw-away pool of run_profile_step left out; the attention workspace counted)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    probe_bytes = run_profile_step(config, model, model_config, device, dtype)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before - probe_bytes
    gc.collect()  # the throw-away pool and workspace, should a reference cycle hold them
    torch.cuda.empty_cache()
    return max(0, peak)


@torch.inference_mode()
def run_profile_step(
    config: EngineConfig,
    model: nn.Module,
    model_config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
) -> int:
    """Run the largest step the engine can schedule, over a throw-away KV pool just large enough
    for it: max_num_batched_tokens prompt tokens (in sequences of at most max_model_len), the
    logits of a full batch (profile_num_seqs rows) and their sampling with every filter and
    logprobs on. Returns the throw-away pool's storage bytes (freed when this returns)."""
    block_size = config.cache.block_size
    max_len = model_len_limit(config, model_config)
    num_tokens = config.scheduler.max_num_batched_tokens
    lens = [min(max_len, num_tokens - start) for start in range(0, num_tokens, max_len)]
    seqs, slot_block_ids, slot_offsets = [], [], []
    for n in lens:
        first = sum(len(seq.block_ids) for seq in seqs)
        block_ids = list(range(first, first + -(-n // block_size)))
        seqs.append(SeqSpan(len(slot_block_ids), n, n, block_ids))
        slot_block_ids += [block_ids[p // block_size] for p in range(n)]
        slot_offsets += [p % block_size for p in range(n)]
    probe = KVPoolSize(sum(len(seq.block_ids) for seq in seqs), _kv_dtype(config, dtype), max_len)
    no_graphs = replace(config, cuda_graph=False)
    side = build_backend(no_graphs, model, model_config, device, dtype, probe, memory_probe=True)
    slots = index_tensor([slot_block_ids, slot_offsets], device=device)
    side.attention.plan(AttentionMetadata(seqs, slots[0], slots[1], block_size))
    positions = index_tensor([p for n in lens for p in range(n)], device=device)
    hidden = model(torch.zeros_like(positions), positions, side.attention)
    num_rows = profile_num_seqs(config.scheduler.max_num_seqs, num_tokens)
    logits = model.compute_logits(hidden[index_tensor(list(range(num_rows)), device=device)])
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05, logprobs=True)
    Sampler(device, seed=0).sample(logits, [SampleRow(params, None)] * num_rows).result()
    return side.kv_cache.untyped_storage().nbytes()


def build_backend(
    config: EngineConfig,
    model: nn.Module,
    model_config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    pool: KVPoolSize,
    memory_probe: bool = False,
) -> DeviceSide:
    """Allocate the KV storage and build the attention backend (and graphs) over it
    (memory_probe: the memory probe's backend, which logs nothing)."""
    name = choose_backend(config.attention_backend, device, dtype, model_config.head_dim)
    use_flashinfer = name == "flashinfer"
    head_dim = model_config.head_dim
    odd_head = device.type == "cuda" and head_dim not in FLASHINFER_HEAD_DIMS
    if odd_head and not memory_probe:  # said, not silent: no graphs, slower attention
        say(
            f"head_dim {head_dim} is not one FlashInfer runs "
            f"{FLASHINFER_HEAD_DIMS}: the torch attention backend, without CUDA graphs"
        )
    if pool.kv_dtype != dtype and not use_flashinfer:
        raise ValueError(
            "kv_cache_dtype fp8 needs the flashinfer attention backend (a CUDA device with "
            f"FlashInfer installed); this engine runs the {name} backend"
        )
    if hasattr(model, "use_fused_ops"):
        model.use_fused_ops(use_flashinfer)  # FlashInfer's fused norm and activation
    # The fused GEMVs compile now, not mid-serving, and before the pool is allocated: their
    # warm-up's zeros go back to the device.
    warm_up = getattr(model, "warm_up_fused_gemvs", None)
    if use_flashinfer and not memory_probe and warm_up is not None and warm_up():
        torch.cuda.empty_cache()
    # Likewise the MoE experts' Triton kernels for the prefill step sizes (a no-op off CUDA).
    warm_up_moe = getattr(model, "warm_up_moe", None)
    wanted = not memory_probe and warm_up_moe is not None
    if wanted and warm_up_moe(config.scheduler.max_num_batched_tokens) and device.type == "cuda":
        torch.cuda.empty_cache()
    mc = model_config
    # FlashInfer: one extra block past the pool, which padded CUDA-graph rows write to.
    num_storage_blocks = pool.num_blocks + 1 if use_flashinfer else pool.num_blocks
    block_size = config.cache.block_size
    shape = (num_storage_blocks, mc.num_layers, 2, mc.num_kv_heads, block_size, mc.head_dim)
    kv_storage = torch.zeros(shape, dtype=pool.kv_dtype, device=device)
    kv_cache = kv_storage[: pool.num_blocks]
    if not use_flashinfer:
        use_kernel = config.settings.cpu_kernel
        if not use_kernel and not memory_probe and device.type == "cpu":
            say(
                "KVRELAY_CPU_KERNEL=0: decode attention uses the slower torch "
                "gather path instead of the C++ kernel"
            )
        attention = TorchAttention(
            kv_cache,
            mc.num_heads,
            mc.head_dim,
            use_kernel,
            scale=mc.attention_scale,
            windows=mc.layer_windows,
        )
        return DeviceSide(name, kv_cache, attention, None)
    kv_scales = getattr(model, "kv_scales", None) if pool.kv_dtype != dtype else None
    flashinfer = FlashInferAttention(
        kv_storage,
        mc.num_heads,
        mc.head_dim,
        dtype,
        kv_scales=kv_scales,
        scale=mc.attention_scale,
        windows=mc.layer_windows,
    )
    graphs = None
    if config.cuda_graph:
        max_num_seqs = config.scheduler.max_num_seqs
        if max_num_seqs is None:
            raise ValueError("build_backend needs max_num_seqs (see with_batch_limit)")
        graphs, took = _with_memory_taken(
            device,
            lambda: CUDAGraphDecoder(
                model, flashinfer, max_num_seqs, pool.max_model_len, pool.num_blocks
            ),
        )
        say(f"{len(graphs.sizes)} decode CUDA graphs took {took:.0f} MiB")
    mixed = None
    if config.cuda_graph and not memory_probe:
        mixed = _mixed_graphs(model, flashinfer, config.scheduler.max_num_batched_tokens, device)
    return DeviceSide(name, kv_cache, flashinfer, graphs, mixed)


def _mixed_graphs(
    model: nn.Module, attention: FlashInferAttention, max_tokens: int, device: torch.device
) -> MixedStepGraphs | None:
    """The mixed steps' graphs, or None with the reason said (those steps then run eager)."""
    why = mixed_graphs_for(model)
    if why is None:
        try:
            mixed, took = _with_memory_taken(
                device, lambda: MixedStepGraphs(model, attention, max_tokens)
            )
        except Exception as error:  # said, not silent: the steps run eager as without it
            why = f"their capture failed ({error!r})"
        else:
            say(
                f"mixed-step graphs for {len(mixed.sizes)} token counts (up to "
                f"{mixed.sizes[-1]}) took {took:.0f} MiB"
            )
            return mixed
    say(f"steps carrying a prompt run eager: {why}")
    return None


def _with_memory_taken(device: torch.device, build: Callable[[], T]) -> tuple[T, float]:
    """build()'s result and the MiB of device memory the allocator reserved while it ran."""
    reserved = torch.cuda.memory_reserved(device)
    built = build()
    return built, (torch.cuda.memory_reserved(device) - reserved) / MiB
