"""gRPC front end (grpc.aio) for proto/kvrelay.proto, with standard health checking and
reflection beside it, over TLS when given credentials; owns the grpc.aio server. Request state
lives in the Frontend; a cancelled call aborts its request in the backend. With API keys,
Generate, ListModels, Tokenize and Detokenize need metadata `authorization: Bearer KEY` (or
`x-api-key: KEY`); Health, grpc.health.v1 and reflection stay open. A message over the
Frontend's body limit is refused by gRPC itself (RESOURCE_EXHAUSTED naming both sizes).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from common import tracing
from common.tracing import TRACEPARENT
from engine.finish_reason import FinishReason
from engine.kv_cache.retention import RetentionRange
from engine.sampling.sampling_params import SamplingParams
from router.errors import (
    BackendError,
    BackendUnavailable,
    InvalidRequest,
    Overloaded,
    Unauthenticated,
)
from router.fair_queue import QueueDeadline
from router.frontend import Frontend
from router.grpc_health import BackendHealth, add_standard_services
from router.output import OutputChunk
from router.pb import kvrelay_pb2 as pb
from router.pb import kvrelay_pb2_grpc as pb_grpc
from router.request_spec import ChatMessage, RequestSpec
from router.serving_gate import ClusterUnavailable
from router.structured_schema import structured_from_proto
from router.tokenize_api import TokenizeSpec, detokenize, tokenize

_FINISH_REASONS = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}


def sampling_from_proto(s: pb.SamplingParams, n: int = 1) -> SamplingParams:
    """The message's sampling fields as SamplingParams, converted once: an unset optional field
    takes SamplingParams' default (max_tokens too: spec_from_proto says it was unset)."""
    sampling = SamplingParams(
        temperature=s.temperature if s.HasField("temperature") else 1.0,
        top_k=s.top_k if s.HasField("top_k") and s.top_k != -1 else 0,  # -1: off, as HTTP
        top_p=s.top_p if s.HasField("top_p") else 1.0,
        min_p=s.min_p if s.HasField("min_p") else 0.0,
        seed=s.seed if s.HasField("seed") else None,
        n=n,
        stop=tuple(s.stop),
        stop_token_ids=tuple(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        logprobs=s.logprobs,
        top_logprobs=s.top_logprobs,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else 1.0,
        logit_bias=tuple(sorted(s.logit_bias.items())),
        structured=structured_from_proto(s.structured),
        speculative=s.speculative if s.HasField("speculative") else True,
    )
    return replace(sampling, max_tokens=s.max_tokens) if s.HasField("max_tokens") else sampling


def spec_from_proto(request: pb.GenerateRequest, tenant: str | None = None) -> RequestSpec:
    """A GenerateRequest message as a RequestSpec (validation happens in Frontend.prepare)."""
    s = request.sampling
    kind = request.WhichOneof("input")
    if kind is None:
        raise InvalidRequest("set one of prompt, chat or token_ids", "input")
    return RequestSpec(
        model=request.model or None,
        prompt=request.prompt if kind == "prompt" else None,
        messages=tuple(ChatMessage(m.role, m.content) for m in request.chat.messages)
        if kind == "chat"
        else None,
        prompt_token_ids=tuple(request.token_ids.ids) if kind == "token_ids" else None,
        sampling=sampling_from_proto(s, request.n if request.HasField("n") and request.n else 1),
        max_tokens_param="max_tokens" if s.HasField("max_tokens") else None,
        cache_salt=request.cache_salt if request.HasField("cache_salt") else None,
        kv_retention=tuple(
            RetentionRange(
                r.start,
                r.end if r.HasField("end") else None,
                r.priority,
                r.duration_s if r.HasField("duration_s") else None,
            )
            for r in request.kv_retention
        ),
        req_id=request.request_id or None,
        tenant=tenant,
        priority=request.priority if request.HasField("priority") else None,
        deadline_s=request.deadline_s if request.HasField("deadline_s") else None,
        structured_param=_structured_param(s.structured),
    )


def _structured_param(message: pb.StructuredOutput) -> str | None:
    kind = message.WhichOneof("kind")
    return None if kind is None else f"sampling.structured.{kind}"


def response_from_chunk(req_id: str, out: OutputChunk) -> pb.GenerateResponse:
    response = pb.GenerateResponse(
        request_id=req_id,
        token_ids=out.token_ids,
        text=out.text,
        finish_reason=_FINISH_REASONS.get(out.finish_reason, pb.FINISH_REASON_UNSPECIFIED),
        logprobs=out.logprobs,
        top_logprobs=[
            pb.TopLogprobs(token_ids=[t for t, _ in top], logprobs=[lp for _, lp in top])
            for top in out.top_logprobs
        ],
        index=out.index,
    )
    if out.usage is not None:
        u = out.usage
        response.usage.CopyFrom(
            pb.Usage(
                prompt_tokens=u.prompt_tokens,
                completion_tokens=u.completion_tokens,
                cached_prompt_tokens=u.cached_tokens,
                speculative_tokens_accepted=u.speculative_tokens_accepted,
            )
        )
    return response


class KVRelayServicer(pb_grpc.KVRelayServicer):
    def __init__(self, frontend: Frontend):
        self.frontend = frontend

    async def Generate(
        self, request: pb.GenerateRequest | MalformedRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        tenant = await self._authenticate(context)
        try:
            with self.frontend.admit():
                responses = self._generate(request, tenant, context)
                async with contextlib.aclosing(responses):
                    async for response in responses:
                        yield response
        except Overloaded as e:  # admit(), the fair queue, a per-key limit or the objectives:
            # before any response (initial metadata, the traceparent, may have gone out)
            wait_s = e.retry_after_s  # None: refused for good (no pushback)
            pushback: tuple[tuple[str, str], ...] = ()
            if wait_s is not None:  # retry-after (seconds) as HTTP's Retry-After says it
                pushback = (
                    ("grpc-retry-pushback-ms", str(wait_s * 1000)),
                    ("retry-after", str(wait_s)),
                )
            busy = not isinstance(e, ClusterUnavailable)  # else: shutting down, cluster lost
            code = grpc.StatusCode.RESOURCE_EXHAUSTED if busy else grpc.StatusCode.UNAVAILABLE
            if isinstance(e, QueueDeadline):
                code = grpc.StatusCode.DEADLINE_EXCEEDED
            await context.abort(code, e.message, pushback)

    async def _generate(
        self,
        request: pb.GenerateRequest | MalformedRequest,
        tenant: str | None,
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.GenerateResponse]:
        frontend = self.frontend
        if isinstance(request, MalformedRequest):
            frontend.reject(InvalidRequest(request.error))
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
        try:
            spec = spec_from_proto(request, tenant)
            if tracing.enabled():
                metadata = dict(context.invocation_metadata() or ())
                spec = replace(spec, traceparent=metadata.get(TRACEPARENT))
            prepared = await frontend.prepare(spec)
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, e.message)
        if prepared.trace is not None:  # the client learns the request's root span
            await context.send_initial_metadata(((TRACEPARENT, prepared.trace.traceparent),))
        req_id = prepared.client_id
        try:
            async with contextlib.aclosing(frontend.generate(prepared)) as chunks:
                async for out in chunks:
                    yield response_from_chunk(req_id, out)
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, e.message)
        except BackendError as e:  # a lost worker none replaced: the client may retry
            unavailable = isinstance(e, BackendUnavailable)
            status = grpc.StatusCode.UNAVAILABLE if unavailable else grpc.StatusCode.INTERNAL
            await context.abort(status, str(e))

    async def _authenticate(self, context: grpc.aio.ServicerContext) -> str | None:
        """The caller's tenant (None without keys); UNAUTHENTICATED for a missing or wrong key."""
        metadata = dict(context.invocation_metadata() or ())
        try:
            return self.frontend.authenticate(
                metadata.get("authorization"), metadata.get("x-api-key")
            )
        except Unauthenticated as e:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, e.message)

    async def Health(
        self, request: pb.HealthRequest, context: grpc.aio.ServicerContext
    ) -> pb.HealthResponse:
        status = await self.frontend.backend.health()
        details = {k: str(v) for k, v in status.items() if k != "ok"}
        return pb.HealthResponse(ok=bool(status.get("ok")), details=details)

    async def ListModels(
        self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        await self._authenticate(context)
        models = [
            pb.ModelInfo(
                id=r.model_id,
                max_model_len=r.backend.max_model_len,
                vocab_size=r.backend.vocab_size,
            )
            for r in self.frontend.routes.values()
        ]
        return pb.ListModelsResponse(models=models)

    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        await self._authenticate(context)
        kind = request.WhichOneof("input")
        spec = TokenizeSpec(
            model=request.model or None,
            prompt=request.prompt if kind == "prompt" else None,
            messages=tuple(ChatMessage(m.role, m.content) for m in request.chat.messages)
            if kind == "chat"
            else None,
            add_special_tokens=request.add_special_tokens
            if request.HasField("add_special_tokens")
            else None,
        )
        try:
            ids = await tokenize(self.frontend, spec)
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, e.message)
        max_len = self.frontend.route(spec.model).backend.max_model_len
        return pb.TokenizeResponse(tokens=ids, count=len(ids), max_model_len=max_len)

    async def Detokenize(
        self, request: pb.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DetokenizeResponse:
        await self._authenticate(context)
        try:
            text = await detokenize(self.frontend, request.model or None, list(request.tokens))
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, e.message)
        return pb.DetokenizeResponse(prompt=text)


