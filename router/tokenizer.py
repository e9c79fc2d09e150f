"""Torch-free tokenizer for the router: RouterTokenizer (tokenizer.json + chat template of one
checkpoint folder). Its encode and decode release the GIL, so they can run on a thread beside
the router's event loop (router/prompt_encoder.py). Per-request text state
(IncrementalDetokenizer, StopChecker) is the engine's own, re-exported here; those modules import
no torch either.

Matches the engine's transformers tokenizer token for token; imports neither torch nor
transformers, only `tokenizers` and `jinja2`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from engine.step.stop_checker import StopChecker
from engine.tokenizer import IncrementalDetokenizer
from router.token_bound import TokenBound

__all__ = ["IncrementalDetokenizer", "RouterTokenizer", "StopChecker"]

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token")


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (assistant-mask markers): renders the body."""

    tags = {"generation"}  # noqa: RUF012 (jinja2's API)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def compile_chat_template(source: str) -> jinja2.Template:
    """The template environment transformers renders chat templates in (sandboxed)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_text(value: Any) -> str | None:
    if isinstance(value, Mapping):  # an AddedToken written out as a dict
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template_source(folder: Path, config: Mapping[str, Any]) -> str | None:
    file = folder / "chat_template.jinja"
    if file.is_file():
        return file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _byte_level_chars() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's): each byte is one printable character in token
    strings: the printable Latin-1 bytes stand for themselves, the other 68 bytes for the
    characters from U+0100 up, in byte order. Character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in set(printable)]
    chars.update({chr(0x100 + i): b for i, b in enumerate(others)})
    return chars


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class RouterTokenizer:
    """Encode, decode and chat-template rendering for one checkpoint folder."""

    def __init__(self, folder: str | Path):
        folder = Path(folder)
        self._tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        config = _read_json(folder / "tokenizer_config.json")
        self.special_tokens: dict[str, str] = {
            key: text for key in _SPECIAL_TOKEN_KEYS if (text := _token_text(config.get(key)))
        }
        source = _chat_template_source(folder, config)
        self._template = compile_chat_template(source) if source else None
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_token_ids: frozenset[int] = frozenset(self._eos_ids(folder))
        self.bound = TokenBound.of(self._tok)
        self._byte_level = type(self._tok.decoder).__name__ == "ByteLevel"
        self._byte_chars = _byte_level_chars() if self._byte_level else {}

    def _eos_ids(self, folder: Path) -> set[int]:
        ids: set[int] = set()
        eos = self.special_tokens.get("eos_token")
        if eos is not None and (eos_id := self._tok.token_to_id(eos)) is not None:
            ids.add(eos_id)
        for name in ("config.json", "generation_config.json"):
            value = _read_json(folder / name).get("eos_token_id")
            ids.update(value if isinstance(value, list) else [value] if value is not None else [])
        return ids

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while it works (encode holds it): a long prompt
        # tokenized on a worker thread leaves the event loop running.
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def min_num_tokens(self, text: str) -> int:
        """At least how many tokens text encodes to (a proved bound; 0 when none is proved)."""
        return self.bound.min_num_tokens(text)

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """Chat messages -> prompt text ending with the assistant turn's opening (unless
        add_generation_prompt is False)."""
        if self._template is None:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        try:
            return self._template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"the chat template rejected the messages: {e}") from e

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        return self.encode(self.render_chat(messages), add_special_tokens=False)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = [list(token_ids)]
        return self._tok.decode_batch(ids, skip_special_tokens=skip_special_tokens)[0]

    def token_bytes(self, token_id: int, text: str | None = None) -> bytes:
        """The bytes token_id stands for (logprobs' `bytes`): its text's UTF-8, unless the
        token holds part of a character (its text alone is U+FFFD), whose own bytes come from
        its vocabulary string (byte-level BPE's alphabet, or a byte-fallback <0xHH> token).
        text: the token decoded alone, when the caller has it."""
        if text is None:
            text = self.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text.encode()
        piece = self._tok.id_to_token(token_id) or ""
        if (fallback := _BYTE_FALLBACK.fullmatch(piece)) is not None:
            return bytes([int(fallback.group(1), 16)])
        if self._byte_level and all(c in self._byte_chars for c in piece):
            return bytes(self._byte_chars[c] for c in piece)
        return text.encode()
