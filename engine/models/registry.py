"""Maps a checkpoint's architecture name to the model class that runs it (no state)."""

from __future__ import annotations

from torch import nn

from engine.config import ARCHITECTURES, CheckpointRefused, ModelConfig
from engine.models.gemma3 import Gemma3ForCausalLM
from engine.models.llama import LlamaForCausalLM

_ARCHITECTURES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,  # ModelConfig.qk_norm
    # sparse MoE layers (models/moe.py) in config.moe_layers; llama.MOE_FAMILIES names them
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    "Qwen2MoeForCausalLM": LlamaForCausalLM,  # and a shared expert (ModelConfig's width)
    "MixtralForCausalLM": LlamaForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,  # text only (config.py refuses the multimodal one)
}


assert set(_ARCHITECTURES) == set(ARCHITECTURES), "engine.config.ARCHITECTURES is this map's keys"


def model_class(config: ModelConfig) -> type[nn.Module]:
    try:
        return _ARCHITECTURES[config.architecture]
    except KeyError:
        known = ", ".join(sorted(_ARCHITECTURES))
        raise CheckpointRefused(
            f"unsupported architecture {config.architecture!r}; supported: {known}"
        ) from None
