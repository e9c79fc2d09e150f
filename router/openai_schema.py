"""OpenAI-compatible request bodies (pydantic v2, strict types) and their conversion into a
RequestSpec; stateless. Unsupported options are refused with a message, never ignored silently.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from router.errors import InvalidRequest
from router.frontend import ChatMessage, RequestSpec

_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def _absent(value: object) -> bool:
    return value is None or value == {} or value == []


# Request fields that change the output and are not built yet (OpenAI's and the common vLLM
# extras): each is refused with a 400 naming it, unless it holds its do-nothing value. Fields
# that do not change the output (user, metadata, store, ...) are accepted and ignored.
_NOT_BUILT: dict[str, Callable[[object], bool]] = {
    "response_format": lambda v: _absent(v) or v == {"type": "text"},
    "tools": _absent,
    "tool_choice": lambda v: v is None or v == "none",
    "functions": _absent,
    "function_call": lambda v: v is None or v == "none",
    "logit_bias": _absent,
    "best_of": lambda v: v is None or v == 1,
    "repetition_penalty": lambda v: v is None or v == 1,
    "min_tokens": lambda v: v is None or v == 0,
    "use_beam_search": lambda v: v is None or v is False,
    "length_penalty": lambda v: v is None or v == 1,
    "prediction": _absent,
    "audio": _absent,
    "modalities": lambda v: _absent(v) or v == ["text"],
    "guided_json": _absent,
    "guided_regex": _absent,
    "guided_choice": _absent,
    "guided_grammar": _absent,
    "guided_decoding_backend": _absent,
    "structured_outputs": _absent,
    "allowed_token_ids": _absent,
    "bad_words": _absent,
    "prompt_logprobs": _absent,
    "web_search_options": _absent,
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
            is_off = _NOT_BUILT.get(name)
            if is_off is not None and not is_off(value):
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
    role: str
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class StreamOptions(_Body):
    include_usage: bool = False


class _CommonRequest(_TopLevelBody):
    """Fields shared by /v1/chat/completions and /v1/completions (plus vLLM-style extras)."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)  # -1 or 0: no top-k filter
    min_p: float | None = Field(default=None, ge=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    cache_salt: str | None = None
    user: str | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _check_supported(self) -> None:
        self._refuse_not_built()
        if self.n != 1:
            raise InvalidRequest("only n=1 is supported", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0.0:
                raise InvalidRequest(f"{name} is not supported (must be 0)", name)
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options needs stream=true", "stream_options")

    def _spec(self, max_tokens: int | None, logprobs: bool, **prompt: object) -> RequestSpec:
        self._check_supported()
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return RequestSpec(
            model=self.model,
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(self.top_k or 0, 0),
            min_p=self.min_p or 0.0,
            seed=self.seed,
            stop=stop,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            cache_salt=self.cache_salt,
            **prompt,  # type: ignore[arg-type]
        )


class ChatCompletionRequest(_CommonRequest):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def to_spec(self, req_id: str) -> RequestSpec:
        if self.top_logprobs:
            raise InvalidRequest("top_logprobs is not supported", "top_logprobs")
        messages = tuple(ChatMessage(m.role, m.text()) for m in self.messages)
        max_tokens = self.max_completion_tokens
        if max_tokens is None:
            max_tokens = self.max_tokens
        return self._spec(max_tokens, self.logprobs, messages=messages, req_id=req_id)


class CompletionRequest(_CommonRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0)  # 0: the sampled token's logprob only
    echo: bool = False
    suffix: str | None = None

    def to_spec(self, req_id: str) -> RequestSpec:
        if self.echo:
            raise InvalidRequest("echo is not supported", "echo")
        if self.logprobs:
            raise InvalidRequest(
                "logprobs > 0 (top alternatives) is not supported yet; logprobs=0 returns the "
                "sampled token's logprob",
                "logprobs",
            )
        if self.suffix:
            raise InvalidRequest("suffix is not supported", "suffix")
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise InvalidRequest("only one prompt per request is supported", "prompt")
            prompt = prompt[0]
        logprobs = self.logprobs is not None
        if isinstance(prompt, str):
            return self._spec(self.max_tokens, logprobs, prompt=prompt, req_id=req_id)
        token_ids = tuple(prompt)  # type: ignore[arg-type]
        return self._spec(self.max_tokens, logprobs, prompt_token_ids=token_ids, req_id=req_id)


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
    tag_at = next((i for i, part in enumerate(loc) if _is_union_tag(part)), None)
    if tag_at is None:
        param = _dotted(loc)
        return InvalidRequest(f"{param}: {first['msg']}" if param else first["msg"], param)
    prefix = loc[:tag_at]
    forms = [e["loc"][tag_at] for e in errors if tuple(e["loc"][:tag_at]) == prefix]
    param = _dotted(prefix)
    return InvalidRequest(f"{param}: expected {' or '.join(dict.fromkeys(map(str, forms)))}", param)
