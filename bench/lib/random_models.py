"""Random-weight Llama-family checkpoints with real shapes (Llama-3.1-8B, SmolLM2, the sparse-MoE
Qwen3-30B-A3B), for speed runs without a download.

Owns no state: write_random_model() writes a config.json (and, optionally, random safetensors
in the HF layout) into a folder; engine.loader.random_model() (load_format "dummy") builds the
same shape straight on a device.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu"}
_QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_act": "silu",
}

SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {
        **_LLAMA,
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
    },
    "smollm2-135m": {
        **_LLAMA,
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    # Qwen3-30B-A3B's config.json (48 layers, every MLP sparse: 128 experts 768 wide, top-8
    # renormalized; q/k norms; 3.3B parameters a token of 30.5B).
    "qwen3-30b-a3b": {
        **_QWEN3_MOE,
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,  # unused: no layer is dense (mlp_only_layers [])
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "use_sliding_window": False,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    # Small, with the 8B's head_dim and GQA, for correctness runs on a GPU.
    "tiny-llama": {
        **_LLAMA,
        "vocab_size": 512,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": None,
    },
}


def _hf_shapes(hf: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of an HF Llama checkpoint (unfused q/k/v and gate/up); Qwen3-MoE:
    q/k norms, and every layer's router and per-expert projections as the hub stores them."""
    hidden, inter = hf["hidden_size"], hf["intermediate_size"]
    moe = hf.get("model_type") == "qwen3_moe"
    q_size = hf["num_attention_heads"] * hf["head_dim"]
    kv_size = hf["num_key_value_heads"] * hf["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (hf["vocab_size"], hidden),
        "model.norm.weight": (hidden,),
    }
    if not hf["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (hf["vocab_size"], hidden)
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q_size, hidden),
            p + "self_attn.k_proj.weight": (kv_size, hidden),
            p + "self_attn.v_proj.weight": (kv_size, hidden),
            p + "self_attn.o_proj.weight": (hidden, q_size),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
        if not moe:
            shapes |= {
                p + "mlp.gate_proj.weight": (inter, hidden),
                p + "mlp.up_proj.weight": (inter, hidden),
                p + "mlp.down_proj.weight": (hidden, inter),
            }
            continue
        head = hf["head_dim"]
        shapes |= {p + "self_attn.q_norm.weight": (head,), p + "self_attn.k_norm.weight": (head,)}
        width, experts = hf["moe_intermediate_size"], hf["num_experts"]
        shapes[p + "mlp.gate.weight"] = (experts, hidden)
        for e in range(experts):
            shapes |= {
                f"{p}mlp.experts.{e}.gate_proj.weight": (width, hidden),
                f"{p}mlp.experts.{e}.up_proj.weight": (width, hidden),
                f"{p}mlp.experts.{e}.down_proj.weight": (hidden, width),
            }
    return shapes


def write_random_model(
    folder: str | Path,
    shape: str,
    *,
    weights: bool = True,
    seed: int = 0,
    std: float = 0.02,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Write config.json (and random model.safetensors when weights) for a named shape.

    Norm weights are ones; every other tensor is N(0, std). Returns the folder.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    hf = {**SHAPES[shape], "torch_dtype": str(dtype).removeprefix("torch.")}
    (folder / "config.json").write_text(json.dumps(hf, indent=2))
    if weights:
        gen = torch.Generator().manual_seed(seed)
        tensors = {
            name: torch.ones(dims)
            if name.endswith("norm.weight")
            else torch.randn(dims, generator=gen) * std
            for name, dims in _hf_shapes(hf).items()
        }
        tensors = {name: t.to(dtype) for name, t in tensors.items()}
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def head_bytes(model: nn.Module) -> int:
    """Bytes of the LM head's weight (the embedding table when the two are tied)."""
    head = getattr(model, "lm_head", None)
    weight = model.embed_tokens.weight if head is None else head.weight
    return weight.numel() * weight.element_size()


def weight_bytes(model: nn.Module, *, read_per_decode_step: bool = False) -> int:
    """Bytes of all parameters; read_per_decode_step: those a batch-1 decode step reads, so
    the embedding table left out (the step reads one row of it) unless it is tied to the LM
    head, and of each MoE layer's experts only the num_experts_per_tok its token is routed to."""
    total = 0
    tied = getattr(model, "lm_head", None) is None
    config = getattr(model, "config", None)
    routed = 1.0
    if read_per_decode_step and config is not None and getattr(config, "num_experts", 0):
        routed = config.num_experts_per_tok / config.num_experts
    for name, param in model.named_parameters():
        if read_per_decode_step and name == "embed_tokens.weight" and not tied:
            continue
        nbytes = param.numel() * param.element_size()
        if name.endswith(("mlp.experts_gate_up", "mlp.experts_down")):
            nbytes = int(nbytes * routed)
        total += nbytes
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("--out", type=Path, default=None, help="folder (default: a temp folder)")
    p.add_argument("--config-only", action="store_true", help="write config.json only")
    p.add_argument("--std", type=float, default=0.02)
    args = p.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix=f"kvrelay-{args.shape}-"))
    print(write_random_model(out, args.shape, weights=not args.config_only, std=args.std))


if __name__ == "__main__":
    main()