@dataclass(frozen=True)
class MalformedRequest:
    """Bytes that did not parse as the request message (answered with INVALID_ARGUMENT)."""

    error: str


def _lenient(message_type: type[Message]) -> Callable[[bytes], Message | MalformedRequest]:
    def decode(data: bytes) -> Message | MalformedRequest:
        try:
            return message_type.FromString(data)
        except DecodeError as e:
            return MalformedRequest(f"the request is not a valid {message_type.__name__}: {e}")

    return decode


def _unary(
    method: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Message]],
    request_type: type[Message],
    response_type: type[Message],
) -> grpc.RpcMethodHandler:
    """A unary method whose undecodable request is answered INVALID_ARGUMENT, not UNKNOWN."""

    async def handle(request: Any, context: grpc.aio.ServicerContext) -> Message:
        if isinstance(request, MalformedRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
        return await method(request, context)

    return grpc.unary_unary_rpc_method_handler(
        handle,
        request_deserializer=_lenient(request_type),
        response_serializer=response_type.SerializeToString,
    )


def add_servicer(servicer: KVRelayServicer, server: grpc.aio.Server) -> None:
    """Like the generated add_KVRelayServicer_to_server, but undecodable requests are answered
    INVALID_ARGUMENT (Generate's servicer sees a MalformedRequest) instead of UNKNOWN."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate,
            request_deserializer=_lenient(pb.GenerateRequest),
            response_serializer=pb.GenerateResponse.SerializeToString,
        ),
        "Health": _unary(servicer.Health, pb.HealthRequest, pb.HealthResponse),
        "ListModels": _unary(servicer.ListModels, pb.ListModelsRequest, pb.ListModelsResponse),
        "Tokenize": _unary(servicer.Tokenize, pb.TokenizeRequest, pb.TokenizeResponse),
        "Detokenize": _unary(servicer.Detokenize, pb.DetokenizeRequest, pb.DetokenizeResponse),
    }
    service = pb.DESCRIPTOR.services_by_name["KVRelay"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))


class GrpcServer:
    """The servicers on host:port; port 0 picks a free one. Build it inside the serving loop.
    With credentials it serves TLS only."""

    def __init__(self, frontend: Frontend, credentials: grpc.ServerCredentials | None = None):
        limit = frontend.max_body_bytes
        # grpc turns SO_REUSEPORT on by default: a port another server listens on would be
        # shared silently (two routers each taking part of the calls); off, the bind fails.
        options = [("grpc.max_receive_message_length", limit), ("grpc.so_reuseport", 0)]
        self.server = grpc.aio.server(options=options)
        add_servicer(KVRelayServicer(frontend), self.server)
        self.health: BackendHealth = add_standard_services(self.server, frontend.backend)
        self.credentials = credentials
        self.port = 0

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        address = f"{host}:{port}"
        if self.credentials is None:
            self.port = self.server.add_insecure_port(address)
        else:
            self.port = self.server.add_secure_port(address, self.credentials)
        await self.health.start()
        await self.server.start()
        return self.port

    async def stop(self, grace_s: float | None = 1.0) -> None:
        try:
            await self.health.stop()
        finally:
            await self.server.stop(grace_s)
