"""Finds and loads checkpoints: HF folders (config.json + safetensors) and GGUF files.

A GGUF file is converted once (through transformers + gguf) into a safetensors folder under
the kvrelay cache (Settings.cache_dir), so later loads take seconds. Owns no state beyond that
on-disk cache. A checkpoint loads only when every tensor is understood: one no module takes
(bar a short list safe to skip) or a weight no tensor fills is refused by name (_fuse_checkpoint).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from engine.config import DEFAULT_MODEL as DEFAULT_MODEL  # conftest's import
from engine.config import CheckpointRefused, ModelConfig
from engine.model_source import checkpoint_files, model_source
from engine.model_source import default_gguf_path as default_gguf_path  # tests' import
from engine.models.llama import MOE_FAMILIES, check_moe_quant
from engine.models.moe import expert_tensors
from engine.models.registry import model_class
from engine.parallel.sharding import shard_weights
from engine.parallel.tensor_parallel import SINGLE, TensorParallel
from engine.quant.checkpoint import dequantized_weight, plain_weight, quantized_linear_tensors
from engine.quant.config import Fp8Config, QuantScheme, read_quant_config, resolve_quantization
from engine.quant.fp8 import SCALE_NAMES, check_fp8_device, linear_state, quantize_weight
from engine.quant.fp8_types import FP8_DTYPE
from engine.quant.int_config import Int4Config, Int8Config
from engine.quant.kv_scales import take_kv_scales
from engine.settings import Settings

_CONVERSION_MARKER = "kvrelay_source.json"

Progress = Callable[[str], None]


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def resolve_model(
    name_or_path: str | os.PathLike, progress: Progress = _stderr, cache_dir: Path | None = None
) -> Path:
    """Return an HF checkpoint folder for a model name, a GGUF file or a folder (which one:
    engine/model_source.py). cache_dir: where a GGUF file is converted (an engine passes its
    settings'; None: the environment's Settings, for tools and tests that have no EngineConfig)."""
    source = model_source(name_or_path)
    if source.suffix == ".gguf" and not source.is_dir():
        return convert_gguf(source, progress, cache_dir)
    return source


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def convert_gguf(
    gguf_path: Path, progress: Progress = _stderr, cache_dir: Path | None = None
) -> Path:
    """Convert a GGUF file into a safetensors folder under cache_dir (resolve_model's) once;
    return the folder."""
    gguf_path = Path(gguf_path).resolve()
    cache_dir = Settings.from_env().cache_dir if cache_dir is None else cache_dir
    target = cache_dir / "models" / f"{gguf_path.stem}-{_file_digest(gguf_path)}"
    if (target / _CONVERSION_MARKER).is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    progress(f"kvrelay: converting {gguf_path.name} to safetensors in {target} (one time)")
    start = time.monotonic()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        folder, name = str(gguf_path.parent), gguf_path.name
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
        except ImportError:  # a missing package (gguf): its own words say which
            raise
        except Exception as e:  # transformers' words name neither the file nor the likely cause
            raise ValueError(
                f"{gguf_path} could not be read as a GGUF model ({type(e).__name__}: {e}); "
                "a truncated or corrupt file?"
            ) from None
        progress("kvrelay: writing safetensors")
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["architectures"] = config.get("architectures") or [type(model).__name__]
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        model.generation_config.to_json_file(staging / "generation_config.json")
        tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
        if config.get("tie_word_embeddings"):
            tensors.pop("lm_head.weight", None)
        save_file(tensors, staging / "model.safetensors", metadata={"format": "pt"})
        tokenizer.save_pretrained(staging)
        marker = {"source": str(gguf_path), "converted_at": time.time()}
        (staging / _CONVERSION_MARKER).write_text(json.dumps(marker))
        # another process (a second worker) may have converted it meanwhile: its copy stays
        if not (target / _CONVERSION_MARKER).is_file():
            if target.exists():  # a conversion that did not finish
                shutil.rmtree(target)
            try:
                staging.rename(target)
            except OSError:
                if not (target / _CONVERSION_MARKER).is_file():
                    raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    progress(f"kvrelay: converted in {time.monotonic() - start:.1f} s")
    return target


def read_model_config(folder: Path, model_id: str | None = None) -> ModelConfig:
    """ModelConfig from config.json, with eos ids from generation_config.json when present;
    CheckpointRefused for a config.json the engine does not run."""
    try:
        config = ModelConfig.from_dir(folder, model_id or folder.name)
    except KeyError as e:
        raise CheckpointRefused(f"{folder / 'config.json'} lacks {e}") from None
    except ValueError as e:
        raise CheckpointRefused(str(e)) from None
    gen_path = folder / "generation_config.json"
    if gen_path.is_file():
        eos = json.loads(gen_path.read_text()).get("eos_token_id")
        extra = eos if isinstance(eos, list) else ([] if eos is None else [eos])
        merged = tuple(dict.fromkeys([*config.eos_token_ids, *map(int, extra)]))
        config = ModelConfig(**{**config.__dict__, "eos_token_ids": merged})
    return config


def _read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    files = checkpoint_files(folder)
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                tensors[name] = f.get_tensor(name)
    return tensors


# Checkpoint tensors (names without "model.") that no module takes and that are safe to skip:
# each is derived from config.json or duplicates a tensor that is loaded.
_SKIPPABLE_SUFFIXES = (
    # RoPE's inverse frequencies, a buffer older transformers versions saved; the engine
    # computes the same table from config.json's rope_theta and rope_scaling (models/rope.py).
    ".rotary_emb.inv_freq",
)
# lm_head.weight with tie_word_embeddings is skipped only when it equals embed_tokens.weight
# (a second copy of the tied matrix); a different head is refused (_check_tied_head).
_MAX_NAMED = 5  # leftover tensors named in the error
_LAYER_NORMS = ("input_layernorm", "post_attention_layernorm")


def _fuse_checkpoint(
    config: ModelConfig,
    raw: dict[str, torch.Tensor],
    quant: QuantScheme | None,
    device: torch.device,
    dequantize: bool = False,
    source: str | Path = "the checkpoint",
) -> dict[str, torch.Tensor]:
    """Rename HF tensors to this model's names, fusing q/k/v and gate/up; with quant the four
    projections become its quantized layers' state (engine/quant/checkpoint.py; online
    quantization and 4-bit packing run on device), or with dequantize plain float32 weights
    (the CPU reference path). A MoE layer (config.moe_layers) takes its router and experts
    through moe.expert_tensors (the family from config.architecture), unquantized. A module
    weight no tensor fills, or a tensor no module takes (other than the skippable ones above),
    is refused by name; source (the folder) is named with it."""
    raw = {name.removeprefix("model."): t for name, t in raw.items()}
    out: dict[str, torch.Tensor] = {}

    def take(name: str) -> torch.Tensor:
        try:
            return raw.pop(name)
        except KeyError:
            raise CheckpointRefused(f"checkpoint {source} is missing tensor {name!r}") from None

    def linear(name: str, parts: list[str]) -> dict[str, torch.Tensor]:
        if quant is not None and dequantize:
            weights = [dequantized_weight(take, part, quant) for part in parts]
        elif quant is not None:
            return quantized_linear_tensors(take, name, parts, quant, device)
        else:
            weights = [take(part + ".weight") for part in parts]
        return {name + ".weight": weights[0] if len(weights) == 1 else torch.cat(weights)}

    family = MOE_FAMILIES.get(config.architecture, "")
    if config.moe_layers and not family:
        raise CheckpointRefused(
            f"{config.architecture} has no sparse MoE layers, but config.json's num_experts is "
            f"{config.num_experts}; MoE runs for {', '.join(MOE_FAMILIES)}"
        )
    out["embed_tokens.weight"] = take("embed_tokens.weight")
    out["norm.weight"] = take("norm.weight")
    # Llama's two norms a layer, or the model class's own (Gemma 3's four)
    layer_norms = getattr(model_class(config), "LAYER_NORMS", _LAYER_NORMS)
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = plain_weight(take, "lm_head")
    for i in range(config.num_layers):
        p = f"layers.{i}."
        attn = p + "self_attn."
        out |= linear(attn + "qkv_proj", [attn + f"{n}_proj" for n in ("q", "k", "v")])
        if config.attention_bias:
            out[attn + "qkv_proj.bias"] = torch.cat(
                [take(attn + f"{n}_proj.bias") for n in ("q", "k", "v")]
            )
        out |= linear(attn + "o_proj", [attn + "o_proj"])
        if config.o_proj_bias:
            out[attn + "o_proj.bias"] = take(attn + "o_proj.bias")
        if i in config.moe_layers:
            moe = expert_tensors(take, p, config.num_experts, family)
            out |= {p + name: t for name, t in moe.items()}
        else:
            out |= linear(p + "mlp.gate_up_proj", [p + "mlp.gate_proj", p + "mlp.up_proj"])
            out |= linear(p + "mlp.down_proj", [p + "mlp.down_proj"])
        for norm in layer_norms:
            out[p + norm + ".weight"] = take(p + norm + ".weight")
        if config.qk_norm:
            for norm in ("q_norm", "k_norm"):
                out[attn + norm + ".weight"] = take(attn + norm + ".weight")
    _refuse_leftovers(config, raw, out, source)
    return out


def _refuse_leftovers(
    config: ModelConfig,
    left: dict[str, torch.Tensor],
    taken: dict[str, torch.Tensor],
    source: str | Path,
) -> None:
    """Raise naming the tensors (up to _MAX_NAMED, and their count) that no module took: a
    checkpoint with weights the model would ignore is one whose math the engine does not run."""
    if config.tie_word_embeddings and "lm_head.weight" in left:
        _check_tied_head(left.pop("lm_head.weight"), taken["embed_tokens.weight"], source)
    unused = sorted(name for name in left if not name.endswith(_SKIPPABLE_SUFFIXES))
    if not unused:
        return
    named = ", ".join(repr(name) for name in unused[:_MAX_NAMED])
    more = f" and {len(unused) - _MAX_NAMED} more" if len(unused) > _MAX_NAMED else ""
    raise CheckpointRefused(
        f"checkpoint {source} has {len(unused)} tensor(s) that no module of "
        f"{config.architecture} takes: {named}{more}; kvrelay refuses weights it would ignore"
    )


def _check_tied_head(head: torch.Tensor, embed: torch.Tensor, source: str | Path) -> None:
    same = head.shape == embed.shape and torch.equal(head, embed.to(head.dtype))
    if not same:
        raise CheckpointRefused(
            f"checkpoint {source} has tensor 'lm_head.weight' unlike 'embed_tokens.weight', but "
            "config.json's tie_word_embeddings is true (the LM head is the embedding matrix)"
        )


LOAD_FORMATS = ("auto", "dummy")


def load_model(
    folder: Path,
    config: ModelConfig,
    max_positions: int,
    device: torch.device,
    dtype: torch.dtype,
    load_format: str = "auto",
    quantization: str | None = None,
    fp8_fast_accum: bool = True,
    tp: TensorParallel = SINGLE,
) -> nn.Module:
    """Build the model without initialising weights, then assign the checkpoint's tensors
    ("auto") or random ones ("dummy": config.json is all that is read; for speed runs).

    A quantized checkpoint (config.json's quantization_config, ModelOpt's hf_quant_config.json:
    FP8, AWQ / GPTQ 4-bit, compressed-tensors INT8) loads with its quantized layers on CUDA
    and dequantized into plain layers of dtype on CPU (the reference path); quantization "fp8"
    quantizes a plain checkpoint at load (EngineConfig, CUDA only). FP8 GEMMs accumulate fast
    or exactly as fp8_fast_accum says (Settings). KV-cache scales in the checkpoint
    (engine/quant/kv_scales.py) become model.kv_scales. tp: the rank whose slices of the full
    tensors are kept (engine/parallel/sharding.py)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    quant = resolve_quantization(quantization, read_quant_config(folder), fp8_fast_accum)
    check_moe_quant(config, quant)  # before the CPU path would dequantize it
    dequantize = quant is not None and quant.from_checkpoint and not quantized_kernels_on(device)
    if load_format == "dummy":
        return random_model(
            config, max_positions, device, dtype, quant=None if dequantize else quant, tp=tp
        )
    model = _meta_model(config, max_positions, device, dtype, None if dequantize else quant, tp)
    raw = _read_safetensors(folder)
    kv_scales = take_kv_scales(raw, config.num_layers)
    weights = _fuse_checkpoint(config, raw, quant, device, dequantize, source=folder)
    weights = shard_weights(weights, config, tp)
    weights = {name: _to_device(name, t, device, dtype) for name, t in weights.items()}
    try:
        model.load_state_dict(weights, strict=True, assign=True)
    except RuntimeError as e:  # names are kvrelay's fused ones: say what they are made of
        mismatches = [line.strip() for line in str(e).splitlines() if "size mismatch" in line]
        if not mismatches:
            raise
        raise CheckpointRefused(
            f"checkpoint {folder}: its tensors' shapes do not match its config.json: "
            f"{mismatches[0]} (qkv_proj joins the checkpoint's q/k/v_proj, gate_up_proj its "
            'gate/up_proj, and "checkpoint" means their join)'
        ) from None
    model.kv_scales = kv_scales
    return model.to(device).eval()


