"""Errors the front ends map to protocol statuses (HTTP 400/500, gRPC INVALID_ARGUMENT/INTERNAL)."""

from __future__ import annotations


class InvalidRequest(ValueError):
    """Input the server refuses (HTTP 400 / INVALID_ARGUMENT); names the offending field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class BackendError(RuntimeError):
    """The backend failed while serving a valid request (HTTP 500 / INTERNAL)."""
