"""Errors the front ends map to protocol statuses (HTTP 400/401/413/429/500/503, gRPC
INVALID_ARGUMENT, UNAUTHENTICATED, INTERNAL, RESOURCE_EXHAUSTED, UNAVAILABLE); they hold only
their message."""

from __future__ import annotations


class InvalidRequest(ValueError):
    """Input the server refuses (HTTP 400 / INVALID_ARGUMENT); names the offending field, in
    `param` and in the message (prefixed with it where the message does not name it)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        if param and param not in message:
            message = f"{param}: {message}"
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class BodyTooLarge(ValueError):
    """A request body over the router's limit (HTTP 413); refused before it is read whole."""

    def __init__(self, max_body_bytes: int, num_bytes: int | None = None):
        size = "" if num_bytes is None else f" ({num_bytes} bytes)"
        self.message = (
            f"the request body{size} is larger than this server's limit of {max_body_bytes} "
            f"bytes ({max_body_bytes / 2**20:g} MiB, set by --max-body-mib)"
        )
        super().__init__(self.message)


class BackendError(RuntimeError):
    """The backend failed while serving a valid request (HTTP 500 / INTERNAL)."""


class BackendUnavailable(BackendError):
    """The request's worker was lost and no other could take it on (HTTP 503 + Retry-After /
    UNAVAILABLE; in an open stream an error event of type "unavailable"): the client may retry."""


class Unauthenticated(PermissionError):
    """A missing or unknown API key (HTTP 401 / UNAUTHENTICATED); its message never holds the
    key."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class Overloaded(RuntimeError):
    """The router already holds its bound of requests (HTTP 503 + Retry-After /
    RESOURCE_EXHAUSTED, error code "overloaded"); refused at once, before the backend sees it.
    A subclass may carry another code and no Retry-After (None)."""

    code = "overloaded"
    http_status = 503

    def __init__(self, max_requests: int, retry_after_s: int):
        self.max_requests = max_requests
        self.retry_after_s: int | None = retry_after_s
        self.message = (
            f"the router is at its limit of {max_requests} requests in flight or queued; "
            f"retry in {retry_after_s} s"
        )
        super().__init__(self.message)


class SloUnmet(Overloaded):
    """No worker is predicted to serve the request within the cluster's objectives (router/slo.py):
    refused before anything is sent (HTTP 503 + Retry-After / RESOURCE_EXHAUSTED)."""

    def __init__(self, message: str, retry_after_s: int = 1):
        RuntimeError.__init__(self, message)
        self.max_requests = 0
        self.retry_after_s = retry_after_s
        self.message = message


class RateLimited(Overloaded):
    """A tenant's per-key limit refused the request (router/rate_limits.py): HTTP 429 +
    Retry-After / RESOURCE_EXHAUSTED with retry-after in the trailing metadata. `limit` names it
    (rps, tpm, streams); retry_after_s None: no wait will do (more tokens than the limit)."""

    code = "rate_limit_exceeded"
    http_status = 429

    def __init__(self, message: str, limit: str, retry_after_s: int | None):
        RuntimeError.__init__(self, message)
        self.max_requests = 0
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.message = message
