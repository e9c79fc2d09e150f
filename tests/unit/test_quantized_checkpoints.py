"""Quantized checkpoints as users download them, written here in their projects' own on-disk
layouts (AutoAWQ's GEMM, GPTQ v1 / v2 with act-order, compressed-tensors W4A16, FP8 and INT8), load
on CPU through the dequantizing reference path and give transformers' greedy tokens on the same
weights, dequantized here independently (bit by bit, from the formats' definitions) and saved
as a plain checkpoint. transformers itself cannot load AWQ / GPTQ here: it needs gptqmodel,
which ships no wheel and wants a newer torch.

The GPU layers' packing (Int4Linear: torch's tinygemm layout) is checked against the same
reference through torch's CPU twin of the kernel; the CUDA kernel itself is not run here.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.models.loader import load_model, read_model_config
from engine.quant.checkpoint import quantized_linear_tensors
from engine.quant.int4 import Int4Linear, int4_linear_state, read_int4
from engine.quant.int8 import Int8Linear, int8_linear_state, read_int8
from engine.quant.int_config import Int4Config
from engine.sampling.sampling_params import SamplingParams
from tests.conftest import build_engine, run_to_completion
from tests.factories import make_tiny_checkpoint, transformers_greedy
from tests.unit.test_fp8_checkpoint import write_fp8_checkpoint

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: nibble i of a word holds column AWQ_ORDER[i]
GROUP = 32
# act-order's channel order follows the input: projections that share it share g_idx
SAME_INPUT = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "o_proj": 1, "gate_proj": 2, "up_proj": 2}
SAME_INPUT["down_proj"] = 3
PROMPTS = [[5, 17, 300, 42], list(range(1, 200, 3)), [7]]
NEW_TOKENS = 12


# --- the formats, written from their definitions -------------------------------------------


def _quantize_groups(w: np.ndarray, groups: np.ndarray, symmetric: bool):
    """w [N, K] float32 -> codes [N, K] (0..15), scales fp16 [N, G], zeros [N, G] (ints) with
    w ~ (codes - zero) * scale per group of input channels (groups[k]: channel k's group)."""
    num_groups = int(groups.max()) + 1
    scales = np.zeros((w.shape[0], num_groups), np.float16)
    zeros = np.zeros((w.shape[0], num_groups), np.int64)
    codes = np.zeros(w.shape, np.int64)
    for g in range(num_groups):
        cols = w[:, groups == g]
        if symmetric:
            scale = (np.abs(cols).max(axis=1) / 7.5).astype(np.float16)
            zero = np.full(w.shape[0], 8)
        else:
            lo, hi = np.minimum(cols.min(axis=1), 0), np.maximum(cols.max(axis=1), 0)
            scale = ((hi - lo) / 15).astype(np.float16)
            zero = np.clip(np.round(-lo / scale.astype(np.float32)), 0, 15).astype(np.int64)
        s32 = scale.astype(np.float32)[:, None]
        codes[:, groups == g] = np.clip(np.round(cols / s32) + zero[:, None], 0, 15)
        scales[:, g], zeros[:, g] = scale, zero
    return codes, scales, zeros


def _words(nibbles: np.ndarray) -> np.ndarray:
    """[..., 8] values 0..15 -> int32 [...]: nibble i in bits 4i..4i+3."""
    word = np.zeros(nibbles.shape[:-1], np.uint64)
    for i in range(8):
        word |= nibbles[..., i].astype(np.uint64) << np.uint64(4 * i)
    return word.astype(np.uint32).view(np.int32)


def _awq_tensors(w: np.ndarray) -> dict[str, np.ndarray]:
    """AutoAWQ GEMM: qweight [K, N/8], qzeros [K/group, N/8] (both packed along the outputs
    in AWQ_ORDER), scales fp16 [K/group, N]."""
    num_inputs = w.shape[1]
    codes, scales, zeros = _quantize_groups(w, np.arange(num_inputs) // GROUP, symmetric=False)

    def pack(values: np.ndarray) -> np.ndarray:  # [rows, N] -> [rows, N/8]
        grouped = values.reshape(values.shape[0], -1, 8)
        return _words(grouped[..., AWQ_ORDER])

    return {"qweight": pack(codes.T), "qzeros": pack(zeros.T), "scales": scales.T.copy()}


def _gptq_tensors(w: np.ndarray, v1: bool, symmetric: bool, act_order: bool, seed: int):
    """GPTQ: qweight [K/8, N] (packed along the inputs), qzeros [G, N/8] (along the outputs;
    v1 stores each zero minus one), scales fp16 [G, N], g_idx int32 [K]."""
    num_inputs = w.shape[1]
    order = np.random.default_rng(seed).permutation(num_inputs) if act_order else None
    g_idx = np.arange(num_inputs) // GROUP
    if order is not None:  # act-order: the j-th channel quantized (order[j]) is in group j // GROUP
        g_idx = np.empty(num_inputs, np.int64)
        g_idx[order] = np.arange(num_inputs) // GROUP
    codes, scales, zeros = _quantize_groups(w, g_idx, symmetric)
    stored = zeros - 1 if v1 else zeros
    return {
        "qweight": _words(codes.T.reshape(num_inputs // 8, 8, -1).transpose(0, 2, 1)),
        "qzeros": _words(stored.T.reshape(stored.shape[1], -1, 8)),
        "scales": scales.T.copy(),
        "g_idx": g_idx.astype(np.int32),
    }


def _compressed_w4a16_tensors(w: np.ndarray) -> dict[str, np.ndarray]:
    """compressed-tensors pack-quantized, symmetric groups: weight_packed [N, K/8] (codes q + 8
    packed along the inputs), weight_scale [N, K/group], weight_shape [2]."""
    num_inputs = w.shape[1]
    codes, scales, _ = _quantize_groups(w, np.arange(num_inputs) // GROUP, symmetric=True)
    return {
        "weight_packed": _words(codes.reshape(codes.shape[0], -1, 8)),
        "weight_scale": scales,
        "weight_shape": np.array(w.shape, np.int64),
    }


def _dequantize_compressed(t: dict[str, torch.Tensor]) -> torch.Tensor:
    """Bit by bit: w[n, k] = (nibble k % 8 of weight_packed[n, k // 8] - 8) * scale."""
    packed, scales = t["weight_packed"].numpy(), t["weight_scale"].numpy()
    num_outputs, num_inputs = (int(v) for v in t["weight_shape"])
    w = np.zeros((num_outputs, num_inputs), np.float32)
    for n in range(num_outputs):
        for k in range(num_inputs):
            q = _nibble(packed[n, k // 8], k % 8) - 8
            w[n, k] = np.float32(q) * np.float32(scales[n, k // GROUP])
    return torch.from_numpy(w)


def _nibble(word: int, i: int) -> int:
    return (int(word) >> (4 * i)) & 15


def _dequantize_awq(t: dict[str, torch.Tensor]) -> torch.Tensor:
    """Bit by bit: w[n, k] = (q - z) * s, column n of a word at nibble AWQ_ORDER.index(n % 8)."""
    qweight, qzeros, scales = (t[k].numpy() for k in ("qweight", "qzeros", "scales"))
    num_inputs, num_outputs = qweight.shape[0], qweight.shape[1] * 8
    w = np.zeros((num_outputs, num_inputs), np.float32)
    for k in range(num_inputs):
        for n in range(num_outputs):
            pos = AWQ_ORDER.index(n % 8)
            q = _nibble(qweight[k, n // 8], pos)
            z = _nibble(qzeros[k // GROUP, n // 8], pos)
            w[n, k] = np.float32(q - z) * np.float32(scales[k // GROUP, n])
    return torch.from_numpy(w)


def _dequantize_gptq(t: dict[str, torch.Tensor], v1: bool) -> torch.Tensor:
    """Bit by bit: q at nibble k % 8 of qweight[k // 8, n], z at nibble n % 8 of
    qzeros[g, n // 8] (+1 in v1), g = g_idx[k]."""
    qweight, qzeros, scales, g_idx = (
        t[k].numpy() for k in ("qweight", "qzeros", "scales", "g_idx")
    )
    num_inputs, num_outputs = qweight.shape[0] * 8, qweight.shape[1]
    w = np.zeros((num_outputs, num_inputs), np.float32)
    for k in range(num_inputs):
        g = g_idx[k]
        for n in range(num_outputs):
            q = _nibble(qweight[k // 8, n], k % 8)
            z = _nibble(qzeros[g, n // 8], n % 8) + (1 if v1 else 0)
            w[n, k] = np.float32(q - z) * np.float32(scales[g, n])
    return torch.from_numpy(w)


def _int8_tensors(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """compressed-tensors int-quantized, symmetric per channel: weight int8, weight_scale [N, 1]."""
    scale = w.abs().amax(dim=1, keepdim=True) / 127
    q = (w / scale).round().clamp(-127, 127).to(torch.int8)
    return {"weight": q, "weight_scale": scale, "weight_zero_point": torch.zeros_like(scale).int()}


def _int8_config() -> dict:
    int8 = {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None}
    return {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {**int8, "strategy": "channel", "dynamic": False},
                "input_activations": {**int8, "strategy": "token", "dynamic": True},
            }
        },
    }


KINDS = {
    "awq": {
        "quant_method": "awq", "bits": 4, "group_size": GROUP, "version": "gemm",
        "zero_point": True,
    },
    "gptq-v1-act-order": {
        "quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": True, "sym": False,
        "checkpoint_format": "gptq",
    },
    "compressed-w4a16": {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {
            "targets": ["Linear"], "input_activations": None, "format": "pack-quantized",
            "weights": {
                "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                "group_size": GROUP, "actorder": None, "dynamic": False,
            },
        }},
    },
    "gptq-v2-sym": {
        "quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": True,
        "checkpoint_format": "gptq_v2",
    },
}  # fmt: skip


def write_quantized(plain: Path, dst: Path, kind: str) -> tuple[Path, Path]:
    """The checkpoint of kind (dst) and its independent dequantization as a plain checkpoint
    (dst / "reference")."""
    reference = dst / "reference"
    reference.mkdir(parents=True)
    for file in plain.iterdir():
        if file.is_file() and file.suffix != ".safetensors":
            shutil.copy(file, dst / file.name)
            shutil.copy(file, reference / file.name)
    quantized, dequantized = {}, {}
    for name, tensor in load_file(plain / "model.safetensors").items():
        module = name.removesuffix(".weight")
        if name.rsplit(".", 2)[-2] not in PROJECTIONS:
            quantized[name] = dequantized[name] = tensor
            continue
        w = tensor.float()
        if kind == "int8":
            parts = _int8_tensors(w)
            dequantized[name] = parts["weight"].float() * parts["weight_scale"]
        else:
            cfg = KINDS[kind]
            if kind == "awq":
                arrays = _awq_tensors(w.numpy())
            elif kind == "compressed-w4a16":
                arrays = _compressed_w4a16_tensors(w.numpy())
            else:
                v1, sym = cfg["checkpoint_format"] == "gptq", cfg["sym"]
                seed = int(name.split(".")[2]) * 10 + SAME_INPUT[name.rsplit(".", 2)[-2]]
                arrays = _gptq_tensors(w.numpy(), v1, sym, cfg["desc_act"], seed)
            parts = {k: torch.from_numpy(v) for k, v in arrays.items()}
            if kind == "awq":
                dequantized[name] = _dequantize_awq(parts)
            elif kind == "compressed-w4a16":
                dequantized[name] = _dequantize_compressed(parts)
            else:
                dequantized[name] = _dequantize_gptq(parts, v1)
            assert (dequantized[name] - w).abs().max() < 0.2 * w.abs().max()  # it is the weight
        quantized |= {f"{module}.{k}": v for k, v in parts.items()}
    save_file(quantized, dst / "model.safetensors", metadata={"format": "pt"})
    save_file(dequantized, reference / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((plain / "config.json").read_text())
    config["quantization_config"] = _int8_config() if kind == "int8" else KINDS[kind]
    (dst / "config.json").write_text(json.dumps(config))
    return dst, reference


def write_fp8_reference(fp8: Path, dst: Path) -> Path:
    """A compressed-tensors FP8 checkpoint's weights dequantized (e4m3 * scale) as plain."""
    dst.mkdir(parents=True)
    for file in fp8.iterdir():
        if file.is_file() and file.suffix != ".safetensors":
            shutil.copy(file, dst / file.name)
    tensors = load_file(fp8 / "model.safetensors")
    out = {}
    for name, tensor in tensors.items():
        if name.endswith(("weight_scale", "input_scale")):
            continue
        scale = tensors.get(name.removesuffix(".weight") + ".weight_scale")
        out[name] = tensor if scale is None else tensor.float() * scale.float()
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    del config["quantization_config"]
    (dst / "config.json").write_text(json.dumps(config))
    return dst


# --- greedy tokens ---------------------------------------------------------------------------


def _engine_tokens(folder: Path) -> list[list[int]]:
    engine = build_engine(model_path=str(folder), num_blocks=64, max_num_batched_tokens=32)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"t{i}", p, params)
    got = run_to_completion(engine)
    engine.assert_no_leaks()
    return [got[f"t{i}"] for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("plain"))


@pytest.mark.parametrize("kind", [*KINDS, "int8"])
def test_checkpoint_matches_transformers_on_its_dequantized_weights(plain, tmp_path, kind):
    folder, reference = write_quantized(plain, tmp_path / kind, kind)
    model = load_model(folder, read_model_config(folder), 128, torch.device("cpu"), torch.float32)
    assert all(type(m) is torch.nn.Linear for n, m in model.named_modules() if n.endswith("proj"))
    assert _engine_tokens(folder) == transformers_greedy(reference, PROMPTS, NEW_TOKENS)


def test_compressed_tensors_fp8_loads_on_cpu(plain, tmp_path):
    folder = write_fp8_checkpoint(plain, tmp_path / "fp8", per_channel=False, static=True)
    reference = write_fp8_reference(folder, tmp_path / "reference")
    assert _engine_tokens(folder) == transformers_greedy(reference, PROMPTS, NEW_TOKENS)


# --- the GPU layers' packing, through torch's CPU twin of the kernels ------------------------


def _dequantized_reference(reference: Path, module: str) -> torch.Tensor:
    return load_file(reference / "model.safetensors")[f"model.{module}.weight"]


@pytest.mark.parametrize("kind", list(KINDS))
def test_int4_linear_packing_matches_the_reference(plain, tmp_path, kind):
    """Int4Linear (tinygemm's layout, scales and zeros as (8 - z) * s, act-order as an input
    permutation) computes x W^T for the reference W, up to bf16 scales and a bf16 output."""
    folder, reference = write_quantized(plain, tmp_path / kind, kind)
    tensors = {
        k.removeprefix("model."): v for k, v in load_file(folder / "model.safetensors").items()
    }
    method = {"awq": "awq", "compressed-w4a16": "compressed-tensors"}.get(kind, "gptq")
    quant = Int4Config(
        method, GROUP,
        v1_zeros=KINDS[kind].get("checkpoint_format") == "gptq",
        desc_act=bool(KINDS[kind].get("desc_act")),
    )  # fmt: skip
    fused = {"layers.0.self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj")}
    fused["layers.1.mlp.down_proj"] = ("down_proj",)
    for name, parts in fused.items():  # the loader's path (q/k/v fused), packed for the CPU twin
        modules = [f"{name.rsplit('.', 1)[0]}.{part}" for part in parts]
        state = quantized_linear_tensors(tensors.pop, "x", modules, quant, torch.device("cpu"))
        want = torch.cat([_dequantized_reference(reference, module) for module in modules])
        out_features, in_features = want.shape
        layer = Int4Linear(in_features, out_features, False, quant, kernel="cpu")
        layer.load_state_dict({k.removeprefix("x."): v for k, v in state.items()}, assign=True)
        assert (layer.input_perm is not None) == quant.desc_act
        x = torch.randn(5, in_features, generator=torch.Generator().manual_seed(0))
        got = layer(x.bfloat16()).float()
        expected = x.bfloat16().float() @ want.t()
        err = (got - expected).abs().max() / expected.abs().max()
        assert err < 0.02, f"{name}: relative error {err}"
    weight = read_int4(tensors.pop, "layers.1.mlp.up_proj", quant)  # the scales the kernel gets
    state = int4_linear_state("x", weight, quant, kernel="cpu")
    if not quant.desc_act:
        scales = state["x.scales_and_zeros"][..., 0].t().float()
        torch.testing.assert_close(scales, weight.scales.bfloat16().float())


def test_cuda_int4_packing_holds_two_codes_a_byte_high_nibble_first():
    """The uint8 operand of torch's CUDA _convert_weight_to_int4pack: byte j of a row holds
    codes 2j (high nibble) and 2j + 1 (low), as torchao packs it; the op itself needs CUDA."""
    codes = torch.randint(0, 16, (8, 64), dtype=torch.uint8)
    pairs = codes[:, ::2] << 4 | codes[:, 1::2]
    assert torch.equal(torch.stack([pairs >> 4, pairs & 15], dim=-1).reshape(8, 64), codes)


def test_int8_linear_matches_its_reference(plain, tmp_path):
    """Int8Linear (torch._int_mm, which also runs on CPU) equals its float32 reference, and
    stays close to the dequantized weight's product."""
    folder, reference = write_quantized(plain, tmp_path / "int8", "int8")
    tensors = {
        k.removeprefix("model."): v for k, v in load_file(folder / "model.safetensors").items()
    }
    module = "layers.0.mlp.gate_proj"
    state = int8_linear_state("x", read_int8(tensors.pop, module))
    want = _dequantized_reference(reference, module)
    layer = Int8Linear(want.shape[1], want.shape[0], False)
    layer.load_state_dict({k.removeprefix("x."): v for k, v in state.items()}, assign=True)
    x = torch.randn(3, want.shape[1], generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(layer(x), layer.forward_reference(x), rtol=1e-5, atol=1e-5)
    err = (layer(x) - x @ want.t()).abs().max() / (x @ want.t()).abs().max()
    assert err < 0.03


def test_broken_tensors_are_named(plain, tmp_path):
    folder, _ = write_quantized(plain, tmp_path / "gptq", "gptq-v2-sym")
    tensors = load_file(folder / "model.safetensors")
    config = read_model_config(folder)
    cpu = torch.device("cpu")
    del tensors["model.layers.1.mlp.up_proj.g_idx"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensor 'layers\.1\.mlp\.up_proj\.g_idx'"):
        load_model(folder, config, 128, cpu, torch.float32)
    tensors["model.layers.1.mlp.up_proj.g_idx"] = torch.zeros(64, dtype=torch.int32)
    tensors["model.layers.0.self_attn.o_proj.scales"] = torch.ones(3, 64, dtype=torch.float16)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"layers.0.self_attn.o_proj.scales has shape \(3, 64\)"):
        load_model(folder, config, 128, cpu, torch.float32)
