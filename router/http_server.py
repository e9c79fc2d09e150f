"""OpenAI-compatible HTTP front end (aiohttp): /v1/chat/completions, /v1/completions (SSE when
stream=true), /v1/models, /tokenize, /detokenize, /health (liveness), /ready, /metrics,
/openapi.json; HTTPS when given an SSL context. Owns the aiohttp app and runner; request state
lives in the Frontend. With API keys, every path but /health, /ready, /metrics and /openapi.json
needs `Authorization: Bearer KEY` (401 otherwise). A body over the Frontend's limit gets 413. A
client that disconnects cancels its handler, which aborts the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from common import tracing
from common.tracing import TRACEPARENT
from common.version import version
from router.errors import (
    BackendError,
    BackendUnavailable,
    InvalidRequest,
    Overloaded,
    RateLimited,
)
from router.frontend import Frontend
from router.http_middleware import (
    FRONTEND_KEY,
    TENANT_KEY,
    TRACE_KEY,
    answer_traceparent,
    api_keys,
    body_limit,
    errors_as_json,
)
from router.http_middleware import json_response as _json
from router.metrics import CONTENT_TYPE
from router.openai_format import ResponseContext, error_body, invalid_body
from router.openai_schema import ChatCompletionRequest, CompletionRequest, invalid_from_validation
from router.openapi import openapi_document
from router.output import OutputChunk, Usage
from router.readiness import check_readiness
from router.request_spec import Prepared
from router.served_models import ModelRoute
from router.serving_gate import RETRY_AFTER_S, UNAVAILABLE
from router.tokenize_api import DetokenizeBody, TokenizeBody, detokenize, tokenize

OPENAPI_KEY = web.AppKey("openapi", dict)
# A request body must arrive within this long (408 after it): a client that sends its headers
# and then a trickle holds a socket, never a request slot, and not for good.
BODY_TIMEOUT_S = 30.0
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


def _bad_request(error: InvalidRequest) -> web.Response:
    return _json(invalid_body(error), status=400)


def _sse(body: dict[str, Any] | str) -> bytes:
    data = body if isinstance(body, str) else json.dumps(body, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


def _overloaded(error: Overloaded) -> web.Response:
    """503 with the error's code: "overloaded" (the router's bound, the objectives),
    "shutting_down" or "unavailable" (router/serving_gate.py); 429 "rate_limit_exceeded" naming
    the limit in `param` (a tenant's per-key limits); Retry-After where it has one."""
    if isinstance(error, RateLimited):
        body = error_body(error.message, "rate_limit_error", error.limit, error.code)
    else:
        body = error_body(error.message, "server_error", code=error.code)
    response = _json(body, error.http_status)
    if error.retry_after_s is not None:
        response.headers["Retry-After"] = str(error.retry_after_s)
    return response


def _backend_body(error: BackendError) -> dict[str, Any]:
    """A failed request's error: "unavailable" (server_error) where its worker was lost and no
    other took it on (the client may retry), else "internal_error"."""
    if isinstance(error, BackendUnavailable):
        return error_body(str(error), "server_error", code=UNAVAILABLE)
    return error_body(str(error), "internal_error")


def _backend_failed(error: BackendError) -> web.Response:
    """503 with Retry-After for a lost worker no other replaced, else 500."""
    if isinstance(error, BackendUnavailable):
        response = _json(_backend_body(error), 503)
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
        return response
    return _json(_backend_body(error), 500)


class BodyTimeout(Exception):
    """A request body did not arrive within BODY_TIMEOUT_S."""


async def read_body(request: web.Request) -> bytes:
    """The whole body, within BODY_TIMEOUT_S (else BodyTimeout)."""
    try:
        return await asyncio.wait_for(request.read(), BODY_TIMEOUT_S)
    except TimeoutError:
        raise BodyTimeout from None


def _body_timeout() -> web.Response:
    """408, closing the connection (else aiohttp would go on reading the rest of the body)."""
    message = f"the request body did not arrive within {BODY_TIMEOUT_S:g} s"
    response = _json(error_body(message, "invalid_request_error", code="request_timeout"), 408)
    response.force_close()
    return response


async def _parse(
    request: web.Request,
    raw: bytes,
    schema: type[ChatCompletionRequest | CompletionRequest],
    arrival: float,
) -> tuple[ChatCompletionRequest | CompletionRequest, Prepared]:
    frontend = request.app[FRONTEND_KEY]
    try:
        body = schema.model_validate_json(raw)
        spec = replace(
            body.to_spec(),
            tenant=request.get(TENANT_KEY),
            traceparent=request.headers.get(TRACEPARENT) if tracing.enabled() else None,
        )
    except ValidationError as e:
        raise frontend.reject(invalid_from_validation(e)) from None
    except InvalidRequest as e:
        raise frontend.reject(e) from None
    prepared = await frontend.prepare(spec, arrival)
    if prepared.trace is not None:  # answered in the response's traceparent header
        request[TRACE_KEY] = prepared.trace.traceparent
    return body, prepared


async def _completions(request: web.Request, chat: bool) -> web.StreamResponse:
    """A full router answers 503 at once; else its body is read (within BODY_TIMEOUT_S: a slow
    client holds no request slot meanwhile), then it is admitted (503 if the router filled)."""
    frontend = request.app[FRONTEND_KEY]
    arrival = time.monotonic()
    try:
        frontend.admission.check_room()
        raw = await read_body(request)
    except Overloaded as e:
        return _overloaded(e)
    except BodyTimeout:
        return _body_timeout()
    try:
        with frontend.admit():
            return await _admitted(request, raw, arrival, frontend, chat)
    except Overloaded as e:
        return _overloaded(e)


async def _admitted(
    request: web.Request, raw: bytes, arrival: float, frontend: Frontend, chat: bool
) -> web.StreamResponse:
    schema = ChatCompletionRequest if chat else CompletionRequest
    try:
        body, prepared = await _parse(request, raw, schema, arrival)
    except InvalidRequest as e:
        return _bad_request(e)
    route = frontend.route(prepared.request.model)
    ctx = ResponseContext(
        response_id=prepared.client_id,
        model=route.model_id,
        chat=chat,
        tokenizer=route.tokenizer,
        want_logprobs=prepared.request.sampling.logprobs,
        echo_text=await _echo_text(body, prepared, frontend),
        num_choices=prepared.request.sampling.n,
    )
    if body.stream:
        return await _stream(request, frontend, prepared, ctx, body.include_usage)
    return await _collect(frontend, prepared, ctx)


async def _echo_text(
    body: ChatCompletionRequest | CompletionRequest, prepared: Prepared, frontend: Frontend
) -> str:
    """Completions with echo: the prompt's text (its token ids decoded when sent as ids, their
    special tokens too: the prompt as sent)."""
    if not isinstance(body, CompletionRequest) or not body.echo:
        return ""
    text = body.prompt_text()
    if text is None:
        encoder = frontend.route(prepared.request.model).encoder
        text = await encoder.decode(prepared.request.prompt_token_ids, skip_special_tokens=False)
    return text


async def _collect(frontend: Frontend, prepared: Prepared, ctx: ResponseContext) -> web.Response:
    usage = Usage(len(prepared.request.prompt_token_ids), 0, 0)
    try:
        async with contextlib.aclosing(frontend.generate(prepared)) as chunks:
            async for out in chunks:
                ctx.add(out)
                usage = out.usage or usage
    except InvalidRequest as e:
        return _bad_request(e)
    except BackendError as e:
        return _backend_failed(e)
    return _json(ctx.final(usage))


async def _stream(
    request: web.Request,
    frontend: Frontend,
    prepared: Prepared,
    ctx: ResponseContext,
    include_usage: bool,
) -> web.StreamResponse:
    response = web.StreamResponse(headers=_SSE_HEADERS)
    try:
        async with contextlib.aclosing(frontend.generate(prepared)) as chunks:
            # The response starts with the first output: a request refused before it (for the
            # objectives, or invalid) still gets a plain HTTP status.
            try:
                head = [await anext(chunks)]
            except Overloaded as e:
                return _overloaded(e)
            except InvalidRequest as e:
                return _bad_request(e)
            except BackendError as e:
                return _backend_failed(e)
            except StopAsyncIteration:
                head = []
            await response.prepare(request)
            for first in ctx.first_chunks():
                if include_usage:  # every chunk but the usage one carries "usage": null
                    first["usage"] = None
                await response.write(_sse(first))
            async for out in _chain(head, chunks):
                if out.text or out.finish_reason is not None or ctx.want_logprobs:
                    body = ctx.chunk(out)
                    if include_usage:
                        body["usage"] = None
                    await response.write(_sse(body))
                if out.usage is not None and include_usage:
                    await response.write(_sse(ctx.usage_chunk(out.usage)))
    except ConnectionResetError:  # the client left; generate()'s cleanup aborted the request
        return response
    except InvalidRequest as e:
        await response.write(_sse(invalid_body(e)))
    except BackendError as e:
        await response.write(_sse(_backend_body(e)))
    await response.write(_sse("[DONE]"))
    await response.write_eof()
    return response


async def _chain(
    head: list[OutputChunk], rest: AsyncIterator[OutputChunk]
) -> AsyncIterator[OutputChunk]:
    for item in head:
        yield item
    async for item in rest:
        yield item


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _completions(request, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _completions(request, chat=False)


async def tokenize_route(request: web.Request) -> web.Response:
    """POST /tokenize (vLLM's shape): {tokens, count, max_model_len}."""
    frontend = request.app[FRONTEND_KEY]
    try:
        body = TokenizeBody.model_validate_json(await read_body(request))
        ids = await tokenize(frontend, body.to_spec())
    except BodyTimeout:
        return _body_timeout()
    except ValidationError as e:
        return _bad_request(frontend.reject(invalid_from_validation(e)))
    except InvalidRequest as e:
        return _bad_request(e)
    max_len = frontend.route(body.model).backend.max_model_len
    return _json({"tokens": ids, "count": len(ids), "max_model_len": max_len})


async def detokenize_route(request: web.Request) -> web.Response:
    """POST /detokenize (vLLM's shape): {prompt}."""
    frontend = request.app[FRONTEND_KEY]
    try:
        body = DetokenizeBody.model_validate_json(await read_body(request))
        text = await detokenize(frontend, body.model, body.tokens)
    except BodyTimeout:
        return _body_timeout()
    except ValidationError as e:
        return _bad_request(frontend.reject(invalid_from_validation(e)))
    except InvalidRequest as e:
        return _bad_request(e)
    return _json({"prompt": text})


def _model_card(frontend: Frontend, route: ModelRoute) -> dict[str, Any]:
    return {
        "id": route.model_id,
        "object": "model",
        "created": frontend.created,
        "owned_by": "kvrelay",
        "max_model_len": route.backend.max_model_len,
    }


async def list_models(request: web.Request) -> web.Response:
    frontend = request.app[FRONTEND_KEY]
    models = [_model_card(frontend, route) for route in frontend.routes.values()]
    return _json({"object": "list", "data": models})


async def retrieve_model(request: web.Request) -> web.Response:
    """GET /v1/models/{model}: one served model (OpenAI's retrieve), 404 naming it otherwise."""
    frontend = request.app[FRONTEND_KEY]
    try:
        route = frontend.route(request.match_info["model"])
    except InvalidRequest as e:
        return _json(invalid_body(e), 404)
    return _json(_model_card(frontend, route))


async def live(request: web.Request) -> web.Response:
    """200 while this router answers: a liveness probe's endpoint (a worker's death, an empty
    pool or a drain never fails it; /health and /ready say whether it can serve)."""
    return _json({"live": True}, 200)


async def health(request: web.Request) -> web.Response:
    """200 while a request can be served (a decode worker is ready, the server is not shutting
    down), else 503 with the backend's fields."""
    status = await request.app[FRONTEND_KEY].backend.health()
    return _json(_plain(status), 200 if status.get("ok") else 503)


async def ready(request: web.Request) -> web.Response:
    """/health's answer with the reason and each pool's ready workers; 503 with the reason
    while no request can be served."""
    readiness = await check_readiness(request.app[FRONTEND_KEY].backend)
    body = {"ready": readiness.ready, "reason": readiness.reason, **_plain(readiness.details)}
    return _json(body, 200 if readiness.ready else 503)


def _plain(fields: dict[str, object]) -> dict[str, object]:
    """Health fields as JSON scalars (anything else as its str)."""
    return {k: v if isinstance(v, int | float | str | bool) else str(v) for k, v in fields.items()}


async def metrics(request: web.Request) -> web.Response:
    frontend = request.app[FRONTEND_KEY]
    await frontend.backend.refresh_metrics()
    if frontend.limiter is not None:
        await frontend.limiter.check()
    body = frontend.metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def openapi(request: web.Request) -> web.Response:
    return _json(request.app[OPENAPI_KEY])


def build_app(frontend: Frontend) -> web.Application:
    app = web.Application(
        middlewares=[errors_as_json, api_keys, body_limit],
        client_max_size=frontend.max_body_bytes,
    )
    app[FRONTEND_KEY] = frontend
    app[OPENAPI_KEY] = openapi_document(version())
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model:.+}", retrieve_model)  # an id may hold slashes
    app.router.add_post("/tokenize", tokenize_route)
    app.router.add_post("/detokenize", detokenize_route)
    app.router.add_get("/live", live)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi)
    if tracing.enabled():
        app.on_response_prepare.append(answer_traceparent)
    return app


class HttpServer:
    """The app served on host:port; port 0 picks a free one (see .port after start()).
    With an SSL context it serves HTTPS only."""

    def __init__(self, frontend: Frontend, ssl_context: ssl.SSLContext | None = None):
        self.app = build_app(frontend)
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        self.ssl_context = ssl_context
        self.port = 0

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, ssl_context=self.ssl_context)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self.port

    async def stop(self) -> None:
        await self._runner.cleanup()
