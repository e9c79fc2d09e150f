"""Torch-free tokenizer for the router: RouterTokenizer (tokenizer.json + chat template of one
checkpoint folder), IncrementalDetokenizer and StopChecker (one request's text state each).

Matches the engine's transformers tokenizer token for token; imports neither torch nor
transformers, only `tokenizers` and `jinja2`.
"""

from __future__ import annotations

import json
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

_REPLACEMENT_CHAR = "\ufffd"
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
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def render_chat(self, messages: Sequence[Mapping[str, Any]]) -> str:
        """Chat messages -> prompt text ending with the assistant turn's opening."""
        if self._template is None:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        try:
            return self._template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=True,
                **self.special_tokens,
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"the chat template rejected the messages: {e}") from e

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        return self.encode(self.render_chat(messages), add_special_tokens=False)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas; holds back incomplete UTF-8 characters.

    Each call decodes the window tokens[prefix_offset:] and emits the part past the text of
    tokens[prefix_offset:read_offset], unless it ends in U+FFFD (a multi-byte character cut in
    half), in which case nothing is emitted until more tokens complete it.
    """

    def __init__(self, tokenizer: RouterTokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""

    def _window_delta(self) -> str:
        decode, skip = self.tokenizer.decode, self.skip_special_tokens
        done = decode(self.token_ids[self.prefix_offset : self.read_offset], skip)
        full = decode(self.token_ids[self.prefix_offset :], skip)
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


class StopChecker:
    """One request's output text with stop strings applied.

    A tail of the text that could still turn out to be the start of a stop string is held
    back (only such a tail), so a stop string never leaks into the output, even when it spans
    several tokens.
    """

    def __init__(self, tokenizer: RouterTokenizer, stop: Sequence[str] = ()):
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.stop = tuple(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.num_emitted = 0  # characters of detokenizer.text already returned
        self.matched: str | None = None

    @property
    def text(self) -> str:
        """Output text so far (cut before the stop string once one matched)."""
        return self.detokenizer.text[: self.num_emitted] if self.matched else self.detokenizer.text

    def add(self, token_id: int) -> str:
        """Feed one token; return text that is now safe to emit."""
        if self.matched is not None:
            return ""
        delta = self.detokenizer.add([token_id])
        text = self.detokenizer.text
        if delta and self.stop:
            start = max(0, len(text) - len(delta) - self.hold)
            hits = [(pos, s) for s in self.stop if (pos := text.find(s, start)) >= 0]
            if hits:
                pos, self.matched = min(hits)
                return self._emit_until(pos)
        return self._emit_until(len(text) - self._partial_stop_len(text))

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest tail of text that a stop string starts with (held back)."""
        for size in range(min(self.hold, len(text)), 0, -1):
            tail = text[-size:]
            if any(s.startswith(tail) for s in self.stop):
                return size
        return 0

    def finish(self) -> str:
        """The request ended for another reason: release the held-back tail."""
        if self.matched is not None:
            return ""
        self.detokenizer.flush()
        return self._emit_until(len(self.detokenizer.text))

    def _emit_until(self, end: int) -> str:
        if end <= self.num_emitted:
            return ""
        out = self.detokenizer.text[self.num_emitted : end]
        self.num_emitted = end
        return out
