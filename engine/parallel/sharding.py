"""Takes one rank's slice of the full model's tensors (named and fused as the model's state
dict: q|k|v and gate|up fused); pure functions, no state. Each slice is a fresh tensor, so the
full one is freed once its reader drops it.

qkv_proj: the rank's q heads from the q part and its KV heads from the k and v parts (by heads,
not a flat split of the fused rows); gate_up_proj: the rank's columns of the gate and of the up
half; o_proj and down_proj: the matching input columns (row-parallel: the model all-reduces
their outputs), o_proj's bias on rank 0 only (added once to the sum); a MoE layer's experts
(experts_gate_up [E, 2I, H], experts_down [E, H, I]) and shared expert: each expert's gate|up
columns and down input columns the same way (its output all-reduced: models/moe.py);
embed_tokens and lm_head: the rank's vocabulary rows, zero-padded past vocab_size. Anything else
(norms, per-head q/k norms, a MoE layer's router) is replicated.
"""

from __future__ import annotations

import torch

from engine.config import ModelConfig
from engine.parallel.tensor_parallel import RankShard, TensorParallel, rank_shard


def shard_weights(
    weights: dict[str, torch.Tensor], config: ModelConfig, tp: TensorParallel
) -> dict[str, torch.Tensor]:
    """weights (the full model's, by state-dict name) -> the rank's slices, same names; on one
    rank, weights as they are. A name this module does not know is replicated."""
    if not tp.is_parallel:
        return weights
    shard = rank_shard(config, tp)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        if name.endswith("o_proj.bias") and tp.rank != 0:
            continue
        out[name] = _slice(name, tensor, config, shard)
    return out


def _slice(name: str, t: torch.Tensor, config: ModelConfig, shard: RankShard) -> torch.Tensor:
    d = config.head_dim
    if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
        q_size, kv_size = config.num_heads * d, config.num_kv_heads * d
        _check_rows(name, t, q_size + 2 * kv_size)
        q, k, v = t.split([q_size, kv_size, kv_size])
        return torch.cat(
            [
                _heads(q, shard.q_heads, d),
                _heads(k, shard.kv_heads, d),
                _heads(v, shard.kv_heads, d),
            ]
        )
    if name.endswith("o_proj.weight"):
        return _columns(t, _scaled(shard.q_heads, d)).clone()
    if name.endswith("gate_up_proj.weight"):
        _check_rows(name, t, 2 * config.intermediate_size)
        gate, up = t.chunk(2)
        return torch.cat([gate[_slice_of(shard.intermediate)], up[_slice_of(shard.intermediate)]])
    if name.endswith("down_proj.weight"):
        return _columns(t, shard.intermediate).clone()
    if name.endswith("experts_gate_up"):  # [E, 2I, H]: each expert's gate rows, then up rows
        _check_width(name, t.shape[1], 2 * config.moe_intermediate_size)
        gate, up = t.chunk(2, dim=1)
        columns = _slice_of(shard.expert)
        return torch.cat([gate[:, columns], up[:, columns]], dim=1)
    if name.endswith("experts_down"):  # [E, H, I]
        _check_width(name, t.shape[2], config.moe_intermediate_size)
        return t[:, :, _slice_of(shard.expert)].clone()
    if name.endswith("shared_gate_up"):  # [2S, H]
        _check_rows(name, t, 2 * config.shared_expert_intermediate_size)
        gate, up = t.chunk(2)
        columns = _slice_of(shard.shared_expert)
        return torch.cat([gate[columns], up[columns]])
    if name.endswith("shared_down"):  # [H, S]
        return _columns(t, shard.shared_expert).clone()
    if name in ("embed_tokens.weight", "lm_head.weight"):
        _check_rows(name, t, config.vocab_size)
        rows = t[shard.vocab.start : min(shard.vocab.stop, config.vocab_size)]
        padded = t.new_zeros(len(shard.vocab), *t.shape[1:])
        padded[: rows.shape[0]] = rows
        return padded
    return t


def _check_rows(name: str, t: torch.Tensor, expected: int) -> None:
    if t.shape[0] != expected:
        raise ValueError(f"tensor {name!r} has {t.shape[0]} rows; the config says {expected}")


def _check_width(name: str, width: int, expected: int) -> None:
    if width != expected:
        raise ValueError(f"tensor {name!r} is {width} wide per expert; the config says {expected}")


def _slice_of(r: range) -> slice:
    return slice(r.start, r.stop)


def _scaled(heads: range, head_dim: int) -> range:
    return range(heads.start * head_dim, heads.stop * head_dim)


def _heads(t: torch.Tensor, heads: range, head_dim: int) -> torch.Tensor:
    return t[_slice_of(_scaled(heads, head_dim))]


def _columns(t: torch.Tensor, columns: range) -> torch.Tensor:
    return t[:, _slice_of(columns)]
