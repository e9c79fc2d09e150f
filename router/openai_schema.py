"""OpenAI-compatible request bodies (pydantic v2, strict types) and their conversion into a
RequestSpec; stateless. Unsupported options are refused with a message, never ignored silently.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.kv_cache.retention import RetentionRange
from engine.sampling.sampling_params import SamplingParams
from router.errors import InvalidRequest
from router.request_spec import ChatMessage, RequestSpec
from router.structured_schema import ResponseFormat, StructuredFields

_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def _absent(value: object) -> bool:
    return value is None or value == {} or value == []


# Request fields that change the output and are not built yet (OpenAI's and the common vLLM
# extras): each is refused with a 400 naming it, unless it holds its do-nothing value. The
# OpenAI fields that do not change the output (_IGNORED) are accepted and ignored; any other
# field is refused as unknown (a misspelt `max_tokns` would otherwise go unnoticed), as
# OpenAI's API does.
_IGNORED = frozenset(
    {"metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key",
     "safety_identifier"}
)  # fmt: skip
_NOT_BUILT: dict[str, Callable[[object], bool]] = {
    "tools": _absent,
    "tool_choice": lambda v: v is None or v == "none",
    "functions": _absent,
    "function_call": lambda v: v is None or v == "none",
    "best_of": lambda v: v is None or v == 1,
    "min_tokens": lambda v: v is None or v == 0,
    "use_beam_search": lambda v: v is None or v is False,
    "length_penalty": lambda v: v is None or v == 1,
    "prediction": _absent,
    "audio": _absent,
    "modalities": lambda v: _absent(v) or v == ["text"],
    "guided_decoding_backend": _absent,
    "structured_outputs": _absent,
    "allowed_token_ids": _absent,
    "bad_words": _absent,
    "prompt_logprobs": _absent,
    "web_search_options": _absent,
    "reasoning_effort": lambda v: v is None,
    "verbosity": lambda v: v is None,
    "include_stop_str_in_output": lambda v: v is None or v is False,
    "truncate_prompt_tokens": lambda v: v is None,
    "chat_template": lambda v: v is None,
    "chat_template_kwargs": _absent,
    "add_generation_prompt": lambda v: v is None or v is True,
    "continue_final_message": lambda v: v is None or v is False,
    "skip_special_tokens": lambda v: v is None or v is True,
    "spaces_between_special_tokens": lambda v: v is None or v is True,
}


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class _TopLevelBody(_Body):
    """A request body: unknown fields are kept (model_extra) so those not built are refused."""

    model_config = ConfigDict(strict=True, extra="allow")

    def _refuse_not_built(self) -> None:
        for name, value in (self.model_extra or {}).items():
            if name in _IGNORED:
                continue
            is_off = _NOT_BUILT.get(name)
            if is_off is None:
                known = [*type(self).model_fields, *_IGNORED, *_NOT_BUILT]
                close = difflib.get_close_matches(name, known, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                param = name or json.dumps(name)  # a field named "" is named '""'
                raise InvalidRequest(
                    f"unrecognized request field {param}{hint}; leave it out",
                    param,
                    "unknown_parameter",
                )
            if not is_off(value):
                raise InvalidRequest(
                    f"{name} is not supported by this server yet; leave it out (it would "
                    "change the output, so it is refused rather than ignored)",
                    name,
                    "unsupported_parameter",
                )


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessageIn(_Body):
    """One chat message. Fields a response message carries back into a history (refusal,
    annotations, null tool_calls) are ignored; tool and function calls, which this server does
    not make, are refused."""

    model_config = ConfigDict(strict=True, extra="allow")

    role: str  # checked with the rest of the messages (request_spec.template_messages)
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)

    def to_message(self, index: int) -> ChatMessage:
        """index: its place in `messages` (named in an error)."""
        for field_name in ("tool_calls", "function_call", "audio"):
            if (self.model_extra or {}).get(field_name):
                raise InvalidRequest(
                    f"a message's {field_name} is not supported (this server does not call "
                    "tools); leave it out of the history",
                    f"messages.{index}.{field_name}",
                    "unsupported_parameter",
                )
        if self.content is None and self.role != "assistant":
            raise InvalidRequest(
                f"a {self.role} message needs content", f"messages.{index}.content"
            )
        return ChatMessage(self.role, self.text(), self.name)


class StreamOptions(_Body):
    model_config = ConfigDict(strict=True, extra="forbid")

    include_usage: bool = False
    include_obfuscation: bool | None = None  # OpenAI's padding of stream chunks: none is sent


class KVRetentionIn(_Body):
    """One retention range (kvrelay's extra field): token positions [start, end) whose KV
    blocks keep `priority` (0-100, default 35) for duration_s after the request ends."""

    model_config = ConfigDict(strict=True, extra="forbid")

    start: int
    end: int | None = None
    priority: int
    duration_s: float | None = None

    def as_range(self) -> RetentionRange:
        return RetentionRange(self.start, self.end, self.priority, self.duration_s)


class _CommonRequest(_TopLevelBody):
    """Fields shared by /v1/chat/completions and /v1/completions (plus vLLM-style extras)."""

    model: str | None = None  # None: the served model (the first, when several are)
    max_tokens: int | None = None
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)  # -1 or 0: no top-k filter
    min_p: float | None = Field(default=None, ge=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    speculative: bool = True  # kvrelay's extra field: false turns speculative decoding off
    n: int = 1  # choices; its range is checked with the rest (engine/sampling/validation.py)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None  # ranges: engine/sampling/validation.py (400 naming them)
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias
    response_format: ResponseFormat | None = None  # text, json_object or json_schema
    guided_regex: str | None = None  # vLLM's extras: the output matches a regex
    guided_grammar: str | None = None  # or an EBNF grammar
    guided_json: dict[str, Any] | str | None = None  # or a JSON schema
    guided_choice: list[str] | None = None  # or exactly one of these strings
    cache_salt: str | None = None
    kv_retention: list[KVRetentionIn] | None = None  # ranges checked by the front end (400)
    priority: int | None = None  # kvrelay's extra: higher runs first (range checked: 400)
    deadline_s: float | None = None  # kvrelay's extra: refused if still queued this long
    user: str | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _check_supported(self) -> None:
        self._refuse_not_built()
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options needs stream=true", "stream_options")

    def _logit_bias(self) -> tuple[tuple[int, float], ...]:
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            try:
                token_id = int(key)
            except ValueError:
                raise InvalidRequest(
                    f"logit_bias keys must be token ids, got {key!r}", "logit_bias"
                ) from None
            pairs.append((token_id, bias))
        return tuple(pairs)

    def _spec(
        self,
        id_prefix: str,
        sampling: SamplingParams,
        max_tokens_param: str | None,
        prompt: str | None = None,
        messages: tuple[ChatMessage, ...] | None = None,
        prompt_token_ids: tuple[int, ...] | None = None,
    ) -> RequestSpec:
        return RequestSpec(
            model=self.model,
            prompt=prompt,
            messages=messages,
            prompt_token_ids=prompt_token_ids,
            sampling=sampling,
            max_tokens_param=max_tokens_param,
            cache_salt=self.cache_salt,
            kv_retention=tuple(r.as_range() for r in self.kv_retention or ()),
            id_prefix=id_prefix,
            priority=self.priority,
            deadline_s=self.deadline_s,
            structured_param=self._structured_fields().param(),
        )

    def _structured_fields(self) -> StructuredFields:
        return StructuredFields(
            self.response_format,
            self.guided_regex,
            self.guided_grammar,
            self.guided_json,
            self.guided_choice,
        )

    def _sampling(
        self, max_tokens: int | None, logprobs: bool, top_logprobs: int
    ) -> SamplingParams:
        """The body's sampling fields as SamplingParams, converted once: OpenAI's unset fields
        take kvrelay's defaults; max_tokens None leaves SamplingParams' own, which the front
        end replaces (RequestSpec.max_tokens_param is None then)."""
        sampling = SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_k=max(self.top_k or 0, 0),
            top_p=1.0 if self.top_p is None else self.top_p,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            n=self.n,
            stop=(self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ()),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=self._logit_bias(),
            structured=self._structured_fields().output(),
            speculative=self.speculative,
        )
        return sampling if max_tokens is None else replace(sampling, max_tokens=max_tokens)


class ChatCompletionRequest(_CommonRequest):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)  # needs logprobs=true

    def to_spec(self) -> RequestSpec:
        messages = tuple(m.to_message(i) for i, m in enumerate(self.messages))
        max_tokens, param = self.max_completion_tokens, "max_completion_tokens"
        if max_tokens is None:
            max_tokens, param = self.max_tokens, "max_tokens"
        self._check_supported()
        sampling = self._sampling(max_tokens, self.logprobs, self.top_logprobs or 0)
        param_set = None if max_tokens is None else param
        return self._spec("chatcmpl", sampling, param_set, messages=messages)


class CompletionRequest(_CommonRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    # The k most likely tokens with each (0: the sampled token's logprob only); OpenAI allows 5.
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False  # the prompt's text before the output's (no prompt logprobs)
    suffix: str | None = None

    def prompt_text(self) -> str | None:
        """The prompt as the client wrote it, when it is text (echo repeats it as is)."""
        prompt = self.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        return prompt if isinstance(prompt, str) else None

    def to_spec(self) -> RequestSpec:
        if self.echo and self.logprobs is not None:
            raise InvalidRequest(
                "echo with logprobs is not supported (the prompt's logprobs are not computed); "
                "leave one of them out",
                "echo",
            )
        if self.suffix:
            raise InvalidRequest("suffix is not supported", "suffix")
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise InvalidRequest("only one prompt per request is supported", "prompt")
            prompt = prompt[0]
        self._check_supported()
        sampling = self._sampling(self.max_tokens, self.logprobs is not None, self.logprobs or 0)
        param = None if self.max_tokens is None else "max_tokens"
        if isinstance(prompt, str):
            return self._spec("cmpl", sampling, param, prompt=prompt)
        token_ids = tuple(prompt)  # type: ignore[arg-type]
        return self._spec("cmpl", sampling, param, prompt_token_ids=token_ids)


def _is_union_tag(part: int | str) -> bool:
    """pydantic names the union member an error is about in its location ("str", "list[int]")."""
    return isinstance(part, str) and ("[" in part or part in _TYPE_NAMES)


def _dotted(loc: tuple[int | str, ...]) -> str | None:
    return ".".join(str(part) for part in loc) or None


def invalid_from_validation(error: ValidationError) -> InvalidRequest:
    """The first pydantic error as an OpenAI-style invalid request (param = dotted location)."""
    errors = error.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        return InvalidRequest(f"the body is not valid JSON: {first['msg']}", None, "invalid_json")
    loc = tuple(first["loc"])
    if not loc:  # the body as a whole: not an object
        message = f"the request body must be a JSON object: {first['msg']}"
        return InvalidRequest(message, None, "invalid_body")
    tag_at = next((i for i, part in enumerate(loc) if _is_union_tag(part)), None)
    if tag_at is None:
        param = _dotted(loc) or json.dumps(str(loc[-1]))  # a field named "" is named '""'
        return InvalidRequest(f"{param}: {first['msg']}", param)
    prefix = loc[:tag_at]
    forms = [e["loc"][tag_at] for e in errors if tuple(e["loc"][:tag_at]) == prefix]
    param = _dotted(prefix)
    return InvalidRequest(f"{param}: expected {' or '.join(dict.fromkeys(map(str, forms)))}", param)
