"""AWQ / GPTQ / compressed-tensors W4A16 and compressed-tensors INT8 checkpoints on the GPU:
Int4Linear (torch's tinygemm, the 4-bit weights kept packed) and Int8Linear (torch._int_mm)
against the weights dequantized independently (tests/unit/test_quantized_checkpoints.py's
writers), CUDA-graph replay against eager steps, and dummy 4-bit weights for speed runs.

Written without a GPU lent: not run yet (the CPU twin of the int4 kernel checks the packing
in tests/unit/test_quantized_checkpoints.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from engine.models.loader import load_model, read_model_config
from engine.quant.int4 import Int4Linear
from engine.quant.int8 import Int8Linear
from tests.factories import make_tiny_checkpoint
from tests.gpu.test_flashinfer_backend import run_workload
from tests.gpu.test_fp8_weights import engine_on
from tests.unit.test_quantized_checkpoints import KINDS, write_quantized

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
    pytest.mark.skipif(
        torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 0),
        reason="the int4 and int8 GEMMs need compute capability >= 8.0",
    ),
]

CUDA = torch.device("cuda")
MAX_LEN = 2048


def load(folder: Path, load_format: str = "auto") -> nn.Module:
    config = read_model_config(folder)
    return load_model(folder, config, MAX_LEN, CUDA, torch.bfloat16, load_format)


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama of head size 128 (the sizes FlashInfer's kernels are built for)."""
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("plain"), hidden_size=256, intermediate_size=512, head_dim=128
    )


def _fused_reference(reference: Path, layer: str) -> torch.Tensor:
    """The dequantized weight of an engine layer (q/k/v and gate/up concatenated)."""
    tensors = load_file(reference / "model.safetensors")
    parts = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    prefix, name = layer.rsplit(".", 1)
    names = parts.get(name, (name,))
    return torch.cat([tensors[f"model.{prefix}.{n}.weight"] for n in names]).to(CUDA)


@pytest.mark.parametrize("kind", [*KINDS, "int8"])
def test_layers_match_the_dequantized_weights(plain, tmp_path, kind) -> None:
    folder, reference = write_quantized(plain, tmp_path / kind, kind)
    model = load(folder)
    kind_of = Int8Linear if kind == "int8" else Int4Linear
    layers = {n: m for n, m in model.named_modules() if n.endswith("proj")}
    assert layers and all(isinstance(m, kind_of) for m in layers.values())
    gen = torch.Generator(device=CUDA).manual_seed(0)
    for name, layer in layers.items():
        want = _fused_reference(reference, name)
        for rows in (1, 5, 40):
            x = torch.randn(rows, want.shape[1], device=CUDA, generator=gen).bfloat16()
            expected = x.float() @ want.float().t()
            got = layer(x).float()
            err = (got - expected).abs().max() / expected.abs().max()
            assert err < 0.03, f"{kind} {name} at {rows} rows: relative error {err:.4f}"
            if kind == "int8":
                torch.testing.assert_close(layer(x), layer.forward_reference(x))
    if kind != "int8":  # the 4-bit weights stay packed: 8 codes an int32
        layer = model.layers[0].mlp.down_proj
        assert layer.weight.dtype == torch.int32
        assert layer.weight.numel() * 8 == layer.in_features * layer.out_features


@pytest.mark.parametrize("kind", ["gptq-v1-act-order", "int8"])
def test_cuda_graphs_replay_the_eager_tokens(plain, tmp_path, kind) -> None:
    pytest.importorskip("flashinfer")
    folder, _ = write_quantized(plain, tmp_path / kind, kind)
    model = load(folder)
    eager, _ = run_workload(engine_on(model, folder))
    graphs, _ = run_workload(engine_on(model, folder, cuda_graph=True))
    assert graphs == eager and all(len(t) > 0 for t in eager.values())


def test_dummy_int4_weights_for_speed_runs(tmp_path) -> None:
    pytest.importorskip("flashinfer")
    folder = make_tiny_checkpoint(tmp_path, hidden_size=256, intermediate_size=512, weights=False)
    bf16 = load(folder, "dummy")
    config = read_model_config(folder)
    hf = json.loads((folder / "config.json").read_text())
    hf["quantization_config"] = KINDS["awq"]
    (folder / "config.json").write_text(json.dumps(hf))
    int4 = load_model(folder, config, MAX_LEN, CUDA, torch.bfloat16, "dummy")

    def nbytes(model: nn.Module) -> int:
        return sum(p.numel() * p.element_size() for p in model.parameters())

    assert isinstance(int4.layers[0].self_attn.qkv_proj, Int4Linear)
    assert nbytes(int4) < 0.6 * nbytes(bf16)
    tokens, _ = run_workload(engine_on(int4, folder, cuda_graph=True))
    assert all(0 <= t < 512 for ts in tokens.values() for t in ts)
