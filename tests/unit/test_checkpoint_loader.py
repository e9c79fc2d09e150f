"""The loader refuses what it does not understand: a checkpoint tensor no module takes, or a
module weight no tensor fills, is named with the checkpoint's folder; the documented safe-to-skip
tensors (RoPE's saved inv_freq, a tied LM head's copy of the embeddings) load."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.models.loader import load_model, read_model_config
from tests.factories import make_tiny_checkpoint, rewrite_checkpoint

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("qwen3"), architecture="qwen3", tie_embeddings=True
    )


def _load(folder: Path) -> torch.nn.Module:
    return load_model(folder, read_model_config(folder), 64, CPU, torch.float32)


def test_the_checkpoint_loads_with_its_q_and_k_norms(qwen3: Path) -> None:
    model = _load(qwen3)
    stored = load_file(qwen3 / "model.safetensors")
    attn = model.layers[1].self_attn
    assert torch.equal(attn.q_norm.weight, stored["model.layers.1.self_attn.q_norm.weight"])
    assert torch.equal(attn.k_norm.weight, stored["model.layers.1.self_attn.k_norm.weight"])
    assert model.lm_head is None  # tied


def test_an_extra_tensor_is_refused_by_name(qwen3: Path, tmp_path: Path) -> None:
    def add(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return tensors | {"model.layers.0.mlp.gate.weight": torch.zeros(4, 64)}

    folder = rewrite_checkpoint(qwen3, tmp_path / "extra", add)
    with pytest.raises(ValueError, match=r"1 tensor\(s\) that no module") as refused:
        _load(folder)
    assert "'layers.0.mlp.gate.weight'" in str(refused.value)
    assert str(folder) in str(refused.value)


def test_many_extra_tensors_are_counted_and_a_few_named(qwen3: Path, tmp_path: Path) -> None:
    def add(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        extra = {f"model.layers.0.mlp.experts.{e}.up_proj.weight": torch.zeros(2) for e in range(8)}
        return tensors | extra

    with pytest.raises(ValueError, match=r"8 tensor\(s\)") as refused:
        _load(rewrite_checkpoint(qwen3, tmp_path / "many", add))
    message = str(refused.value)
    assert "'layers.0.mlp.experts.0.up_proj.weight'" in message and "and 3 more" in message
    assert "experts.7" not in message  # five named, sorted


def test_a_missing_tensor_is_refused_by_name(qwen3: Path, tmp_path: Path) -> None:
    def drop(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        del tensors["model.layers.1.self_attn.k_norm.weight"]
        return tensors

    folder = rewrite_checkpoint(qwen3, tmp_path / "missing", drop)
    with pytest.raises(ValueError, match=r"missing tensor 'layers\.1\.self_attn\.k_norm\.weight'"):
        _load(folder)
    with pytest.raises(ValueError, match=re.escape(f"checkpoint {folder} is missing")):
        _load(folder)


def test_safe_to_skip_tensors_load(qwen3: Path, tmp_path: Path) -> None:
    """RoPE's inv_freq (computed from config.json) and a copy of the tied embeddings as
    lm_head.weight are skipped; the model is the same as without them."""

    def add(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        inv_freq = {
            f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.ones(8) for i in range(2)
        }
        return tensors | inv_freq | {"lm_head.weight": tensors["model.embed_tokens.weight"].clone()}

    plain = _load(qwen3).state_dict()
    skipped = _load(rewrite_checkpoint(qwen3, tmp_path / "skippable", add)).state_dict()
    assert plain.keys() == skipped.keys()
    assert all(torch.equal(plain[name], skipped[name]) for name in plain)


def test_a_tied_checkpoint_with_a_different_lm_head_is_refused(qwen3: Path, tmp_path: Path) -> None:
    def add(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return tensors | {"lm_head.weight": tensors["model.embed_tokens.weight"] + 1}

    with pytest.raises(ValueError, match=r"'lm_head\.weight' unlike 'embed_tokens\.weight'"):
        _load(rewrite_checkpoint(qwen3, tmp_path / "untied-head", add))


def test_a_tensor_of_the_wrong_shape_is_refused_naming_the_folder(
    qwen3: Path, tmp_path: Path
) -> None:
    """An up_proj saved narrower than config.json's intermediate_size: the error names the
    checkpoint and says what kvrelay's fused gate_up_proj is made of."""

    def narrow(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        name = "model.layers.0.mlp.up_proj.weight"
        return tensors | {name: tensors[name][:100]}

    folder = rewrite_checkpoint(qwen3, tmp_path / "narrow", narrow)
    with pytest.raises(
        ValueError, match=re.escape(f"checkpoint {folder}: its tensors' shapes")
    ) as e:
        _load(folder)
    assert "layers.0.mlp.gate_up_proj.weight" in str(e.value) and "gate/up_proj" in str(e.value)
