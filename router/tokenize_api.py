"""/tokenize and /detokenize (vLLM's shapes) over the router's tokenizer, shared by the HTTP and
gRPC front ends; stateless (TokenizeSpec in, token ids or text out), the work done on the
Frontend's PromptEncoder threads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from router.errors import InvalidRequest
from router.frontend import Frontend
from router.openai_schema import ChatMessageIn
from router.prompt_encoder import PromptEncoder
from router.request_spec import ChatMessage, template_messages


@dataclass(frozen=True)
class TokenizeSpec:
    """One /tokenize request; exactly one of prompt and messages. add_special_tokens None takes
    vLLM's default: added to a prompt, not to a rendered chat (its template writes them)."""

    model: str | None = None
    prompt: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True  # a chat: end with the assistant turn's opening


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")  # an unknown field: 400 naming it


class TokenizeBody(_Body):
    """POST /tokenize: {model?, prompt | messages, add_special_tokens?, add_generation_prompt?}."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True

    def to_spec(self) -> TokenizeSpec:
        messages = None
        if self.messages is not None:
            messages = tuple(m.to_message(i) for i, m in enumerate(self.messages))
        return TokenizeSpec(
            self.model,
            self.prompt,
            messages,
            self.add_special_tokens,
            self.add_generation_prompt,
        )


class DetokenizeBody(_Body):
    """POST /detokenize: {model?, tokens: [...]}."""

    model: str | None = None
    tokens: list[int] = Field(default_factory=list)


async def tokenize(frontend: Frontend, spec: TokenizeSpec) -> list[int]:
    """The token ids the served model would see for spec's prompt or chat; raises
    InvalidRequest naming the field."""
    try:
        return await _token_ids(frontend.route(spec.model).encoder, spec)
    except InvalidRequest as e:
        raise frontend.reject(e) from None


async def _token_ids(encoder: PromptEncoder, spec: TokenizeSpec) -> list[int]:
    if (spec.prompt is None) == (spec.messages is None):
        raise InvalidRequest("give exactly one of a prompt or chat messages", "prompt")
    if spec.prompt is not None:
        add = True if spec.add_special_tokens is None else spec.add_special_tokens
        return await encoder.tokenize(spec.prompt, None, add)
    messages = template_messages(spec.messages or ())
    return await encoder.tokenize(
        None, messages, bool(spec.add_special_tokens), spec.add_generation_prompt
    )


async def detokenize(frontend: Frontend, model: str | None, token_ids: Sequence[int]) -> str:
    """The text of token_ids, special tokens included (so tokenize/detokenize round-trip);
    raises InvalidRequest naming the field."""
    try:
        route = frontend.route(model)
        vocab_size = route.tokenizer.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidRequest(
                f"tokens: {bad} is not a token id of this model (0 <= id < {vocab_size})",
                "tokens",
            )
    except InvalidRequest as e:
        raise frontend.reject(e) from None
    return await route.encoder.decode(token_ids, skip_special_tokens=False)
