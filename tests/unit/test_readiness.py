"""Readiness from a backend's health: ready exactly when it says ok, with a reason otherwise."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from common.messages import GenerateRequest, TokenDelta
from router.backend import Backend
from router.readiness import check_readiness


class HealthOnly(Backend):
    """A backend that only answers health() (a unit test of one module; no request runs)."""

    model_id, max_model_len, vocab_size = "m", 16, 16

    def __init__(self, status: dict[str, object] | Exception):
        self.status = status

    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        raise NotImplementedError

    async def abort(self, req_id: str) -> None:
        raise NotImplementedError

    async def health(self) -> dict[str, object]:
        if isinstance(self.status, Exception):
            raise self.status
        return self.status


@pytest.mark.parametrize(
    ("status", "ready", "reason"),
    [
        ({"ok": True, "prefill_workers": 1, "decode_workers": 2}, True, "every pool has"),
        ({"ok": False, "prefill_workers": 0, "decode_workers": 1}, False, "in the prefill pool"),
        (
            {"ok": False, "prefill_workers": 0, "decode_workers": 0},
            False,
            "prefill and decode pools",
        ),
        ({"ok": False, "reason": "draining"}, False, "draining"),
        ({"ok": False}, False, "cannot serve"),
        ({}, False, "cannot serve"),
        (ConnectionError("redis gone"), False, "health check failed: redis gone"),
    ],
)
def test_readiness(status: dict[str, object] | Exception, ready: bool, reason: str) -> None:
    got = asyncio.run(check_readiness(HealthOnly(status)))
    assert got.ready is ready and reason in got.reason
    if isinstance(status, dict):
        assert got.details == {k: v for k, v in status.items() if k != "ok"}
