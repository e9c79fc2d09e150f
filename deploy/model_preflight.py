"""What a served model's checkpoint folder must hold, checked before any process starts
(`kvrelay serve` on an embedded cluster; a worker would find each only after Ray, Redis and the
controller started, print a traceback and be started again): the model id its folder's name
gives (unless --served-model-name names it), a config.json the engine understands (its
architecture, fields and quantization), its safetensors files (its index's, all there), a
tokenizer.json whose base vocabulary the model's covers, and a --max-model-len within the
model's context. Torch-free; the tensors themselves are the workers' to check (by loading
them). A GGUF file is the workers' to convert. Holds no state."""

from __future__ import annotations

from pathlib import Path

from common.kv_index_schema import ID_RULE, check_model_id
from engine.config import ARCHITECTURES, ModelConfig, served_model_id
from engine.model_source import checkpoint_files
from engine.quant.config import read_quant_config

TOKENIZER_FILE = "tokenizer.json"  # what the router tokenizes with


def check_checkpoint(
    source: Path,
    max_model_len: int | None = None,
    weights: bool = True,
    draft: bool = False,
    named: bool = False,
) -> None:
    """ValueError / FileNotFoundError naming the folder and what is wrong with it, for an HF
    folder `source` (model_source's) to serve with `max_model_len` (--max-model-len); weights
    False (--load-format dummy): its safetensors files are not looked for; draft (a
    --draft-model): not served under an id, nor tokenized with; named: served under
    --served-model-name (checked with the flags), not its folder's name."""
    if source.suffix == ".gguf" and source.is_file():
        return
    model_id = served_model_id(str(source))
    try:
        if not draft and not named:
            check_model_id(model_id)
    except ValueError:
        raise ValueError(
            f"model {source}: it is served under its folder's name, {model_id!r}, which must be "
            f"{ID_RULE}: give it a name with --served-model-name, or serve it from a folder (or "
            "a link to it) named otherwise"
        ) from None
    try:
        config = ModelConfig.from_dir(source, model_id)
        read_quant_config(source)
    except (ValueError, KeyError, TypeError) as e:
        why = f"config.json lacks {e}" if isinstance(e, KeyError) else str(e)
        raise ValueError(f"model {source}: {why}") from None
    if config.architecture not in ARCHITECTURES:
        raise ValueError(
            f"model {source}: unsupported architecture {config.architecture!r}; supported: "
            f"{', '.join(sorted(ARCHITECTURES))}"
        )
    if weights:
        checkpoint_files(source)
    if not draft:
        _check_tokenizer(source, config)
    _check_context(source, config, max_model_len)


def _check_tokenizer(folder: Path, config: ModelConfig) -> None:
    path = folder / TOKENIZER_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"model {folder} has no {TOKENIZER_FILE} (the router tokenizes with it: save the "
            "model's tokenizer beside it, e.g. AutoTokenizer.save_pretrained(folder))"
        )
    from tokenizers import Tokenizer

    try:
        # its base vocabulary: special tokens added past vocab_size (never sampled) are fine
        size = Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=False)
    except Exception as e:  # the tokenizers library's own error types
        raise ValueError(f"model {folder}: {TOKENIZER_FILE} could not be read ({e})") from None
    if size > config.vocab_size:
        raise ValueError(
            f"model {folder}: its {TOKENIZER_FILE} has {size} tokens but config.json's "
            f"vocab_size is {config.vocab_size}: prompts would hold ids the model has no "
            "embedding for (a tokenizer of another model?)"
        )


def _check_context(folder: Path, config: ModelConfig, max_model_len: int | None) -> None:
    if max_model_len is None or max_model_len <= config.context_len:
        return
    field = "max_position_embeddings"
    if config.context_len < config.max_position_embeddings:
        field = "sliding_window (its attention is not implemented: it caps the context)"
    raise ValueError(
        f"--max-model-len {max_model_len} is longer than model {folder.name}'s context: "
        f"config.json's {field} is {config.context_len}"
    )
