"""FP8 checkpoints written here in the compressed-tensors and ModelOpt layouts load into Fp8Linear
layers (q/k/v and gate/up fused exactly) that match the same weights quantized online; dummy
FP8 weights; the engine runs an FP8 model with its float32 reference's tokens; CPU refusals.

The loader's device check is patched out where a test looks at weights on this CPU machine:
the engine refuses FP8 on CPU, and the last tests check that it does.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import engine.models.loader as loader
from engine.models.loader import load_model, read_model_config
from engine.quant.config import Fp8Config
from engine.quant.fp8 import Fp8Linear, quantize_weight
from engine.quant.fp8_types import FP8_DTYPE, FP8_MAX
from engine.sampling.sampling_params import SamplingParams
from tests.conftest import build_engine, run_to_completion
from tests.factories import make_tiny_checkpoint
from tests.unit.test_fp8_linear import cuda_contract  # noqa: F401 (a fixture)

CT, MODELOPT = "compressed-tensors", "modelopt"
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Static input scales per projection: q/k/v differ, so the fused layer must take their maximum.
INPUT_SCALES = dict(zip(PROJECTIONS, (0.02, 0.03, 0.025, 0.01, 0.04, 0.05, 0.06), strict=True))
CPU = torch.device("cpu")


def _ct_config(per_channel: bool, static: bool, ignore: list[str]) -> dict:
    fp8 = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None}
    weights = {**fp8, "strategy": "channel" if per_channel else "tensor", "dynamic": False}
    inputs = {**fp8, "strategy": "tensor" if static else "token", "dynamic": not static}
    group = {"targets": ["Linear"], "weights": weights, "input_activations": inputs}
    return {
        "quant_method": CT,
        "format": "float-quantized",
        "quantization_status": "compressed",
        "ignore": ignore,
        "kv_cache_scheme": None,
        "config_groups": {"group_0": {**group, "output_activations": None}},
    }


def write_fp8_checkpoint(
    src: Path,
    dst: Path,
    *,
    layout: str = CT,
    per_channel: bool = True,
    static: bool = False,
    quantize_lm_head: bool = False,
    device: str = "cpu",
) -> Path:
    """Quantize a plain HF checkpoint's projections as llm-compressor (compressed-tensors) or
    ModelOpt store them: e4m3 weight; weight_scale float32 [N, 1] per channel, or per tensor
    (compressed-tensors: bf16 [1], the weight quantized with that rounded value; ModelOpt:
    float32 []); input_scale per tensor when static. device: where to quantize (the loader's
    device, for bit-equal codes: CPU and CUDA may round a division differently)."""
    dst.mkdir(parents=True, exist_ok=True)
    for file in src.iterdir():
        if file.is_file() and file.suffix != ".safetensors":
            shutil.copy(file, dst / file.name)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(src / "model.safetensors").items():
        module, kind = name.removesuffix(".weight"), name.rsplit(".", 2)[-2]
        quantized = kind in PROJECTIONS or (quantize_lm_head and kind == "lm_head")
        if not (name.endswith(".weight") and quantized):
            out[name] = tensor
            continue
        if per_channel:
            weight, scale = (t.cpu() for t in quantize_weight(tensor.to(device)))
        else:
            scale = tensor.float().abs().max() / FP8_MAX
            scale = scale.bfloat16().float() if layout == CT else scale
            weight = (tensor.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
            scale = scale.reshape(1).bfloat16() if layout == CT else scale.reshape(())
        out[module + ".weight"], out[module + ".weight_scale"] = weight, scale
        if static and kind in INPUT_SCALES:
            out[module + ".input_scale"] = torch.tensor([INPUT_SCALES[kind]])
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    if layout == CT:
        ignore = [] if quantize_lm_head else ["lm_head"]
        config["quantization_config"] = _ct_config(per_channel, static, ignore)
    else:
        quantization = {"quant_algo": "FP8", "kv_cache_quant_algo": None}
        modelopt = {"producer": {"name": "modelopt"}, "quantization": quantization}
        (dst / "hf_quant_config.json").write_text(json.dumps(modelopt))
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture
def fp8_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let the loader build FP8 models on this CPU machine (the engine would refuse, or
    dequantize an FP8 checkpoint)."""
    monkeypatch.setattr(loader, "check_fp8_device", lambda device: None)
    monkeypatch.setattr(loader, "quantized_kernels_on", lambda device: True)


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("plain"), init_std=0.05)


