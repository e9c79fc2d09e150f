"""TokenBound: the fewest tokens a text can encode to, proved from a tokenizer's structure (so a
prompt that cannot fit the context is refused before it is tokenized); holds no other state.

The bound holds for byte-covering BPE tokenizers (byte-level, or byte fallback): every byte of the
text lands in exactly one token, and no token covers more bytes than the longest vocabulary entry,
so a text of B bytes needs at least ceil(B / longest) tokens. A normalizer or pre-tokenizer that
may drop or shrink text (strip, NFC, whitespace splitting, ...) voids the proof: the bound is then
0, which is still a true lower bound, and the prompt is tokenized in full before it is judged.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer

# Pre-tokenizers that keep every byte of the text (they split or re-mark it, never drop it).
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "Punctuation", "Split"})


def _state(component: Any) -> dict[str, Any] | None:
    """A tokenizers component as its JSON (None when absent)."""
    return None if component is None else json.loads(component.__getstate__())


def _never_shrinks(normalizer: dict[str, Any] | None) -> bool:
    """True when the normalizer only adds or widens text (Prepend, Replace by a longer string)."""
    if normalizer is None:
        return True
    kind = normalizer["type"]
    if kind == "Sequence":
        return all(_never_shrinks(n) for n in normalizer["normalizers"])
    if kind == "Prepend":
        return True
    if kind == "Replace":
        pattern = normalizer["pattern"].get("String")
        return bool(pattern) and len(normalizer["content"].encode()) >= len(pattern.encode())
    return False


def _pre_tokenizers(spec: dict[str, Any] | None) -> list[dict[str, Any]]:
    if spec is None:
        return []
    if spec["type"] == "Sequence":
        return [p for inner in spec["pretokenizers"] for p in _pre_tokenizers(inner)]
    return [spec]


def _keeps_every_byte(pre_tokenizers: list[dict[str, Any]]) -> bool:
    return all(
        p["type"] in _KEEPING_PRE_TOKENIZERS and p.get("behavior") != "Removed"
        for p in pre_tokenizers
    )


@dataclass(frozen=True)
class TokenBound:
    """bytes_per_token: the most bytes of text one token can cover; None when no bound is
    proved for this tokenizer (min_num_tokens is then 0)."""

    bytes_per_token: int | None

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> TokenBound:
        model = json.loads(tokenizer.model.__getstate__())
        pre = _pre_tokenizers(_state(tokenizer.pre_tokenizer))
        byte_level = any(p["type"] == "ByteLevel" for p in pre)
        covers_bytes = model.get("type") == "BPE" and (byte_level or model.get("byte_fallback"))
        shrinks = not _never_shrinks(_state(tokenizer.normalizer)) or tokenizer.truncation
        if not covers_bytes or shrinks:
            return cls(None)
        if not _keeps_every_byte(pre):
            return cls(None)
        # A byte-level vocabulary writes one character per byte; others are UTF-8 text (a byte
        # fallback entry "<0x41>" covers one byte, fewer than its spelling: still a bound).
        vocab = tokenizer.get_vocab(with_added_tokens=False)
        longest = max((len(t) if byte_level else len(t.encode()) for t in vocab), default=1)
        added = tokenizer.get_added_tokens_decoder().values()
        longest = max([longest, *(len(t.content.encode()) for t in added)])
        return cls(max(1, longest))

    def min_num_tokens(self, text: str) -> int:
        """A number of tokens text provably needs at least (0 when nothing is proved)."""
        if self.bytes_per_token is None or not text:
            return 0
        return -(-len(text.encode()) // self.bytes_per_token)
