"""take_kv_scales: the per-layer KV-cache scales of an FP8 checkpoint in the three layouts
(compressed-tensors / vLLM, ModelOpt, one kv_scale), removed from the tensors; refusals; and
the loader putting them on the model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.models.loader import load_model, read_model_config
from engine.quant.kv_scales import take_kv_scales
from tests.factories import make_tiny_checkpoint


def _tensors(names_values: dict[str, float]) -> dict[str, torch.Tensor]:
    return {name: torch.tensor([value]) for name, value in names_values.items()}


@pytest.mark.parametrize(
    ("k_name", "v_name"),
    [("k_scale", "v_scale"), ("k_proj.k_scale", "v_proj.v_scale")],
)
def test_each_layout_gives_per_layer_pairs_and_removes_them(k_name: str, v_name: str) -> None:
    raw = {"model.layers.0.self_attn.q_proj.weight": torch.zeros(2, 2)}
    for layer in range(3):
        attn = f"model.layers.{layer}.self_attn."
        raw |= _tensors({attn + k_name: 0.5 + layer, attn + v_name: 2.0 + layer})
    assert take_kv_scales(raw, 3) == [(0.5, 2.0), (1.5, 3.0), (2.5, 4.0)]
    assert list(raw) == ["model.layers.0.self_attn.q_proj.weight"]  # the scales are taken


def test_one_kv_scale_serves_k_and_v_and_a_plain_checkpoint_has_none() -> None:
    raw = _tensors({f"layers.{i}.self_attn.kv_scale": 0.25 for i in range(2)})
    assert take_kv_scales(raw, 2) == [(0.25, 0.25), (0.25, 0.25)] and not raw
    assert take_kv_scales({"layers.0.self_attn.q_proj.weight": torch.zeros(1)}, 1) is None


def test_scales_for_some_layers_only_are_refused_by_name() -> None:
    raw = _tensors({"layers.0.self_attn.k_scale": 1.0, "layers.0.self_attn.v_scale": 1.0})
    with pytest.raises(ValueError, match=r"1 of 2 layers; missing 'layers\.1\.self_attn\.k_scale'"):
        take_kv_scales(raw, 2)


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf")])
def test_a_scale_that_is_not_positive_and_finite_is_refused(value: float) -> None:
    raw = _tensors({"layers.0.self_attn.k_scale": value, "layers.0.self_attn.v_scale": 1.0})
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.k_scale is .*positive and finite"):
        take_kv_scales(raw, 1)


def test_a_scale_per_head_is_refused() -> None:
    raw = {"layers.0.self_attn.k_scale": torch.ones(4), "layers.0.self_attn.v_scale": torch.ones(1)}
    with pytest.raises(ValueError, match=r"shape \(4,\); expected one number per layer"):
        take_kv_scales(raw, 1)


def test_the_loader_puts_a_checkpoints_kv_scales_on_the_model(tmp_path: Path) -> None:
    folder = make_tiny_checkpoint(tmp_path / "tiny")
    config = read_model_config(folder)
    plain = load_model(folder, config, 64, torch.device("cpu"), torch.float32)
    assert plain.kv_scales is None
    tensors = load_file(folder / "model.safetensors")
    for layer in range(config.num_layers):
        attn = f"model.layers.{layer}.self_attn."
        tensors |= _tensors({attn + "k_scale": 0.5, attn + "v_scale": 0.125 * (layer + 1)})
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    model = load_model(folder, config, 64, torch.device("cpu"), torch.float32)
    assert model.kv_scales == [(0.5, 0.125 * (i + 1)) for i in range(config.num_layers)]
