"""What a front end parsed (RequestSpec, ChatMessage) and what the Frontend made of it (Prepared):
frozen values, no state."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from common.messages import GenerateRequest
from common.tracing import SpanHandle
from engine.kv_cache.retention import RetentionRange
from engine.sampling.sampling_params import SamplingParams
from router.errors import InvalidRequest
from router.traffic_class import DEFAULT_CLASS, KeyClass

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str
    name: str | None = None  # OpenAI's participant name, given to the chat template


def template_messages(messages: Sequence[ChatMessage]) -> list[dict[str, str]]:
    """The messages as a chat template takes them; InvalidRequest naming the message for an
    empty list or a role that is not one of CHAT_ROLES (a template renders any string it gets)."""
    if not messages:
        raise InvalidRequest("messages must not be empty", "messages")
    rendered = []
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            raise InvalidRequest(
                f"messages.{i}.role: {m.role!r} is not one of {', '.join(CHAT_ROLES)}",
                f"messages.{i}.role",
            )
        message = {"role": m.role, "content": m.content}
        if m.name:
            message["name"] = m.name
        rendered.append(message)
    return rendered


@dataclass(frozen=True)
class RequestSpec:
    """A request as a front end parsed it; exactly one of prompt, messages, prompt_token_ids.

    sampling is the client's, converted straight from its body or message (the stop strings
    included: Frontend.prepare keeps them in the router). Its max_tokens is the client's only
    when max_tokens_param names the field it came from; with None the client set no limit and
    Frontend.prepare gives it what the context leaves (or the default cap)."""

    model: str | None = None  # None or "": the served model
    prompt: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens_param: str | None = None  # "max_tokens" / "max_completion_tokens"; None: unset
    cache_salt: str | None = None
    kv_retention: tuple[RetentionRange, ...] = ()  # token ranges kept longer (or shorter)
    req_id: str | None = None  # the client's own id (gRPC request_id); None: the router's
    id_prefix: str = "req"  # the router's id: f"{id_prefix}-{uuid}" (OpenAI's "chatcmpl", "cmpl")
    tenant: str | None = None  # the API key's tenant (Frontend.authenticate); None: keys off
    traceparent: str | None = None  # the client's W3C traceparent (read only while tracing)
    priority: int | None = None  # None: the key class's default (router/traffic_class.py)
    deadline_s: float | None = None  # batch: refused if still queued this long after arrival
    # The field the structured output came from, as this front end names it ("guided_json",
    # "sampling.structured.grammar"); None: none asked, or the engine's HTTP name by kind.
    structured_param: str | None = None

    @property
    def max_tokens(self) -> int | None:
        """The client's limit on output tokens (None: it set none)."""
        return None if self.max_tokens_param is None else self.sampling.max_tokens

    @property
    def input_param(self) -> str:
        return "messages" if self.messages is not None else "prompt"


@dataclass(frozen=True)
class Prepared:
    """A validated request ready for the backend, plus what stays in the router."""

    request: GenerateRequest
    stop: tuple[str, ...]
    arrival: float  # time.monotonic() when the request arrived
    tenant: str | None = (
        None  # the API key's tenant: charged (rate_limits.py), shared fairly (fair_queue.py)
    )
    key_class: KeyClass = DEFAULT_CLASS
    trace: SpanHandle | None = None  # its root span (router/traces.py); None: tracing off
    structured_param: str | None = None  # RequestSpec's: a worker's refusal names it
    # the id the client sees in every response: its own (gRPC request_id), else the router's
    # one; request.req_id is the cluster's, the client's made unique (frontend.cluster_request_id)
    client_id: str = ""
