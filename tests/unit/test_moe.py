"""SparseMoe's CPU path (engine/models/moe.py) against transformers' own MoE blocks (Mixtral,
Qwen3-MoE, Qwen2-MoE with its shared expert), its weights read through expert_tensors from the
block's tensors written to safetensors; expert_tensors over both formats transformers writes
(the hub's per-expert tensors, its fused 3D ones) and its errors."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.models.moe import SparseMoe, expert_tensors

transformers = pytest.importorskip("transformers")

HIDDEN, EXPERT, NUM_EXPERTS, TOP_K, SHARED = 64, 32, 8, 2, 48
# family -> (transformers config class, its experts-count field, block class, model class)
FAMILIES = {
    "mixtral": (
        "MixtralConfig",
        "num_local_experts",
        "MixtralSparseMoeBlock",
        "MixtralForCausalLM",
    ),
    "qwen3_moe": ("Qwen3MoeConfig", "num_experts", "Qwen3MoeSparseMoeBlock", "Qwen3MoeForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "num_experts", "Qwen2MoeSparseMoeBlock", "Qwen2MoeForCausalLM"),
}
BLOCK_MODULES = {
    "mixtral": "transformers.models.mixtral.modeling_mixtral",
    "qwen3_moe": "transformers.models.qwen3_moe.modeling_qwen3_moe",
    "qwen2_moe": "transformers.models.qwen2_moe.modeling_qwen2_moe",
}


def hf_config(family: str, norm_topk_prob: bool = True) -> Any:
    config_name, experts_field = FAMILIES[family][:2]
    fields: dict[str, Any] = dict(
        vocab_size=128, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_experts_per_tok=TOP_K, intermediate_size=EXPERT,
    )  # fmt: skip
    fields[experts_field] = NUM_EXPERTS
    if family != "mixtral":
        fields |= dict(moe_intermediate_size=EXPERT, norm_topk_prob=norm_topk_prob)
    if family == "qwen2_moe":
        fields["shared_expert_intermediate_size"] = SHARED
    config = getattr(transformers, config_name)(**fields)
    config._experts_implementation = "grouped_mm"  # a model's default in transformers 5.25
    return config


def hf_block(family: str, norm_topk_prob: bool, dtype: torch.dtype) -> torch.nn.Module:
    import importlib

    block_class = getattr(importlib.import_module(BLOCK_MODULES[family]), FAMILIES[family][2])
    torch.manual_seed(0)
    block = block_class(hf_config(family, norm_topk_prob))
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, 0.2)
    return block.to(dtype).eval()


def popping(tensors: dict[str, torch.Tensor]) -> Callable[[str], torch.Tensor]:
    """A take(name) as the loader's: pops, and raises naming a missing tensor."""

    def take(name: str) -> torch.Tensor:
        try:
            return tensors.pop(name)
        except KeyError:
            raise ValueError(f"checkpoint is missing tensor {name!r}") from None

    return take


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            out |= {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    return out


def engine_moe(family: str, norm_topk_prob: bool, tensors: dict[str, torch.Tensor]) -> SparseMoe:
    moe = SparseMoe(
        HIDDEN, EXPERT, NUM_EXPERTS, TOP_K, norm_topk_prob,
        shared_expert_size=SHARED if family == "qwen2_moe" else 0,
        float32_routing_weights=family == "mixtral",
    )  # fmt: skip
    state = expert_tensors(popping(tensors), "layers.0.", NUM_EXPERTS, family)
    assert not tensors, f"left over: {sorted(tensors)}"
    moe.to(state["mlp.experts_down"].dtype)
    moe.load_state_dict({name.removeprefix("mlp."): t for name, t in state.items()}, strict=True)
    return moe.eval()


CASES = [("mixtral", True), ("qwen3_moe", True), ("qwen3_moe", False), ("qwen2_moe", False)]


@pytest.mark.parametrize("num_tokens", [1, 7])
@pytest.mark.parametrize("family, norm_topk_prob", CASES)
def test_equals_transformers_block_in_float32(
    tmp_path: Path, family: str, norm_topk_prob: bool, num_tokens: int
) -> None:
    block = hf_block(family, norm_topk_prob, torch.float32)
    save_file(
        {"layers.0.mlp." + k: v for k, v in block.state_dict().items()}, tmp_path / "a.safetensors"
    )
    moe = engine_moe(family, norm_topk_prob, read_safetensors(tmp_path))
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(num_tokens))
    with torch.no_grad():
        want = block(x[None])[0]
        got = moe(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert want.abs().max() > 0.1


@pytest.mark.parametrize("family, norm_topk_prob", CASES)
def test_equals_transformers_block_in_bfloat16(family: str, norm_topk_prob: bool) -> None:
    """Rounded where transformers' default (grouped_mm) experts round, and the router's
    weights cast where it casts them (Mixtral keeps float32): bit for bit on the CPU."""
    block = hf_block(family, norm_topk_prob, torch.bfloat16)
    moe = engine_moe(
        family, norm_topk_prob, {"layers.0.mlp." + k: v for k, v in block.state_dict().items()}
    )
    x = torch.randn(16, HIDDEN, generator=torch.Generator().manual_seed(3)).bfloat16()
    with torch.no_grad():
        want, got = block(x[None])[0], moe(x)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want), (got.float() - want.float()).abs().max()


