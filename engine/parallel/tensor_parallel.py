"""TensorParallel: one rank's place in a tensor-parallel group (its rank, the group's size and
process group) and its collectives; RankShard: the heads, MLP columns and vocabulary rows a
rank owns. Values: they own no state.

Heads: rank r owns q heads [r H/N, (r+1) H/N). KV heads are split the same way when N divides
them; when there are fewer KV heads than ranks (N a multiple of them) each is replicated on
N / num_kv_heads ranks, rank r holding KV head r // (N / num_kv_heads): its q heads' group.
The vocabulary is split into N ranges of ceil(V / N) rows; the last range's rows past V are
padding (zero rows, their logits dropped), so every rank's slice has one shape for the gather.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from engine.config import EngineConfig, ModelConfig

# How long the ranks wait for each other's weights to load (min_over_ranks at start-up).
LOAD_TIMEOUT = timedelta(minutes=30)


@dataclass(frozen=True)
class TensorParallel:
    """rank of world_size; group: the process group of the model's collectives (None: 1 rank),
    a c10d backend object (ProcessGroupGloo / ProcessGroupNCCL) of this group alone, not
    torch.distributed's global default group: an engine's group is its own (engine/parallel/
    ranks.py), so several may live in one process."""

    rank: int = 0
    world_size: int = 1
    group: Any = None
    # A gloo group of the same ranks for the host-side messages (step plans, start-up
    # agreement), with a long timeout: a follower waits there while rank 0 is idle.
    control: Any = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world_size {self.world_size}")
        if self.world_size > 1 and (self.group is None or self.control is None):
            raise ValueError(f"world_size {self.world_size} needs its process groups")

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the ranks, in place (a row-parallel projection's partial sums)."""
        if self.is_parallel:
            self.group.allreduce([x]).wait()
        return x

    def min_over_ranks(self, value: int) -> int:
        """The least of every rank's value (on the control group: also a start-up barrier)."""
        if not self.is_parallel:
            return value
        x = torch.tensor([value], dtype=torch.int64)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        options.timeout = LOAD_TIMEOUT
        self.control.allreduce([x], options).wait()
        return int(x.item())

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Rank 0: the full [rows, vocab_size] logits from every rank's vocabulary range; other
        ranks: their own slice (they never sample). A gather, not an all-gather: only rank 0
        samples, so the other ranks need not receive (N - 1) / N of every step's logits."""
        if not self.is_parallel:
            return logits
        logits = logits.contiguous()
        options = dist.GatherOptions()
        options.rootRank = 0
        if self.rank != 0:
            self.group.gather([], [logits], options).wait()
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.world_size)]
        self.group.gather([parts], [logits], options).wait()
        return torch.cat(parts, dim=-1)[:, :vocab_size]


SINGLE = TensorParallel()


class RankShard(NamedTuple):
    """What one rank owns of a model, as index ranges of the full model's."""

    q_heads: range
    kv_heads: range
    intermediate: range  # MLP columns (of gate, of up, and rows of down's input)
    vocab: range  # rows of the embedding and LM head; may reach past vocab_size (padding)
    expert: range = range(0)  # each MoE expert's columns, as intermediate is a dense MLP's
    shared_expert: range = range(0)  # and a shared expert's (Qwen2-MoE)


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """Raise ValueError naming the numbers when the model cannot be split over size ranks."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    heads, kv_heads = config.num_heads, config.num_kv_heads
    if heads % size:
        raise ValueError(f"tensor_parallel_size {size} must divide the model's num_heads {heads}")
    if kv_heads % size and size % kv_heads:
        raise ValueError(
            f"tensor_parallel_size {size} and the model's num_kv_heads {kv_heads}: one must "
            "divide the other (KV heads are split, or replicated when fewer than ranks)"
        )
    if config.architecture == "Gemma3ForCausalLM" and size > 1:
        raise ValueError(
            f"tensor_parallel_size {size}: Gemma 3 is not split across tensor-parallel ranks yet "
            "(run it at tensor_parallel_size 1)"
        )
    widths = {"intermediate_size": config.intermediate_size}
    if config.num_experts:  # each expert's columns are split as a dense MLP's are
        widths["moe_intermediate_size"] = config.moe_intermediate_size
        widths["shared_expert_intermediate_size"] = config.shared_expert_intermediate_size
    for field, width in widths.items():
        if width % size:
            raise ValueError(f"tensor_parallel_size {size} must divide the model's {field} {width}")


def rank_kv_heads(num_kv_heads: int, rank: int, size: int) -> range:
    """The KV heads rank holds of size ranks (split, or one replicated when fewer than ranks)."""
    if num_kv_heads % size == 0:
        return range(rank * num_kv_heads // size, (rank + 1) * num_kv_heads // size)
    replicas = size // num_kv_heads
    return range(rank // replicas, rank // replicas + 1)


def rank_shard(config: ModelConfig, tp: TensorParallel) -> RankShard:
    check_tensor_parallel(config, tp.world_size)
    r, n = tp.rank, tp.world_size
    heads = config.num_heads // n
    kv = rank_kv_heads(config.num_kv_heads, r, n)
    rows = -(-config.vocab_size // n)

    def part(width: int) -> range:  # the rank's 1/n of width columns
        return range(r * width // n, (r + 1) * width // n)

    return RankShard(
        range(r * heads, (r + 1) * heads),
        kv,
        part(config.intermediate_size),
        range(r * rows, (r + 1) * rows),
        part(config.moe_intermediate_size if config.num_experts else 0),
        part(config.shared_expert_intermediate_size if config.num_experts else 0),
    )


def rank_model_config(config: ModelConfig, tp: TensorParallel) -> ModelConfig:
    """The config as one rank's attention and KV cache see it: its heads only."""
    if not tp.is_parallel:
        return config
    shard = rank_shard(config, tp)
    return replace(config, num_heads=len(shard.q_heads), num_kv_heads=len(shard.kv_heads))


def rank_engine_config(config: EngineConfig) -> EngineConfig:
    """config as a rank of a tensor-parallel engine runs it: eager steps (no CUDA graphs, no
    overlapped steps: every rank runs each step's plan as it comes); what is not split across
    ranks yet is refused, naming the field. One rank: config as it is. The host tier (and its
    host leases, keep_on_host) is every rank's own, of its own heads; a draft model runs on
    rank 0 alone (its tokens reach the ranks in each verify step's plan)."""
    if config.tensor_parallel_size == 1:
        return config
    size = f"tensor_parallel_size {config.tensor_parallel_size}"
    refused = {
        "quantization (FP8 weights)": config.quantization is not None,
        "async_scheduling": config.async_scheduling is True,
    }
    for name, is_set in refused.items():
        if is_set:
            raise ValueError(f"{name} is not supported with {size} yet")
    return replace(config, cuda_graph=False, async_scheduling=False)
