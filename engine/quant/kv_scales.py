"""Reads an FP8 checkpoint's per-layer KV-cache scales (k_scale, v_scale) out of its tensors;
owns no state. An fp8 KV cache stores K / k_scale and V / v_scale, so attention multiplies
them back; without scales in the checkpoint both are 1.0.

Names (after the "model." prefix): compressed-tensors (llm-compressor) and vLLM write
layers.N.self_attn.k_scale / v_scale; NVIDIA ModelOpt writes layers.N.self_attn.k_proj.k_scale /
v_proj.v_scale; older checkpoints one layers.N.self_attn.kv_scale for both.
"""

from __future__ import annotations

import math

import torch

KVScales = list[tuple[float, float]]  # per layer (k_scale, v_scale)
_PAIRS = (("k_scale", "v_scale"), ("k_proj.k_scale", "v_proj.v_scale"), ("kv_scale", "kv_scale"))


def take_kv_scales(raw: dict[str, torch.Tensor], num_layers: int) -> KVScales | None:
    """Remove the KV-cache scales from a checkpoint's tensors (keys with or without "model.")
    and return them per layer; None when the checkpoint has none. A checkpoint with scales for
    some layers only, or a scale that is not one positive finite number, is refused by name."""
    prefix = "model." if any(name.startswith("model.layers.") for name in raw) else ""
    scales: KVScales = []
    missing: list[str] = []
    for layer in range(num_layers):
        attn = f"{prefix}layers.{layer}.self_attn."
        pair = next(((k, v) for k, v in _PAIRS if attn + k in raw and attn + v in raw), None)
        if pair is None:
            missing.append(attn + "k_scale")
            continue
        k_name, v_name = attn + pair[0], attn + pair[1]
        scales.append((_scale(raw, k_name), _scale(raw, v_name)))
        raw.pop(k_name, None)
        raw.pop(v_name, None)
    if not scales:
        return None
    if missing:
        raise ValueError(
            f"the checkpoint has KV-cache scales for {len(scales)} of {num_layers} layers; "
            f"missing {missing[0]!r} (or its v_scale)"
        )
    return scales


def _scale(raw: dict[str, torch.Tensor], name: str) -> float:
    tensor = raw[name]
    if tensor.numel() != 1:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}; expected one number per layer")
    value = float(tensor.float().reshape(()))
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} is {value}; a KV-cache scale must be positive and finite")
    return value