def quantized_kernels_on(device: torch.device) -> bool:
    """Whether a quantized checkpoint keeps its quantized layers on device (CUDA); elsewhere
    it is dequantized at load into plain layers (the CPU reference path)."""
    return device.type == "cuda"


def _meta_model(
    config: ModelConfig,
    max_positions: int,
    device: torch.device,
    dtype: torch.dtype,
    quant: QuantScheme | None,
    tp: TensorParallel = SINGLE,
) -> nn.Module:
    """The model on the meta device; quantized layers are refused here where they cannot run."""
    if quant is not None and tp.is_parallel:
        raise ValueError("quantized weights are not split across tensor-parallel ranks yet")
    if isinstance(quant, Fp8Config):
        check_fp8_device(device)
    elif isinstance(quant, Int4Config | Int8Config) and device.type != "cuda":
        raise ValueError(f"{quant.method} quantized layers run on CUDA GPUs, not {device}")
    if quant is not None and dtype != torch.bfloat16:
        kind = "FP8" if isinstance(quant, Fp8Config) else "Quantized"
        raise ValueError(f"{kind} weights run in bfloat16 (dtype auto or bfloat16), not {dtype}")
    with torch.device("meta"):
        if tp.is_parallel:
            return model_class(config)(config, max_positions, quant=quant, tp=tp)
        return model_class(config)(config, max_positions, quant=quant)


