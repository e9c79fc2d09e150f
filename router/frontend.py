"""Frontend: request handling shared by the HTTP and gRPC servers; owns the set of in-flight
request ids and, through Admission, the bound on requests held (through its FairQueue, the
order in which they go on to the cluster). Checks API keys, validates and
tokenizes a RequestSpec into a GenerateRequest (off the event loop, through its PromptEncoder),
then turns the backend's TokenDelta stream into text chunks (stop strings applied here), usage
and metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
import unicodedata
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import TYPE_CHECKING

from common.messages import GenerateRequest, TokenDelta
from engine.kv_cache.retention import InvalidRetention, check_ranges
from engine.sampling.validation import STRUCTURED_FIELDS, InvalidField, check_request
from router import traces
from router.access import ApiKeys, tenant_cache_salt
from router.admission import DEFAULT_MAX_QUEUED_REQUESTS, Admission
from router.backend import Backend
from router.choices import ChoiceTrackers
from router.errors import BackendError, InvalidRequest, Overloaded, RateLimited, Unauthenticated
from router.fair_queue import FairQueue, Ticket
from router.metrics import RouterMetrics
from router.output import OutputChunk, Usage
from router.prompt_encoder import PromptEncoder
from router.request_size import max_body_bytes
from router.request_spec import ChatMessage, Prepared, RequestSpec, template_messages
from router.served_models import ModelRoute, model_routes
from router.tokenizer import RouterTokenizer
from router.traffic_class import DEFAULT_CLASS, check_deadline, request_priority

if TYPE_CHECKING:
    from router.rate_limits import Grant, RateLimiter

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


class Frontend:
    """Validation, tokenization and output streaming over one Backend."""

    def __init__(
        self,
        backend: Backend,
        tokenizer: RouterTokenizer,
        metrics: RouterMetrics | None = None,
        max_tokens_cap: int | None = None,
        max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS,
        api_keys: ApiKeys | None = None,
        max_body_mib: float | None = None,
        limiter: RateLimiter | None = None,
        max_running_requests: int = 0,
        tokenizers: Mapping[str, RouterTokenizer] | None = None,
    ):
        """max_tokens_cap: the default max_tokens when a request sets none (None: no cap).
        max_queued_requests: how many requests the router holds at once (parsing, queued or
        running); one more is refused with Overloaded. api_keys: None admits every caller.
        max_body_mib: the largest request body read (None: derived from the context length).
        limiter: each tenant's per-key limits (None: none; needs api_keys to have tenants).
        max_running_requests: how many of one priority or higher go on to the cluster at once
        (twice that in all); the rest wait in the router's FairQueue (0: no bound, all go at
        once). tokenizers: with a ModelsBackend, each other model's tokenizer by model id
        (`tokenizer` is the default model's); a request's `model` picks its route
        (router/served_models.py)."""
        self.backend = backend
        self.tokenizer = tokenizer
        self.metrics = metrics or RouterMetrics()
        self.model_id = backend.model_id
        self.routes = model_routes(backend, tokenizer, tokenizers or {})
        self.max_tokens_cap = max_tokens_cap
        self.api_keys = api_keys
        self.limiter = limiter
        self.admission = Admission(max_queued_requests, self.metrics)
        self.queue = FairQueue(max_running_requests, max_queued_requests, self.metrics.registry)
        longest = max(r.backend.max_model_len for r in self.routes.values())
        self.max_body_bytes = max_body_bytes(longest, max_body_mib)
        self.created = int(time.time())  # when this router began serving the model (/v1/models)
        self._in_flight: set[tuple[str | None, str]] = set()  # (tenant, client's request id)

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

    async def prepare(self, spec: RequestSpec, arrival: float | None = None) -> Prepared:
        """Validate and tokenize (on the encoder's threads); raises InvalidRequest with a message
        naming the field."""
        arrival = time.monotonic() if arrival is None else arrival
        try:
            return await self._prepare(spec, arrival)
        except InvalidRequest as e:
            raise self.reject(e) from None

    def route(self, model: str | None) -> ModelRoute:
        """The served model a request's `model` names (empty: the default one); raises
        InvalidRequest naming `model` for one not served here."""
        if model and model not in self.routes:
            available = ", ".join(repr(m) for m in self.routes)
            raise InvalidRequest(
                f"model {model!r} is not served here; available: {available}",
                "model",
                "model_not_found",
            )
        return self.routes.get(model or "", self.routes[self.model_id])

    async def _prepare(self, spec: RequestSpec, arrival: float) -> Prepared:
        route = self.route(spec.model)
        prompt_ids = await self._prompt_ids(spec, route.encoder)
        backend = route.backend
        max_len = backend.max_model_len
        sampling = spec.sampling
        if spec.max_tokens is None:  # what the context leaves, or the default cap
            room = max(1, max_len - len(prompt_ids))
            sampling = replace(sampling, max_tokens=min(room, self.max_tokens_cap or room))
        try:
            check_request(prompt_ids, sampling, backend.vocab_size, max_len, spec.input_param)
        except InvalidField as e:
            raise _refusal(e, spec.max_tokens_param, spec.structured_param) from None
        _check_room(spec, len(prompt_ids), max_len)
        if sampling.n > backend.max_choices:
            raise InvalidRequest(
                f"n={sampling.n} is not supported by this deployment "
                f"(at most {backend.max_choices})",
                "n",
            )
        sampling = replace(sampling, stop=())  # stop strings stay in the router (it detokenizes)
        req_id = cluster_request_id(spec.req_id, spec.id_prefix)
        salt = self._cache_salt(spec)
        try:
            check_ranges(spec.kv_retention)
        except InvalidRetention as e:
            raise InvalidRequest(str(e), e.field) from None
        key_class = self.api_keys.key_class(spec.tenant) if self.api_keys else DEFAULT_CLASS
        priority = request_priority(key_class, spec.priority)
        deadline_s = check_deadline(spec.deadline_s, key_class if self.api_keys else None)
        # begun once nothing can refuse it here (a request refused as invalid has no trace)
        trace = traces.start_request(spec.traceparent, req_id, route.model_id, arrival)
        request = GenerateRequest(
            req_id,
            tuple(prompt_ids),
            sampling,
            salt,
            time.time(),
            kv_retention=spec.kv_retention,
            traceparent=None if trace is None else trace.traceparent,
            model=route.model_id,
            priority=priority,
            deadline_s=deadline_s,
        )
        return Prepared(
            request,
            spec.sampling.stop,
            arrival,
            tenant=spec.tenant,
            key_class=key_class,
            trace=trace,
            structured_param=spec.structured_param,
            client_id=spec.req_id or req_id,
        )

    def _cache_salt(self, spec: RequestSpec) -> str | None:
        """A tenant's requests get a salt derived from the tenant; without keys, the client's."""
        if spec.tenant is not None:
            return tenant_cache_salt(spec.tenant, spec.cache_salt)
        if self.api_keys is not None:  # fail closed: a front end that skipped authenticate()
            raise RuntimeError("API keys are configured but the request has no tenant")
        return spec.cache_salt

    async def _prompt_ids(self, spec: RequestSpec, encoder: PromptEncoder) -> list[int]:
        inputs = [spec.prompt, spec.messages, spec.prompt_token_ids]
        if sum(x is not None for x in inputs) != 1:
            raise InvalidRequest("give exactly one of a prompt, chat messages or token ids")
        if spec.prompt_token_ids is not None:
            return list(spec.prompt_token_ids)
        messages = None if spec.messages is None else template_messages(spec.messages)
        return await encoder.prompt_ids(spec.prompt, messages)

    # ---- streaming -----------------------------------------------------------------------
    async def generate(self, prepared: Prepared) -> AsyncIterator[OutputChunk]:
        """_stream's chunks: the request charged to its tenant's per-key limits first
        (RateLimited at once, never after a wait), then its turn from the router's FairQueue
        (it may wait there; Overloaded when the queue is full or its deadline passes first).
        One refused or cancelled before its turn still ends its trace and gives back its grant.
        """
        req = prepared.request
        own = (prepared.tenant, prepared.client_id)  # another tenant's ids are not this one's
        route = self.route(req.model)
        objectives = route.backend.objectives(route.model_id)
        tracker = ChoiceTrackers(route.tokenizer, prepared, self.metrics, objectives)
        if own in self._in_flight:
            twin = f"request_id {prepared.client_id!r} is already in flight"
            error = self.reject(InvalidRequest(twin, "request_id"))
            if prepared.trace is not None:  # refused after its trace began: ended failed
                traces.end_request(prepared.trace, tracker, error)
            raise error
        grant = None
        turn = False
        # reserved from here, before any wait: a twin sent while this one waits in the queue
        # or on its limits is refused too (both sent on, the loser's abort ended the other)
        self._in_flight.add(own)
        try:
            grant = await self._charge(prepared)
            ticket = Ticket.of(req, prepared.tenant, prepared.key_class, prepared.arrival)
            async with self.queue.turn(ticket):
                turn = True  # from here _stream ends the trace and gives the grant back
                async with contextlib.aclosing(self._stream(prepared, tracker, grant)) as chunks:
                    async for chunk in chunks:
                        yield chunk
        except BaseException as e:
            if not turn:
                if prepared.trace is not None:
                    traces.end_request(prepared.trace, tracker, e)
                if grant is not None and self.limiter is not None:
                    await asyncio.shield(self.limiter.release(grant, 0, 0))
            raise
        finally:
            self._in_flight.discard(own)

    async def _stream(
        self, prepared: Prepared, tracker: ChoiceTrackers, grant: Grant | None
    ) -> AsyncIterator[OutputChunk]:
        """Stream output chunks (n > 1: each names its choice in `index`); each choice's last
        has its finish_reason, the request's last also has usage.

        Leaving early (client gone, task cancelled, aclose()) aborts the request in the
        backend; so does a stop string, which the backend does not know about.
        Raises BackendError if the backend fails the request.
        """
        req = prepared.request
        self.metrics.running.inc()
        self.metrics.queue_time.labels(model=req.model).observe(time.monotonic() - prepared.arrival)
        stream = self.backend.generate(req)
        first = True
        try:
            async for delta in stream:
                chunk = tracker.on_delta(delta)
                if chunk is None:  # a choice that already ended (its stop string matched)
                    continue
                if first:
                    first = False
                    traces.first_token(prepared.trace)
                yield chunk
                if tracker.finished:
                    return
            raise BackendError("the backend's stream ended before the request finished")
        except Overloaded:  # refused before any output (no worker, the objectives)
            tracker.refused = True
            raise
        except BackendError:
            raise
        except InvalidField as e:  # a worker's engine refused it (its grammar compiler, say)
            cause: InvalidField = getattr(e, "cause", e)  # Ray wraps the worker's exception
            raise self.reject(_refusal(cause, None, prepared.structured_param)) from None
        except Exception as e:
            logger.exception("backend failed request %s", req.req_id)
            # A worker's exception comes wrapped by Ray, its text holding the remote traceback
            # (paths, hosts): the client gets the worker's own message only.
            cause = getattr(e, "cause", None) or e
            raise BackendError(f"the backend failed: {cause}") from e
        finally:
            self.metrics.running.dec()
            if prepared.trace is not None:
                traces.end_request(prepared.trace, tracker, sys.exc_info()[1])
            # Ended or left (cancel, disconnect): the client's id is its own again at once; the
            # abort below (~0.2 s) ends this request's cluster id, never a resent one's.
            self._in_flight.discard((prepared.tenant, prepared.client_id))
            # Shielded: a second cancellation must not skip the abort.
            await asyncio.shield(self._end(prepared, stream, tracker, grant))

    async def _charge(self, prepared: Prepared) -> Grant | None:
        """Charge the request to its tenant (prompt + n * max_tokens tokens); raises
        RateLimited when a per-key limit refuses it. None: no tenant, or no limiter."""
        tenant = prepared.tenant
        grant = None
        if tenant is not None and self.limiter is not None:
            num_tokens = prepared.request.max_total_tokens
            try:
                grant = await self.limiter.admit(tenant, prepared.request.req_id, num_tokens)
            except RateLimited as e:
                self.metrics.tenant_refused.labels(tenant=tenant, limit=e.limit).inc()
                raise
        if tenant is not None:
            self.metrics.tenant_requests.labels(tenant=tenant).inc()
        return grant

    async def _end(
        self,
        prepared: Prepared,
        stream: AsyncIterator[TokenDelta],
        tracker: ChoiceTrackers,
        grant: Grant | None,
    ) -> None:
        req_id = prepared.request.req_id
        try:
            await _close(stream)
            if not tracker.backend_finished:
                await self.backend.abort(req_id)
        except Exception:
            logger.exception("aborting request %s failed", req_id)
        finally:
            tracker.record_end()
            usage = tracker.usage()
            if prepared.tenant is not None:
                tokens = self.metrics.tenant_tokens
                tokens.labels(tenant=prepared.tenant, kind="prompt").inc(usage.prompt_tokens)
                tokens.labels(tenant=prepared.tenant, kind="completion").inc(
                    usage.completion_tokens
                )
            if grant is not None and self.limiter is not None:
                await self.limiter.release(grant, usage.prompt_tokens, usage.completion_tokens)

    def model_ids(self) -> list[str]:
        return list(self.routes)


MAX_REQUEST_ID_CHARS = 256  # a client's request id: echoed in every response, kept in logs
# Unicode categories a request id may not hold: control, format (zero-width, bidi overrides),
# surrogates, line and paragraph separators (spaces of any kind are fine)
UNPRINTABLE = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})


def cluster_request_id(client_id: str | None, id_prefix: str = "req") -> str:
    """The id a request has inside the cluster (engines, handoffs, leases, limits): the router's
    own (f"{id_prefix}-{uuid}"), or the client's id with a random suffix. Clients choose ids
    without knowing of each other: two tenants, or one behind two routers, may send the same
    one, and a worker refuses an id it already runs. The client's id leads, so logs find it."""
    if client_id is None:
        return f"{id_prefix}-{uuid.uuid4().hex}"
    if len(client_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(
            f"at most {MAX_REQUEST_ID_CHARS} characters, got {len(client_id)}", "request_id"
        )
    if any(unicodedata.category(ch) in UNPRINTABLE for ch in client_id):
        raise InvalidRequest(
            "no control, format or line-separator characters (it goes into log lines)",
            "request_id",
        )
    return f"{client_id}-{uuid.uuid4().hex[:16]}"


def _refusal(
    e: InvalidField, max_tokens_param: str | None, structured_param: str | None
) -> InvalidRequest:
    """An engine rule's refusal naming the field as the client's front end calls it (the
    engine knows max_tokens and a structured output's HTTP name by kind)."""
    field = e.field
    if field == "max_tokens" and max_tokens_param:
        field = max_tokens_param
    elif structured_param and field in STRUCTURED_FIELDS:
        field = structured_param
    message = e.message if field == e.field else e.message.replace(e.field or "", field or "", 1)
    return InvalidRequest(message, field, e.code)


def _check_room(spec: RequestSpec, num_prompt_tokens: int, max_model_len: int) -> None:
    """max_tokens must fit in what the context leaves after the prompt (refused, never capped)."""
    room = max_model_len - num_prompt_tokens
    if spec.max_tokens is not None and spec.max_tokens > room:
        field = spec.max_tokens_param
        raise InvalidRequest(
            f"{field}={spec.max_tokens} is more than the context leaves: this model's context "
            f"length (max_model_len) is {max_model_len} tokens and the prompt has "
            f"{num_prompt_tokens} tokens, so at most {room} can be generated; lower {field} "
            "(or leave it out to generate up to the context length)",
            field,
            "context_length_exceeded",
        )


async def _close(stream: AsyncIterator[object]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        with contextlib.suppress(Exception):
            await aclose()
