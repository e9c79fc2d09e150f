"""Tokenizer (HF tokenizer + chat template), the checkpoint's tokenizer and stop ids;
IncrementalDetokenizer (one request's text state).

Importing this module is torch-free (transformers loads only when a Tokenizer is built), so the
router shares IncrementalDetokenizer with the engine.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol


class Decoder(Protocol):
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


_REPLACEMENT_CHAR = "\ufffd"


def find_tokenizer(folder: Path) -> Tokenizer | None:
    """The checkpoint's tokenizer; None when it ships none (token-id requests only)."""
    has_tokenizer = any((folder / name).exists() for name in ("tokenizer.json", "tokenizer.model"))
    return Tokenizer(folder) if has_tokenizer else None


def stop_token_ids(model_eos_ids: Iterable[int], tokenizer: Tokenizer | None) -> set[int]:
    """The ids that end a request (unless ignore_eos): the model config's and the tokenizer's."""
    ids = set(model_eos_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


class Tokenizer:
    """Wraps a transformers tokenizer loaded from a checkpoint folder."""

    def __init__(self, folder: str | Path):
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(str(folder))
        self.eos_token_id: int | None = self._tok.eos_token_id
        self.vocab_size = len(self._tok)

    @property
    def hf_tokenizer(self) -> Any:
        """The transformers tokenizer (sampling/structured.py builds its token table from it)."""
        return self._tok

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def apply_chat_template(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """Chat messages -> prompt token ids ending with the assistant turn's opening."""
        if not self.has_chat_template:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        text = self._tok.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=True
        )
        return self.encode(text, add_special_tokens=False)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str]:
        return self._tok.convert_ids_to_tokens(list(token_ids))


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas; holds back incomplete UTF-8 characters.

    Each call decodes the window tokens[prefix_offset:] and emits the part past the text of
    tokens[prefix_offset:read_offset], unless it ends in U+FFFD (a multi-byte character cut in
    half), in which case nothing is emitted until more tokens complete it.
    """

    def __init__(self, tokenizer: Decoder, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""

    def _window_delta(self) -> str:
        decode = self.tokenizer.decode
        done = decode(
            self.token_ids[self.prefix_offset : self.read_offset], self.skip_special_tokens
        )
        full = decode(self.token_ids[self.prefix_offset :], self.skip_special_tokens)
        return full[len(done) :] if len(full) > len(done) else ""

    def add(self, new_token_ids: Sequence[int]) -> str:
        """Append tokens; return the newly completed text (maybe empty)."""
        self.token_ids.extend(new_token_ids)
        delta = self._window_delta()
        if not delta or delta.endswith(_REPLACEMENT_CHAR):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of a request: emit whatever is held back (even a broken character)."""
        delta = self._window_delta()
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.text += delta
        return delta