def _to_device(
    name: str, tensor: torch.Tensor, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """Plain tensors in the model's dtype; quantized weights (FP8, integer) and their float32
    scales as they are."""
    if tensor.dtype == FP8_DTYPE or not tensor.is_floating_point() or name.endswith(SCALE_NAMES):
        return tensor.to(device)
    return tensor.to(device=device, dtype=dtype)


@torch.no_grad()
def random_model(
    config: ModelConfig,
    max_positions: int,
    device: torch.device | str,
    dtype: torch.dtype,
    *,
    seed: int = 0,
    std: float = 0.02,
    quant: QuantScheme | None = None,
    tp: TensorParallel = SINGLE,
) -> nn.Module:
    """The model with random weights made straight on device (an 8B model in seconds): norm
    weights are ones, every other tensor N(0, std) from a seeded generator (a MoE layer's
    router and experts too). With FP8 the
    projections are those same draws quantized per channel (static input scales 1: speed
    runs only); integer weights (4-bit, INT8) are random codes, an act-order permutation the
    identity. tp: a rank draws the full model's tensors and keeps its slices, so every
    tensor-parallel size runs the same model (one full tensor at a time: a rank holds its
    slices and the tensor being drawn)."""
    device = torch.device(device)
    full = _meta_model(config, max_positions, device, dtype, quant)
    gen = torch.Generator(device).manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    drawn: set[str] = set()
    for name, param in full.named_parameters():
        if name in drawn:  # an FP8 layer's scales, made with its weight
            continue
        new = _random_tensors(name, param, quant, dtype, device, gen, std)
        drawn |= new.keys()
        # a rank keeps its slices of each tensor as it is drawn: one full tensor at a time
        weights |= shard_weights(new, config, tp)
    model = _meta_model(config, max_positions, device, dtype, quant, tp) if tp.is_parallel else full
    model.load_state_dict(weights, strict=True, assign=True)
    return model.to(device).eval()


def _random_tensors(
    name: str,
    param: nn.Parameter,
    quant: QuantScheme | None,
    dtype: torch.dtype,
    device: torch.device,
    gen: torch.Generator,
    std: float,
) -> dict[str, torch.Tensor]:
    """random_model's draw of one parameter (an FP8 layer's weight: with its scales)."""
    if name.endswith("norm.weight"):
        return {name: torch.ones(param.shape, dtype=dtype, device=device)}
    if name.endswith("input_perm"):
        return {name: torch.arange(param.shape[0], device=device)}
    if not param.is_floating_point():
        info = torch.iinfo(param.dtype)
        return {
            name: torch.randint(
                info.min, info.max, param.shape, dtype=param.dtype, device=device, generator=gen
            )
        }
    if name.endswith("weight_scale") and quant is not None and param.dtype == torch.float32:
        return {name: torch.full(param.shape, std / 127, device=device)}
    t = torch.empty(param.shape, dtype=dtype, device=device).normal_(0.0, std, generator=gen)
    if quant is not None and param.dtype == FP8_DTYPE:
        ones = torch.ones((), device=device) if quant.static_input_scales else None
        return linear_state(name.removesuffix(".weight"), quantize_weight(t), ones)
    return {name: t}