def _load(folder: Path, quantization: str | None = None) -> nn.Module:
    config = read_model_config(folder)
    return load_model(folder, config, 128, CPU, torch.bfloat16, quantization=quantization)


def _fp8_layers(model: nn.Module) -> dict[str, Fp8Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, Fp8Linear)}


def test_per_channel_checkpoint_equals_online_quantization(fp8_on_cpu, plain, tmp_path) -> None:
    folder = write_fp8_checkpoint(plain, tmp_path / "ct")
    checkpoint, online = _load(folder), _load(plain, quantization="fp8")
    assert checkpoint.quant == Fp8Config(CT, per_channel_weights=True, static_input_scales=False)
    layers, want = _fp8_layers(checkpoint), _fp8_layers(online)
    assert len(layers) == 4 * 2 and layers.keys() == want.keys()
    for name, layer in layers.items():
        assert torch.equal(layer.weight.view(torch.uint8), want[name].weight.view(torch.uint8))
        assert torch.equal(layer.weight_scale, want[name].weight_scale), name
        assert layer.input_scale is None
    for name in ("embed_tokens.weight", "lm_head.weight", "norm.weight"):
        assert torch.equal(checkpoint.get_parameter(name), online.get_parameter(name))
    assert checkpoint.lm_head.weight.dtype == torch.bfloat16  # the LM head stays bf16


def test_per_tensor_static_checkpoint_fuses_exactly(fp8_on_cpu, plain, tmp_path) -> None:
    folder = write_fp8_checkpoint(plain, tmp_path / "ct", per_channel=False, static=True)
    model, stored = _load(folder), load_file(folder / "model.safetensors")
    assert model.quant == Fp8Config(CT, per_channel_weights=False, static_input_scales=True)
    qkv = model.layers[0].self_attn.qkv_proj
    assert torch.equal(qkv.dequantized_weight(), _stored_qkv(stored, 0))  # scales row by row
    assert qkv.input_scale.item() == pytest.approx(max(INPUT_SCALES[n] for n in PROJECTIONS[:3]))
    down = model.layers[1].mlp.down_proj
    assert down.input_scale.item() == pytest.approx(INPUT_SCALES["down_proj"])
    plain_weight = load_file(plain / "model.safetensors")["model.layers.1.mlp.down_proj.weight"]
    error = (down.dequantized_weight() - plain_weight).abs().max()
    assert error <= plain_weight.abs().max() / 16  # half an e4m3 step at the tensor's amax


def _stored_qkv(stored: dict[str, torch.Tensor], layer: int) -> torch.Tensor:
    """Layer's q, k and v weights as the checkpoint stores them, dequantized and stacked."""
    parts = [f"model.layers.{layer}.self_attn.{n}_proj." for n in "qkv"]
    return torch.cat(
        [stored[p + "weight"].float() * stored[p + "weight_scale"].float() for p in parts]
    )


def test_modelopt_checkpoint_loads(fp8_on_cpu, plain, tmp_path) -> None:
    folder = write_fp8_checkpoint(
        plain, tmp_path / "mo", layout=MODELOPT, per_channel=False, static=True
    )
    model, stored = _load(folder), load_file(folder / "model.safetensors")
    assert stored["model.layers.1.self_attn.q_proj.weight_scale"].shape == ()
    assert model.quant == Fp8Config(MODELOPT, per_channel_weights=False, static_input_scales=True)
    qkv = model.layers[1].self_attn.qkv_proj
    assert torch.equal(qkv.dequantized_weight(), _stored_qkv(stored, 1))
    assert qkv.input_scale.item() == pytest.approx(INPUT_SCALES["k_proj"])


def test_an_fp8_lm_head_is_dequantized(fp8_on_cpu, plain, tmp_path) -> None:
    folder = write_fp8_checkpoint(plain, tmp_path / "ct", quantize_lm_head=True)
    model, stored = _load(folder), load_file(folder / "model.safetensors")
    assert stored["lm_head.weight"].dtype == FP8_DTYPE
    want = stored["lm_head.weight"].float() * stored["lm_head.weight_scale"]
    assert type(model.lm_head) is nn.Linear
    assert torch.equal(model.lm_head.weight, want.bfloat16())


