"""OpenAI-compatible response bodies (chat.completion, text_completion, their stream chunks,
usage, logprobs, errors) built from OutputChunks; stateless except for the per-request
ResponseContext each request builds.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from router.errors import InvalidRequest
from router.output import OutputChunk, Usage
from router.tokenizer import RouterTokenizer

Json = dict[str, Any]


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
    }


@dataclass
class ResponseContext:
    """What every body of one response repeats, plus accumulated non-streaming output."""

    response_id: str
    model: str
    chat: bool  # chat.completion(.chunk) vs text_completion
    tokenizer: RouterTokenizer
    want_logprobs: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    num_text_chars: int = 0

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

    def _logprobs(self, token_ids: Sequence[int], logprobs: Sequence[float]) -> Json | None:
        if not self.want_logprobs:
            return None
        tokens = [self.tokenizer.decode([t], skip_special_tokens=False) for t in token_ids]
        if self.chat:
            content = [
                {"token": tok, "logprob": lp, "bytes": list(tok.encode()), "top_logprobs": []}
                for tok, lp in zip(tokens, logprobs, strict=False)
            ]
            return {"content": content}
        offsets, offset = [], self.num_text_chars
        for tok in tokens:
            offsets.append(offset)
            offset += len(tok)
        return {
            "tokens": tokens,
            "token_logprobs": list(logprobs),
            "top_logprobs": None,
            "text_offset": offsets,
        }

    # ---- streaming -----------------------------------------------------------------------
    def first_chunk(self) -> Json | None:
        """Chat streams open with the assistant role; completions have no opening chunk."""
        if not self.chat:
            return None
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}}
        return {
            **self._head(True),
            "choices": [{**choice, "logprobs": None, "finish_reason": None}],
        }

    def chunk(self, out: OutputChunk) -> Json:
        choice: Json = {"index": 0}
        if self.chat:
            choice["delta"] = {"content": out.text} if out.text else {}
        else:
            choice["text"] = out.text
        choice["logprobs"] = self._logprobs(out.token_ids, out.logprobs)
        choice["finish_reason"] = out.finish_reason
        self.num_text_chars += len(out.text)
        return {**self._head(True), "choices": [choice]}

    def usage_chunk(self, usage: Usage) -> Json:
        return {**self._head(True), "choices": [], "usage": usage_json(usage)}

    # ---- non-streaming -------------------------------------------------------------------
    def add(self, out: OutputChunk) -> None:
        self.text.append(out.text)
        self.token_ids.extend(out.token_ids)
        self.logprobs.extend(out.logprobs)

    def final(self, finish_reason: str | None, usage: Usage) -> Json:
        text = "".join(self.text)
        logprobs = self._logprobs(self.token_ids, self.logprobs)
        choice: Json = {"index": 0}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice.update(logprobs=logprobs, finish_reason=finish_reason)
        return {**self._head(False), "choices": [choice], "usage": usage_json(usage)}
