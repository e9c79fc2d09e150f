"""What a front end parsed (RequestSpec, ChatMessage) and what the Frontend made of it (Prepared):
frozen values, no state."""

from __future__ import annotations

from dataclasses import dataclass

from common.messages import GenerateRequest
from engine.kv_cache.retention import RetentionRange
from engine.sampling_params import StructuredOutput


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True)
class RequestSpec:
    """A request as a front end parsed it; exactly one of prompt, messages, prompt_token_ids."""

    model: str | None = None  # None or "": the served model
    prompt: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    max_tokens: int | None = None  # None: what fits in the context (or the default cap)
    max_tokens_param: str = "max_tokens"  # the field max_tokens came from (refusals name it)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    structured: StructuredOutput | None = None  # a grammar the output follows
    speculative: bool = True  # False: no speculative decoding for this request
    cache_salt: str | None = None
    n: int = 1  # choices sampled from the prompt (computed once)
    kv_retention: tuple[RetentionRange, ...] = ()  # token ranges kept longer (or shorter)
    req_id: str | None = None  # None: the front end makes one
    tenant: str | None = None  # the API key's tenant (Frontend.authenticate); None: keys off

    @property
    def input_param(self) -> str:
        return "messages" if self.messages is not None else "prompt"


@dataclass(frozen=True)
class Prepared:
    """A validated request ready for the backend, plus what stays in the router."""

    request: GenerateRequest
    stop: tuple[str, ...]
    arrival: float  # time.monotonic() when the request arrived
