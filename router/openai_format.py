"""OpenAI-compatible response bodies (chat.completion, text_completion, their stream chunks,
usage, logprobs, errors) built from OutputChunks; stateless except for the per-request
ResponseContext each request builds.
"""

from __future__ import annotations

import codecs
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from common.messages import TopLogprobs
from engine.finish_reason import FinishReason
from router.errors import InvalidRequest
from router.output import OutputChunk, Usage
from router.tokenizer import RouterTokenizer

Json = dict[str, Any]


def utf8_decoder() -> codecs.IncrementalDecoder:
    """Whole characters from a choice's token bytes, a split one held until its last byte."""
    return codecs.getincrementaldecoder("utf-8")("replace")


# A token the grammar or logit_bias rules out has logprob -inf, which JSON cannot carry (strict
# parsers refuse a body with -Infinity): it is sent as this floor, as vLLM does.
MIN_LOGPROB = -9999.0


def _finite(logprob: float) -> float:
    return logprob if logprob >= MIN_LOGPROB else MIN_LOGPROB  # NaN too: not >=


def error_body(message: str, error_type: str, param: str | None = None, code: Any = None) -> Json:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def invalid_body(error: InvalidRequest) -> Json:
    return error_body(error.message, "invalid_request_error", error.param, error.code)


def usage_json(usage: Usage) -> Json:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "speculative_tokens_accepted": usage.speculative_tokens_accepted,
    }


@dataclass
class ChoiceText:
    """One choice's output so far (non-streaming: all of it; streaming: its text offset)."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    num_text_chars: int = 0
    # streaming: the bytes of a character split across chunks (completions' text_offset)
    utf8: codecs.IncrementalDecoder = field(default_factory=utf8_decoder)
    finish_reason: FinishReason | None = None


@dataclass
class ResponseContext:
    """What every body of one response repeats, plus each choice's accumulated output."""

    response_id: str
    model: str
    chat: bool  # chat.completion(.chunk) vs text_completion
    tokenizer: RouterTokenizer
    want_logprobs: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    echo_text: str = ""  # completions with echo: the prompt's text, before the output's
    num_choices: int = 1
    choices: list[ChoiceText] = field(init=False)

    def __post_init__(self) -> None:
        self.choices = [ChoiceText() for _ in range(self.num_choices)]

    @property
    def _model(self) -> Json:
        return {"model": self.model}

    def _head(self, streaming: bool) -> Json:
        kind = "chat.completion" if self.chat else "text_completion"
        if self.chat and streaming:
            kind += ".chunk"
        return {
            "id": self.response_id,
            "object": kind,
            "created": self.created,
            "model": self.model,
        }

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _chat_entry(self, token_id: int, logprob: float, token: str | None = None) -> Json:
        token = self._token(token_id) if token is None else token
        raw = self.tokenizer.token_bytes(token_id, token)
        return {"token": token, "logprob": _finite(logprob), "bytes": list(raw)}

    def _logprobs(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[float],
        top_logprobs: Sequence[TopLogprobs] = (),
        num_text_chars: int = 0,
        utf8: codecs.IncrementalDecoder | None = None,
    ) -> Json | None:
        """The choice's logprobs for token_ids; completions' text_offset counts from
        num_text_chars, the characters of its text before them (utf8: the decoder holding a
        character an earlier chunk split)."""
        if not self.want_logprobs:
            return None
        tokens = [self._token(t) for t in token_ids]
        tops = list(top_logprobs) or [()] * len(tokens)
        if self.chat:
            content = [
                {
                    **self._chat_entry(token_id, lp, tok),
                    "top_logprobs": [self._chat_entry(t, p) for t, p in top],
                }
                for token_id, tok, lp, top in zip(token_ids, tokens, logprobs, tops, strict=False)
            ]
            return {"content": content}
        # Where each token starts in the text, in characters: a token holding part of a
        # character (decoded alone: U+FFFD) starts at that character, which counts once, when
        # its last byte comes.
        utf8 = utf8_decoder() if utf8 is None else utf8
        offsets, offset = [], num_text_chars
        for token_id, tok in zip(token_ids, tokens, strict=True):
            offsets.append(offset)
            offset += len(utf8.decode(self.tokenizer.token_bytes(token_id, tok)))
        return {
            "tokens": tokens,
            "token_logprobs": [_finite(lp) for lp in logprobs],
            "top_logprobs": [{self._token(t): _finite(p) for t, p in top} for top in top_logprobs]
            if top_logprobs
            else None,
            "text_offset": offsets,
        }

    # ---- streaming -----------------------------------------------------------------------
    def first_chunks(self) -> list[Json]:
        """Chat streams open with the assistant role, one chunk per choice; completions have no
        opening chunks but with echo, where each choice's carries the prompt's text."""
        return [c for i in range(self.num_choices) if (c := self._first_chunk(i)) is not None]

    def _first_chunk(self, index: int) -> Json | None:
        if not self.chat:
            if not self.echo_text:
                return None
            self.choices[index].num_text_chars += len(self.echo_text)
            choice = {"index": index, "text": self.echo_text, "logprobs": None}
            return {**self._head(True), "choices": [{**choice, "finish_reason": None}]}
        choice = {"index": index, "delta": {"role": "assistant", "content": ""}}
        return {
            **self._head(True),
            "choices": [{**choice, "logprobs": None, "finish_reason": None}],
        }

    def chunk(self, out: OutputChunk) -> Json:
        """A stream chunk of out's choice (`choices[0].index` names it)."""
        state = self.choices[out.index]
        choice: Json = {"index": out.index}
        if self.chat:
            choice["delta"] = {"content": out.text} if out.text else {}
        else:
            choice["text"] = out.text
        choice["logprobs"] = self._logprobs(
            out.token_ids, out.logprobs, out.top_logprobs, state.num_text_chars, state.utf8
        )
        choice["finish_reason"] = out.finish_reason
        state.num_text_chars += len(out.text)
        return {**self._head(True), "choices": [choice]}

    def usage_chunk(self, usage: Usage) -> Json:
        return {**self._head(True), "choices": [], "usage": usage_json(usage)}

    # ---- non-streaming -------------------------------------------------------------------
    def add(self, out: OutputChunk) -> None:
        state = self.choices[out.index]
        state.text.append(out.text)
        state.token_ids.extend(out.token_ids)
        state.logprobs.extend(out.logprobs)
        state.top_logprobs.extend(out.top_logprobs)
        state.finish_reason = out.finish_reason or state.finish_reason

    def final(self, usage: Usage) -> Json:
        """The whole response: every choice with its own text, logprobs and finish_reason."""
        choices = [self._final_choice(i, state) for i, state in enumerate(self.choices)]
        return {**self._head(False), "choices": choices, "usage": usage_json(usage)}

    def _final_choice(self, index: int, state: ChoiceText) -> Json:
        text = self.echo_text + "".join(state.text)
        logprobs = self._logprobs(
            state.token_ids, state.logprobs, state.top_logprobs, len(self.echo_text)
        )
        choice: Json = {"index": index}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice.update(logprobs=logprobs, finish_reason=state.finish_reason)
        return choice
