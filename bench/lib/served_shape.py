"""A servable random-weight model folder: a named shape's config.json (no weights; serve it with
load_format "dummy") plus the default model's (SmolLM2) tokenizer files and vocabulary size, so
the router has a tokenizer whose ids match the model's. Owns no state beyond that folder.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Files of the default checkpoint that are not the tokenizer's.
_NOT_TOKENIZER = {"config.json", "kvrelay_source.json", "model.safetensors.index.json"}

VOCAB_NOTE = (
    "vocab_size is the SmolLM2 tokenizer's {vocab:,} instead of the shape's {shape_vocab:,}: the "
    "router needs a real tokenizer whose ids match the model's, and the only one at hand offline "
    "is SmolLM2's (the weights are random, so which vocabulary does not matter otherwise). The "
    "embedding and lm_head are {lm_head_gib:.2f} GiB each instead of {shape_lm_head_gib:.2f} GiB, "
    "so each decode step reads {delta_gib:.2f} GiB {less_or_more} lm_head weight and samples over "
    "{vocab:,} logits instead of {shape_vocab:,}, in both setups alike."
)


def write_served_shape(
    folder: Path,
    shape: str,
    progress: Callable[[str], None] = print,
    tokenizer_dir: Path | None = None,
) -> dict[str, Any]:
    """Write config.json of `shape` with the tokenizer's vocab_size and bos/eos/pad ids, and
    copy that tokenizer's files; returns a description for reports. tokenizer_dir: a folder
    with the tokenizer files and config.json (default: the default model's converted folder)."""
    from bench.lib.random_models import write_random_model
    from engine.models.loader import resolve_model

    if tokenizer_dir is None:
        tokenizer_dir = resolve_model("default", progress)
    write_random_model(folder, shape, weights=False)
    config_path = folder / "config.json"
    hf = json.loads(config_path.read_text())
    source = json.loads((tokenizer_dir / "config.json").read_text())
    shape_vocab = int(hf["vocab_size"])
    overrides = {
        key: source.get(key)
        for key in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")
    }
    hf.update(overrides)
    config_path.write_text(json.dumps(hf, indent=2))
    copied = []
    for path in sorted(tokenizer_dir.iterdir()):
        if path.is_file() and path.name not in _NOT_TOKENIZER and path.suffix != ".safetensors":
            shutil.copy2(path, folder / path.name)
            copied.append(path.name)
    for stale in folder.glob("*.safetensors"):  # load_format dummy: no weights on disk
        stale.unlink()
    return {
        "shape": shape,
        "folder": str(folder),
        "weights": "random, made on the device (load_format dummy)",
        "tokenizer_from": str(tokenizer_dir),
        "tokenizer_files": copied,
        "config_overrides": overrides,
        "shape_vocab_size": shape_vocab,
        "vocab_note": vocab_note(hf, shape_vocab),
        "hf_config": hf,
    }


def vocab_note(hf: dict[str, Any], shape_vocab: int, dtype_bytes: int = 2) -> str:
    hidden, vocab = int(hf["hidden_size"]), int(hf["vocab_size"])
    lm_head_gib = vocab * hidden * dtype_bytes / (1 << 30)
    shape_lm_head_gib = shape_vocab * hidden * dtype_bytes / (1 << 30)
    return VOCAB_NOTE.format(
        vocab=vocab,
        shape_vocab=shape_vocab,
        lm_head_gib=lm_head_gib,
        shape_lm_head_gib=shape_lm_head_gib,
        delta_gib=abs(lm_head_gib - shape_lm_head_gib),
        less_or_more="less" if lm_head_gib <= shape_lm_head_gib else "more",
    )
