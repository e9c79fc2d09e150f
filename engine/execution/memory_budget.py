"""KV pool sizing arithmetic (pure, torch-free, owns no state): the bytes a pool sized by GPU
memory may take, and the batch limit (max_num_seqs) an engine picks for its pool.

An engine on a GPU may use `utilization * share` of the card's memory: `share` is the part of
the card it was given (1 alone, 0.5 when two workers share it). From that budget go the weights,
the activation peak of the largest step and a reserve for the decode CUDA graphs; the rest is
the KV pool, and never more than the card has free now (other processes, other engines on it) once
the activation peak and the graphs are set aside again.
"""

from __future__ import annotations

from typing import NamedTuple

GiB = 1 << 30
MiB = 1 << 20
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
CPU_KV_CACHE_BYTES = 1 << 30  # a CPU pool is fixed: the host's free memory is not ours to take
GRAPH_RESERVE_BYTES = 512 << 20  # decode CUDA graphs' pool and static buffers (measured: less)
MIXED_GRAPH_RESERVE_BYTES = 256 << 20  # mixed-step graphs (measured: 118 MiB, 8B shape, H100)
DEFAULT_MAX_NUM_SEQS = 64  # a fixed-size pool's batch limit (CPU, or --kv-cache-gib / num_blocks)
MAX_AUTO_NUM_SEQS = 1024  # the largest batch limit an engine picks by itself
TYPICAL_CONTEXT_TOKENS = 1024  # auto batch limit: every running sequence may hold this many


class MemoryBudget(NamedTuple):
    """How a pool sized by GPU memory got its bytes (all figures in bytes, pool_bytes >= 0)."""

    total_bytes: int  # the card's memory
    free_bytes: int  # free on the card after the weights were loaded (every process counted)
    budget_bytes: int  # total * utilization * share: what this engine may use in all
    weights_bytes: int  # the model's tensors on the device
    activation_peak_bytes: int  # the largest step's transient memory (attention workspace too)
    graph_reserve_bytes: int  # decode CUDA graphs (0 without them)
    by_budget_bytes: int  # budget - weights - activation peak - graphs (may be < 0)
    by_free_bytes: int  # free - activation peak - graphs (may be < 0)
    pool_bytes: int  # max(0, min(by_budget, by_free))

    @property
    def limited_by_free_memory(self) -> bool:
        """True when what the card has free, not this engine's budget, bounds the pool."""
        return self.by_free_bytes < self.by_budget_bytes

    def describe(self, num_blocks: int, block_size: int) -> str:
        """One log line: the breakdown and what the pool holds."""
        bound = "free memory on the card" if self.limited_by_free_memory else "the budget"
        return (
            f"KV pool {_gib(self.pool_bytes)} ({num_blocks} blocks, {num_blocks * block_size} "
            f"tokens), bounded by {bound}: budget {_gib(self.budget_bytes)} of "
            f"{_gib(self.total_bytes)} - weights {_gib(self.weights_bytes)} - activation peak "
            f"{_gib(self.activation_peak_bytes)} - CUDA graphs {_gib(self.graph_reserve_bytes)}; "
            f"free {_gib(self.free_bytes)}"
        )


def check_fraction(name: str, value: float) -> None:
    """Raise ValueError unless 0 < value <= 1 (a memory utilization, a share of a GPU)."""
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{name} must be in (0, 1], got {value}")


def kv_pool_bytes(
    total: int,
    free: int,
    used_by_weights: int,
    activation_peak: int,
    graph_reserve: int,
    utilization: float,
    fraction: float = 1.0,
) -> MemoryBudget:
    """The KV pool's bytes on a card of `total` bytes with `free` free now.

    utilization: the part of the card kvrelay's engines on it may use together; fraction: this
    engine's part of it (its share of the GPU). Nothing is guessed: the caller measures the
    weights, the activation peak (one step at the batch token budget) and the graph reserve.
    """
    check_fraction("gpu_memory_utilization", utilization)
    check_fraction("the GPU share", fraction)
    for name, value in (
        ("total", total),
        ("free", free),
        ("used_by_weights", used_by_weights),
        ("activation_peak", activation_peak),
        ("graph_reserve", graph_reserve),
    ):
        if value < 0:
            raise ValueError(f"{name} must be >= 0 bytes, got {value}")
    if free > total:
        raise ValueError(f"free ({free}) exceeds total ({total})")
    budget = int(total * utilization * fraction)
    transient = activation_peak + graph_reserve
    by_budget = budget - used_by_weights - transient
    by_free = free - transient
    return MemoryBudget(
        total_bytes=total,
        free_bytes=free,
        budget_bytes=budget,
        weights_bytes=used_by_weights,
        activation_peak_bytes=activation_peak,
        graph_reserve_bytes=graph_reserve,
        by_budget_bytes=by_budget,
        by_free_bytes=by_free,
        pool_bytes=max(0, min(by_budget, by_free)),
    )


def graph_reserve_bytes(decode_graphs: bool, mixed_graphs: bool = False) -> int:
    """What CUDA graphs hold for good: the decode graphs' reserve, and the mixed-step graphs'
    (their pool and static buffers, captured after the KV pool is sized) where the model can
    replay its mixed steps on them (mixed_graphs.mixed_graphs_for)."""
    if not decode_graphs:
        return 0
    return GRAPH_RESERVE_BYTES + (MIXED_GRAPH_RESERVE_BYTES if mixed_graphs else 0)


def num_pool_blocks(pool_bytes: int, block_bytes: int, num_extra_blocks: int = 0) -> int:
    """Blocks the KV manager hands out when the storage (those plus num_extra_blocks, e.g.
    FlashInfer's padding block) must fit in pool_bytes; may be 0 (the caller refuses that)."""
    if block_bytes < 1:
        raise ValueError(f"block_bytes must be >= 1, got {block_bytes}")
    return max(0, pool_bytes // block_bytes - num_extra_blocks)


def profile_num_seqs(max_num_seqs: int | None, max_num_batched_tokens: int) -> int:
    """Rows the profiling step samples: the batch limit, or the largest one the engine may pick
    (a decode step of max_num_seqs rows samples them all; a step has at most its token budget)."""
    limit = MAX_AUTO_NUM_SEQS if max_num_seqs is None else max_num_seqs
    return max(1, min(limit, max_num_batched_tokens))


def default_max_num_seqs(
    pool_tokens: int, max_num_batched_tokens: int, sized_by_memory: bool
) -> int:
    """The batch limit when none is given.

    A fixed-size pool (CPU, an explicit size) keeps DEFAULT_MAX_NUM_SEQS. A pool sized by GPU
    memory gets one sequence per TYPICAL_CONTEXT_TOKENS tokens it holds, at most
    MAX_AUTO_NUM_SEQS and the step's token budget, at least 1: conservative, so the running
    batch rarely outgrows the pool (preemption) and no CUDA graph is captured for a batch the
    pool cannot hold.
    """
    if not sized_by_memory:
        return DEFAULT_MAX_NUM_SEQS
    by_pool = pool_tokens // TYPICAL_CONTEXT_TOKENS
    return max(1, min(MAX_AUTO_NUM_SEQS, max_num_batched_tokens, by_pool))


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GiB:.2f} GiB"
