"""Frontend: request handling shared by the HTTP and gRPC servers; owns the set of in-flight
request ids and, through Admission, the bound on requests held. Checks API keys, validates and
tokenizes a RequestSpec into a GenerateRequest, then turns the backend's TokenDelta stream into
text chunks (stop strings applied here), usage and metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace

from common.messages import GenerateRequest, TokenDelta
from engine.kv_cache.retention import InvalidRetention, RetentionRange, check_ranges
from engine.sampling_params import SamplingParams, StructuredOutput
from engine.validation import InvalidField, check_request
from router.access import ApiKeys, tenant_cache_salt
from router.admission import DEFAULT_MAX_QUEUED_REQUESTS, Admission
from router.backend import Backend
from router.choices import ChoiceTrackers
from router.errors import BackendError, InvalidRequest, Overloaded, Unauthenticated
from router.metrics import RouterMetrics
from router.output import OutputChunk, Usage
from router.tokenizer import RouterTokenizer

__all__ = [
    "BackendError",
    "ChatMessage",
    "Frontend",
    "InvalidRequest",
    "OutputChunk",
    "Prepared",
    "RequestSpec",
    "Usage",
]

logger = logging.getLogger(__name__)


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


class Frontend:
    """Validation, tokenization and output streaming over one Backend."""

    def __init__(
        self,
        backend: Backend,
        tokenizer: RouterTokenizer,
        metrics: RouterMetrics | None = None,
        model_aliases: tuple[str, ...] = (),
        max_tokens_cap: int | None = None,
        max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS,
        api_keys: ApiKeys | None = None,
    ):
        """max_tokens_cap: the default max_tokens when a request sets none (None: no cap).
        max_queued_requests: how many requests the router holds at once (parsing, queued or
        running); one more is refused with Overloaded. api_keys: None admits every caller."""
        self.backend = backend
        self.tokenizer = tokenizer
        self.metrics = metrics or RouterMetrics()
        self.model_id = backend.model_id
        self.model_names = frozenset((backend.model_id, *model_aliases))
        self.max_tokens_cap = max_tokens_cap
        self.api_keys = api_keys
        self.admission = Admission(max_queued_requests, self.metrics)
        self._in_flight: set[str] = set()

    # ---- access --------------------------------------------------------------------------
    def authenticate(self, authorization: str | None, x_api_key: str | None) -> str | None:
        """The caller's tenant (None when no keys are configured); raises Unauthenticated for a
        missing or unknown key. The key itself is never logged."""
        if self.api_keys is None:
            return None
        try:
            return self.api_keys.authenticate(authorization, x_api_key)
        except Unauthenticated as e:
            self.metrics.unauthenticated.inc()
            logger.info("refused a request: %s", e.message)
            raise

    def admit(self) -> AbstractContextManager[None]:
        """`with frontend.admit():` holds one of the router's request slots for the block;
        raises Overloaded at once when they are all taken (nothing reaches the backend)."""
        return self.admission.slot()

    # ---- validation ----------------------------------------------------------------------
    def reject(self, error: InvalidRequest) -> InvalidRequest:
        """Count a refused request; returns the error for `raise frontend.reject(e)`."""
        self.metrics.rejected.inc()
        return error

    def prepare(self, spec: RequestSpec, arrival: float | None = None) -> Prepared:
        """Validate and tokenize; raises InvalidRequest with a message naming the field."""
        arrival = time.monotonic() if arrival is None else arrival
        try:
            return self._prepare(spec, arrival)
        except InvalidRequest as e:
            raise self.reject(e) from None

    def check_model(self, model: str | None) -> None:
        """Raises InvalidRequest unless model is empty or a name of the served model."""
        if model and model not in self.model_names:
            raise InvalidRequest(
                f"model {model!r} is not served here; available: {self.model_id!r}",
                "model",
                "model_not_found",
            )

    def _prepare(self, spec: RequestSpec, arrival: float) -> Prepared:
        self.check_model(spec.model)
        prompt_ids = self._prompt_ids(spec)
        max_len = self.backend.max_model_len
        max_tokens = spec.max_tokens
        if max_tokens is None:
            room = max(1, max_len - len(prompt_ids))
            max_tokens = min(room, self.max_tokens_cap or room)
        sampling = SamplingParams(
            max_tokens=max_tokens,
            temperature=spec.temperature,
            top_k=spec.top_k,
            top_p=spec.top_p,
            min_p=spec.min_p,
            seed=spec.seed,
            stop_token_ids=spec.stop_token_ids,
            ignore_eos=spec.ignore_eos,
            logprobs=spec.logprobs,
            top_logprobs=spec.top_logprobs,
            presence_penalty=spec.presence_penalty,
            frequency_penalty=spec.frequency_penalty,
            repetition_penalty=spec.repetition_penalty,
            logit_bias=spec.logit_bias,
            structured=spec.structured,
            speculative=spec.speculative,
            stop=spec.stop,
            n=spec.n,
        )
        try:
            check_request(prompt_ids, sampling, self.backend.vocab_size, max_len, spec.input_param)
        except InvalidField as e:
            raise InvalidRequest(e.message, e.field, e.code) from None
        if sampling.n > self.backend.max_choices:
            raise InvalidRequest(
                f"n={sampling.n} is not supported by this deployment "
                f"(at most {self.backend.max_choices})",
                "n",
            )
        sampling = replace(sampling, stop=())  # stop strings stay in the router (it detokenizes)
        req_id = spec.req_id or f"req-{uuid.uuid4().hex}"
        salt = self._cache_salt(spec)
        try:
            check_ranges(spec.kv_retention)
        except InvalidRetention as e:
            raise InvalidRequest(str(e), e.field) from None
        request = GenerateRequest(
            req_id, tuple(prompt_ids), sampling, salt, time.time(), kv_retention=spec.kv_retention
        )
        return Prepared(request, spec.stop, arrival)

    def _cache_salt(self, spec: RequestSpec) -> str | None:
        """A tenant's requests get a salt derived from the tenant; without keys, the client's."""
        if spec.tenant is not None:
            return tenant_cache_salt(spec.tenant, spec.cache_salt)
        if self.api_keys is not None:  # fail closed: a front end that skipped authenticate()
            raise RuntimeError("API keys are configured but the request has no tenant")
        return spec.cache_salt

    def _prompt_ids(self, spec: RequestSpec) -> list[int]:
        inputs = [spec.prompt, spec.messages, spec.prompt_token_ids]
        if sum(x is not None for x in inputs) != 1:
            raise InvalidRequest("give exactly one of a prompt, chat messages or token ids")
        if spec.messages is not None:
            if not spec.messages:
                raise InvalidRequest("messages must not be empty", "messages")
            messages = [{"role": m.role, "content": m.content} for m in spec.messages]
            try:
                return self.tokenizer.apply_chat_template(messages)
            except ValueError as e:
                raise InvalidRequest(str(e), "messages") from None
        if spec.prompt is not None:
            return self.tokenizer.encode(spec.prompt)
        return list(spec.prompt_token_ids or ())

    # ---- streaming -----------------------------------------------------------------------
    async def generate(self, prepared: Prepared) -> AsyncIterator[OutputChunk]:
        """Stream output chunks (n > 1: each names its choice in `index`); each choice's last
        has its finish_reason, the request's last also has usage.

        Leaving early (client gone, task cancelled, aclose()) aborts the request in the
        backend; so does a stop string, which the backend does not know about.
        Raises BackendError if the backend fails the request.
        """
        req = prepared.request
        if req.req_id in self._in_flight:
            raise self.reject(InvalidRequest(f"request id {req.req_id!r} is already in flight"))
        self._in_flight.add(req.req_id)
        self.metrics.running.inc()
        self.metrics.queue_time.observe(time.monotonic() - prepared.arrival)
        tracker = ChoiceTrackers(self.tokenizer, prepared, self.metrics)
        stream = self.backend.generate(req)
        try:
            async for delta in stream:
                chunk = tracker.on_delta(delta)
                if chunk is None:  # a choice that already ended (its stop string matched)
                    continue
                yield chunk
                if tracker.finished:
                    return
            raise BackendError("the backend's stream ended before the request finished")
        except (BackendError, Overloaded):  # Overloaded: refused for the objectives
            raise
        except InvalidField as e:  # a worker's engine refused it (its grammar compiler, say)
            cause: InvalidField = getattr(e, "cause", e)  # Ray wraps the worker's exception
            raise self.reject(InvalidRequest(cause.message, cause.field, cause.code)) from None
        except Exception as e:
            logger.exception("backend failed request %s", req.req_id)
            raise BackendError(f"the backend failed: {e}") from e
        finally:
            self._in_flight.discard(req.req_id)
            self.metrics.running.dec()
            # Shielded: a second cancellation must not skip the abort.
            await asyncio.shield(self._end(req.req_id, stream, tracker))

    async def _end(
        self, req_id: str, stream: AsyncIterator[TokenDelta], tracker: ChoiceTrackers
    ) -> None:
        try:
            await _close(stream)
            if not tracker.backend_finished:
                await self.backend.abort(req_id)
        except Exception:
            logger.exception("aborting request %s failed", req_id)
        finally:
            tracker.record_end()

    def model_ids(self) -> list[str]:
        return [self.model_id]


async def _close(stream: AsyncIterator[object]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        with contextlib.suppress(Exception):
            await aclose()
