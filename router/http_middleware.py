"""The HTTP front end's aiohttp middlewares and app keys: every failure in OpenAI's error shape,
the body limit (413 naming it, before the body is read), API keys (the tenant goes with the
request), a traced request's traceparent answered; hold no state beyond the app's Frontend."""

from __future__ import annotations

import json
import logging
from typing import Any

from aiohttp import web

from common.tracing import TRACEPARENT
from router.errors import BodyTooLarge, Unauthenticated
from router.frontend import Frontend
from router.openai_format import error_body

logger = logging.getLogger(__name__)

FRONTEND_KEY = web.AppKey("frontend", Frontend)
TENANT_KEY = web.RequestKey("tenant", str)
TRACE_KEY = web.RequestKey("traceparent", str)  # the request's root span (tracing on only)
# Answered without an API key: probes, metrics and the API's description.
OPEN_PATHS = frozenset({"/live", "/health", "/ready", "/metrics", "/openapi.json"})


def json_response(body: dict[str, Any], status: int = 200) -> web.Response:
    return web.json_response(body, status=status, dumps=lambda x: json.dumps(x, ensure_ascii=False))


def too_large(error: BodyTooLarge) -> web.Response:
    body = error_body(error.message, "invalid_request_error", code="request_too_large")
    return json_response(body, 413)


@web.middleware
async def errors_as_json(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every failure answers in OpenAI's error shape (404s and 405s included); a client that
    left mid-request is no server error (logged at debug, as a stream's client leaving is)."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        code = e.reason.lower().replace(" ", "_")  # OpenAI's codes are strings: "not_found"
        response = json_response(error_body(e.reason, "invalid_request_error", code=code), e.status)
        if "Allow" in e.headers:  # a 405 says which methods the path takes
            response.headers["Allow"] = e.headers["Allow"]
        return response
    except ConnectionResetError:  # the client left mid-request (its body, say): no one reads
        logger.debug("client left during %s %s", request.method, request.path)
        response = json_response(error_body("client left", "invalid_request_error"), 400)
        response.force_close()
        return response
    except Exception:
        logger.exception("unhandled error serving %s", request.path)
        return json_response(error_body("internal server error", "internal_error"), 500)


@web.middleware
async def body_limit(request: web.Request, handler: Any) -> web.StreamResponse:
    """A body over the limit gets 413 naming it: at once when Content-Length says so, else when
    reading passes the limit (aiohttp's client_max_size, set to the same number)."""
    frontend = request.app[FRONTEND_KEY]
    limit = frontend.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        frontend.metrics.rejected.inc()
        return too_large(BodyTooLarge(limit, request.content_length))
    try:
        return await handler(request)
    except web.HTTPRequestEntityTooLarge:
        frontend.metrics.rejected.inc()
        return too_large(BodyTooLarge(limit))


@web.middleware
async def api_keys(request: web.Request, handler: Any) -> web.StreamResponse:
    """With API keys configured, the key's tenant goes with the request; no key: 401."""
    frontend = request.app[FRONTEND_KEY]
    if frontend.api_keys is None or request.path in OPEN_PATHS:
        return await handler(request)
    headers = request.headers
    try:
        tenant = frontend.authenticate(headers.get("Authorization"), headers.get("x-api-key"))
    except Unauthenticated as e:
        body = error_body(e.message, "invalid_request_error", code="invalid_api_key")
        response = json_response(body, 401)
        response.headers["WWW-Authenticate"] = 'Bearer realm="kvrelay"'
        return response
    if tenant is not None:
        request[TENANT_KEY] = tenant
    return await handler(request)


async def answer_traceparent(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare, while tracing: a traced request's answer names its root span in a
    W3C traceparent header (streamed or not, error or not)."""
    traceparent = request.get(TRACE_KEY)
    if traceparent is not None:
        response.headers[TRACEPARENT] = traceparent