def test_checkpoint_errors_name_the_tensor(fp8_on_cpu, plain, tmp_path) -> None:
    folder = write_fp8_checkpoint(plain, tmp_path / "ct")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.0.self_attn.k_proj.weight_scale"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(
        ValueError, match=r"missing tensor 'layers\.0\.self_attn\.k_proj\.weight_scale'"
    ):
        _load(folder)
    shutil.copy(plain / "model.safetensors", folder / "model.safetensors")  # bf16 weights
    with pytest.raises(ValueError, match=r"q_proj\.weight is torch\.float32 in an FP8 checkpoint"):
        _load(folder)
    with pytest.raises(ValueError, match="FP8 weights run in bfloat16"):
        load_model(plain, read_model_config(plain), 128, CPU, torch.float32, quantization="fp8")


def test_dummy_fp8_weights_are_the_bf16_draws_quantized(fp8_on_cpu, tmp_path) -> None:
    folder = make_tiny_checkpoint(tmp_path, weights=False)
    config = read_model_config(folder)
    fp8 = load_model(folder, config, 128, CPU, torch.bfloat16, "dummy", quantization="fp8")
    bf16 = load_model(folder, config, 128, CPU, torch.bfloat16, "dummy")
    for name, layer in _fp8_layers(fp8).items():
        want = quantize_weight(bf16.get_submodule(name).weight)
        assert torch.equal(layer.weight.view(torch.uint8), want.weight.view(torch.uint8))
        assert torch.equal(layer.weight_scale, want.scale.reshape(1, -1))
    static = write_fp8_checkpoint(make_tiny_checkpoint(tmp_path / "p"), tmp_path / "s", static=True)
    for file in static.glob("*.safetensors"):
        file.unlink()
    model = load_model(static, config, 128, CPU, torch.bfloat16, "dummy")  # config.json only
    assert model.quant.static_input_scales and model.layers[0].mlp.down_proj.input_scale == 1.0


def _greedy(model: nn.Module, folder: Path) -> dict[str, list[int]]:
    engine = build_engine(model, str(folder), num_blocks=64, dtype="bfloat16", max_model_len=128)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for i, prompt in enumerate([[5, 17, 300, 42], list(range(1, 90, 3)), [7]]):
        engine.add_request(f"r{i}", prompt, params)
    tokens = run_to_completion(engine)
    engine.assert_no_leaks()
    return tokens


@pytest.mark.usefixtures("fp8_on_cpu", "cuda_contract")
@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen3"])  # bias; q/k norms
def test_engine_runs_fp8_with_its_reference_tokens(architecture, tmp_path, monkeypatch) -> None:
    """The whole model through the engine (packed prefill, decode): Fp8Linear's forward (the
    scaled-mm contract stand-in) gives the tokens of its float32 reference."""
    folder = make_tiny_checkpoint(tmp_path, architecture=architecture, init_std=0.05)
    model = _load(folder, quantization="fp8")
    attention = model.layers[0].self_attn
    assert (attention.qkv_proj.bias is not None) == (architecture == "qwen2")
    assert (attention.q_norm is not None) == (architecture == "qwen3")  # norms beside FP8 qkv
    got = _greedy(model, folder)
    monkeypatch.setattr(Fp8Linear, "forward", Fp8Linear.forward_reference)
    assert got == _greedy(model, folder)


def test_engine_refuses_online_fp8_on_cpu(plain, tmp_path) -> None:
    """An FP8 checkpoint loads on CPU dequantized (test_quantized_checkpoints.py); quantizing
    at load is refused there."""
    folder = write_fp8_checkpoint(plain, tmp_path / "ct")
    message = r"FP8 weights need a CUDA GPU with FP8 support \(compute capability >= 8.9\); "
    model = load_model(folder, read_model_config(folder), 128, CPU, torch.float32)
    assert not _fp8_layers(model)
    with pytest.raises(ValueError, match=message + "this engine runs on cpu"):
        build_engine(model_path=str(plain), num_blocks=64, quantization="fp8")
    with pytest.raises(ValueError, match=message):  # the loader itself, dummy weights too
        load_model(plain, read_model_config(plain), 128, CPU, torch.bfloat16, "dummy", "fp8")
