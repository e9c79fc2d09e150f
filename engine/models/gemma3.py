"""Gemma 3's text decoder (Gemma3ForCausalLM) over packed tokens; owns weights.

Built from llama.py's parts (the fused q|k|v and gate|up projections, Attention with its per-head
q/k norm, RoPE tables) with Gemma 3's differences, as transformers 5.25's modeling_gemma3.py
computes them: every RMSNorm scales by (1 + weight) in float32 before casting back; the
embeddings are multiplied by sqrt(hidden_size) rounded to the model's dtype; each layer is
input_layernorm -> attention -> post_attention_layernorm -> residual add, then
pre_feedforward_layernorm -> gelu_pytorch_tanh(gate) * up -> post_feedforward_layernorm ->
residual add; the softmax scale is query_pre_attn_scalar ** -0.5 (the attention backend's
scale); sliding_attention layers attend to the last sliding_window positions (the backend's
per-layer window) with RoPE of base rope_local_base_freq, unscaled, and full_attention layers
to every position with rope_theta and the config's scaling. Logit soft-capping (null in Gemma
3) is refused by the config reader.

It runs torch ops on every backend: FlashInfer's fused norms compute Llama's RMSNorm, not
Gemma's, so use_fused_ops leaves the layers as they are (the FlashInfer backend still does the
attention). Quantized weights are refused.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.base import AttentionBackend
from engine.config import ModelConfig, RopeScaling
from engine.models.llama import MLP, Attention, RMSNorm
from engine.models.rope import RotaryEmbedding
from engine.quant.config import QuantScheme

GELU_TANH = "gelu_pytorch_tanh"


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (1 + weight), all in float32, cast back to x's dtype (weight 0: identity)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class GemmaMLP(MLP):
    """gelu_pytorch_tanh(gate) * up -> down, torch ops only."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    # The checkpoint's per-layer norms (the loader takes each of them).
    NORMS = (
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    )

    def __init__(self, config: ModelConfig, layer: int, rope: RotaryEmbedding):
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Attention(config, layer, rope, None)
        self.self_attn.q_norm = GemmaRMSNorm(config.head_dim, eps)
        self.self_attn.k_norm = GemmaRMSNorm(config.head_dim, eps)
        self.mlp = GemmaMLP(config, None)
        for name in self.NORMS:
            setattr(self, name, GemmaRMSNorm(size, eps))

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        out = self.self_attn(self.input_layernorm(x), positions, attn)
        x = x + self.post_attention_layernorm(out)
        out = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(out)


class Gemma3ForCausalLM(nn.Module):
    LAYER_NORMS = Gemma3DecoderLayer.NORMS

    def __init__(self, config: ModelConfig, max_positions: int, quant: QuantScheme | None = None):
        super().__init__()
        if quant is not None:
            raise ValueError(
                f"{config.architecture} runs unquantized weights only, not "
                f"{getattr(quant, 'method', type(quant).__name__)} "
                "(a quantized checkpoint, or quantization set): its layers are torch ops"
            )
        if config.hidden_act != GELU_TANH:
            raise ValueError(
                f"{config.architecture}'s MLP activation is {GELU_TANH}, config.json has "
                f"{config.hidden_act!r}"
            )
        if config.num_experts:
            raise ValueError(f"{config.architecture} has no MoE layers (num_experts > 0)")
        self.config = config
        self.quant = None
        self.fused_ops = False
        self.kv_scales: list[tuple[float, float]] | None = None  # the loader's (none here)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rope = RotaryEmbedding(config, max_positions)
        self.local_rope = self.rope
        if config.local_rope_theta is not None:
            local = replace(config, rope_theta=config.local_rope_theta, rope_scaling=RopeScaling())
            self.local_rope = RotaryEmbedding(local, max_positions)
        windows = config.layer_windows or (None,) * config.num_layers
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, i, self.rope if w is None else self.local_rope)
            for i, w in enumerate(windows)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head: nn.Linear | None = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        """Packed tokens [T] -> final hidden states [T, hidden]."""
        x = self.embed_tokens(input_ids)
        # sqrt(hidden) rounded to the activations' dtype, as Gemma's checkpoints were trained; a
        # Python scalar, not a tensor built here (a host-to-device copy breaks graph capture)
        x = x * float(torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype))
        for layer in self.layers:
            x = layer(x, positions, attn)
        return self.norm(x)

    def use_fused_ops(self, enabled: bool) -> None:
        """Gemma's (1 + weight) norms have no fused kernel here: torch ops on every backend."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] in the model's dtype (the sampler widens them when it needs to)."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight)