@pytest.mark.parametrize("original_format", [True, False], ids=["per-expert", "fused"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_expert_tensors_reads_what_save_pretrained_writes(
    tmp_path: Path, family: str, original_format: bool
) -> None:
    model = getattr(transformers, FAMILIES[family][3])(hf_config(family))
    model.save_pretrained(tmp_path, save_original_format=original_format)
    tensors = read_safetensors(tmp_path)
    per_expert = "block_sparse_moe.experts.0.w1" if family == "mixtral" else "mlp.experts.0.gate"
    written = per_expert if original_format else "mlp.experts.gate_up_proj"
    assert any(written in name for name in tensors), sorted(tensors)
    got = expert_tensors(popping(tensors), "model.layers.0", NUM_EXPERTS, family)
    mlp = model.model.layers[0].mlp
    assert torch.equal(got["mlp.experts_gate_up"], mlp.experts.gate_up_proj)
    assert torch.equal(got["mlp.experts_down"], mlp.experts.down_proj)
    assert torch.equal(got["mlp.gate.weight"], mlp.gate.weight)
    assert not any(".mlp." in n or "block_sparse_moe" in n for n in tensors), "all taken"
    if family == "qwen2_moe":
        shared = mlp.shared_expert
        want = torch.cat([shared.gate_proj.weight, shared.up_proj.weight])
        assert torch.equal(got["mlp.shared_gate_up"], want)
        assert torch.equal(got["mlp.shared_down"], shared.down_proj.weight)
        assert torch.equal(got["mlp.shared_expert_gate.weight"], mlp.shared_expert_gate.weight)


def per_expert_tensors(family: str) -> dict[str, torch.Tensor]:
    module, gate, up, down = ("block_sparse_moe", "w1", "w3", "w2") if family == "mixtral" else (
        "mlp", "gate_proj", "up_proj", "down_proj"
    )  # fmt: skip
    out = {f"layers.0.{module}.gate.weight": torch.zeros(4, HIDDEN)}
    for e in range(4):
        base = f"layers.0.{module}.experts.{e}."
        out[base + gate + ".weight"] = torch.zeros(EXPERT, HIDDEN)
        out[base + up + ".weight"] = torch.zeros(EXPERT, HIDDEN)
        out[base + down + ".weight"] = torch.zeros(HIDDEN, EXPERT)
    return out


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_a_missing_expert_tensor_is_named(family: str) -> None:
    tensors = per_expert_tensors(family)
    name = next(
        n for n in tensors if ".experts.2." in n and n.endswith(("w2.weight", "down_proj.weight"))
    )
    del tensors[name]
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        expert_tensors(popping(tensors), "layers.0.", 4, family)


def test_no_expert_tensors_names_both_formats() -> None:
    with pytest.raises(ValueError, match=r"experts\.0\.gate_proj\.weight.*experts\.gate_up_proj"):
        expert_tensors(popping({}), "layers.0.", 4, "qwen3_moe")


def test_bad_shapes_and_family_are_named() -> None:
    tensors = per_expert_tensors("qwen3_moe")
    tensors["layers.0.mlp.gate.weight"] = torch.zeros(5, HIDDEN)
    with pytest.raises(ValueError, match=r"router gate\.weight"):
        expert_tensors(popping(tensors), "layers.0.", 4, "qwen3_moe")
    fused = {
        "layers.0.mlp.gate.weight": torch.zeros(4, HIDDEN),
        "layers.0.mlp.experts.gate_up_proj": torch.zeros(4, 2 * EXPERT, HIDDEN),
        "layers.0.mlp.experts.down_proj": torch.zeros(4, HIDDEN, EXPERT),
    }
    with pytest.raises(ValueError, match="num_experts=5"):
        expert_tensors(popping(dict(fused)), "layers.0.", 5, "qwen3_moe")
    fused["layers.0.mlp.experts.down_proj"] = torch.zeros(4, HIDDEN, EXPERT + 1)
    with pytest.raises(ValueError, match=r"experts down: shape \(4, 64, 33\)"):
        expert_tensors(popping(fused), "layers.0.", 4, "qwen3_moe")
    with pytest.raises(ValueError, match="'deepseek_v3'"):
        expert_tensors(popping({}), "layers.0.", 4, "deepseek_v3")


def test_fp8_experts_are_refused() -> None:
    from engine.quant.config import ONLINE_FP8

    with pytest.raises(ValueError, match="quant: FP8 experts"):
        SparseMoe(HIDDEN, EXPERT, 4, 2, True, quant=ONLINE_FP8)
    with pytest.raises(ValueError, match="num_experts_per_tok 5"):
        SparseMoe(HIDDEN, EXPERT, 4, 5, True)
