"""Rotary position embedding tables (default, linear and llama3 scaling); owns cos/sin caches."""

from __future__ import annotations

import math

import torch

from engine.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (
        config.rope_theta
        ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim)
    )
    scaling = config.rope_scaling
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind != "llama3":
        if scaling.kind not in ("default", None):
            raise ValueError(f"unsupported rope scaling {scaling.kind!r}")
        return inv_freq
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Applies rotate-half RoPE to q and k at given positions."""

    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__()
        inv_freq = inverse_frequencies(config)
        positions = torch.arange(max_positions, dtype=torch.float32, device="cpu")
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        # The fused kernels' table: cos then sin of the D/2 frequencies, float32.
        half = emb.shape[-1] // 2
        cos_sin = torch.cat((emb[:, :half].cos(), emb[:, :half].sin()), dim=-1)
        self.register_buffer("cos_sin", cos_sin, persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
