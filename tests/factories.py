"""Factories for tiny random models: an HF checkpoint folder on disk, or the engine's ModelConfig
for a model built in memory. Owns no state; every size is a keyword with a small default."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.config import ModelConfig

# architecture -> (transformers config class, model class)
ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),  # q/k/v bias
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),  # per-head q/k RMSNorm
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),  # sparse MoE
    # sparse MoE with a gated shared expert, and q/k/v bias
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),  # sparse MoE
    # (1 + w) norms, gelu-tanh MLP, sliding_attention layers with their own RoPE base
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
}
MOE_ARCHITECTURES = ("qwen3_moe", "qwen2_moe", "mixtral")


def make_tiny_checkpoint(
    path: str | Path,
    *,
    architecture: str = "llama",
    vocab_size: int = 512,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,  # None: hidden_size // num_heads
    max_position_embeddings: int = 512,
    rms_norm_eps: float = 1e-6,
    rope_scaling: dict[str, Any] | None = None,
    tie_embeddings: bool = False,
    init_std: float = 0.3,  # peaked logits, so greedy has no near-ties
    dtype: torch.dtype = torch.float32,
    weights: bool = True,
    seed: int = 0,
    num_experts: int = 4,  # MoE architectures only
    num_experts_per_tok: int = 2,
    expert_size: int = 32,  # one expert's MLP width
    norm_topk_prob: bool = False,  # qwen3_moe / qwen2_moe (Mixtral always renormalizes)
    mlp_only_layers: tuple[int, ...] = (),  # qwen3_moe / qwen2_moe: these layers' MLPs are dense
    shared_expert_size: int = 48,  # qwen2_moe only: its shared expert's MLP width
    sliding_window: int = 12,  # gemma3 only: its sliding_attention layers' window
    layer_types: list[str] | None = None,  # gemma3 only; None: two sliding, one full, ...
    query_pre_attn_scalar: int = 24,  # gemma3 only: softmax scale ** -2 (not head_dim)
) -> Path:
    """Write a transformers checkpoint of random weights (config.json only unless weights) into
    path and return it. Weights are transformers' own init, N(0, init_std) after
    torch.manual_seed(seed), norms ones, biases (Qwen2's and Qwen2-MoE's q/k/v) drawn
    N(0, init_std) too (transformers' init leaves them 0, so a bias lost or misplaced would pass
    unseen); no EOS token and no sliding window.

    qwen3_moe / qwen2_moe / mixtral: every layer sparse (qwen3_moe, qwen2_moe: but
    mlp_only_layers, dense MLPs of intermediate_size) with num_experts experts of expert_size,
    top num_experts_per_tok; qwen2_moe's also a shared expert of shared_expert_size, gated.
    transformers 5.25 holds the experts as fused 3D parameters in memory but save_pretrained
    writes them per expert, as the hub checkpoints are:
    layers.N.mlp.experts.E.{gate,up,down}_proj.weight (Mixtral: block_sparse_moe.experts.E.
    {w1,w3,w2}.weight) beside the router, layers.N.mlp.gate.weight (Mixtral:
    block_sparse_moe.gate.weight).

    gemma3: Gemma3TextConfig with layer_types (default: every third layer full_attention, the
    others sliding_attention of sliding_window) and rope_scaling for the full layers; its norm
    weights, which transformers initializes to 0 (a scale of 1 + 0), are drawn N(0, 0.5) so the
    (1 + weight) scaling is exercised."""
    import transformers

    config_name, model_name = ARCHITECTURES[architecture]
    fields: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=rms_norm_eps,
        initializer_range=init_std,
        tie_word_embeddings=tie_embeddings,
        eos_token_id=None,
        sliding_window=None,  # the engine would cap max_model_len to it
    )
    # explicit: Qwen3Config's default head_dim is 128 whatever the hidden size
    fields["head_dim"] = hidden_size // num_heads if head_dim is None else head_dim
    if rope_scaling is not None:
        fields["rope_scaling"] = rope_scaling
    if architecture in ("qwen3_moe", "qwen2_moe"):
        fields |= dict(
            num_experts=num_experts,
            num_experts_per_tok=num_experts_per_tok,
            moe_intermediate_size=expert_size,
            norm_topk_prob=norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=list(mlp_only_layers),
        )
        if architecture == "qwen2_moe":
            fields["shared_expert_intermediate_size"] = shared_expert_size
    elif architecture == "gemma3":
        fields |= dict(
            sliding_window=sliding_window,
            layer_types=layer_types
            or [
                "full_attention" if (i + 1) % 3 == 0 else "sliding_attention"
                for i in range(num_layers)
            ],
            query_pre_attn_scalar=query_pre_attn_scalar,
            bos_token_id=None,
            pad_token_id=None,
        )
    elif architecture == "mixtral":
        fields |= dict(
            num_local_experts=num_experts,
            num_experts_per_tok=num_experts_per_tok,
            intermediate_size=expert_size,
        )
    config = getattr(transformers, config_name)(**fields)
    config.architectures = [model_name]  # save_pretrained of a model writes it; of a config not
    path = Path(path)
    if not weights:
        config.save_pretrained(path)
        return path
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):  # transformers' init leaves them 0: a lost bias would pass
                param.normal_(0.0, init_std)
            elif architecture == "gemma3" and name.endswith("norm.weight"):
                param.normal_(0.0, 0.5)
    model.save_pretrained(path, safe_serialization=True)
    return path


def make_model_config(**overrides: Any) -> ModelConfig:
    """The engine's ModelConfig of a tiny Llama (4 heads, 2 KV heads); overrides by field name."""
    fields: dict[str, Any] = dict(
        model_id="tiny",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
    )
    return ModelConfig(**{**fields, **overrides})


def greedy_continuation(hf: Any, prompt: list[int], new_tokens: int, **kwargs: Any) -> list[int]:
    """A transformers model's greedy continuation of one prompt: exactly new_tokens tokens;
    kwargs go to generate (a repetition_penalty, a logits_processor)."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            **kwargs,
        )
    return out[0, len(prompt) :].tolist()


def transformers_greedy(
    folder: str | Path, prompts: list[list[int]], new_tokens: int
) -> list[list[int]]:
    """transformers' greedy continuation of each prompt by the checkpoint in folder (the oracle)."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    return [greedy_continuation(hf, p, new_tokens) for p in prompts]


def rewrite_checkpoint(src: Path, dst: Path, change: Callable[[dict], dict]) -> Path:
    """A copy of the checkpoint folder src in dst whose tensors are change(tensors)."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    for file in src.iterdir():
        if file.suffix != ".safetensors":
            (dst / file.name).write_bytes(file.read_bytes())
    tensors = change(load_file(src / "model.safetensors"))
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst
