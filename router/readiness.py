"""Readiness: whether the backend can serve a request now (a decode worker is ready and the
server is not shutting down; with no ready prefill worker the decode workers compute the
prompts), with the reason, as HTTP /ready and gRPC health checking report it. Holds no state."""

from __future__ import annotations

import logging
from typing import NamedTuple

from router.backend import Backend

logger = logging.getLogger(__name__)


class Readiness(NamedTuple):
    ready: bool
    reason: str
    details: dict[str, object]  # the backend's health fields other than "ok"


async def check_readiness(backend: Backend) -> Readiness:
    """Ready exactly when backend.health()["ok"]; a health call that fails is not ready."""
    try:
        status = await backend.health()
    except Exception as e:
        logger.warning("the backend's health check failed: %s", e)
        return Readiness(False, f"the backend's health check failed: {e}", {})
    details = {k: v for k, v in status.items() if k != "ok"}
    if status.get("ok"):
        empty = empty_pools(details)  # the prefill pool: the decode workers compute prompts
        if empty is None:
            return Readiness(True, "every pool has a ready worker", details)
        return Readiness(True, f"{empty}: the decode workers compute the prompts", details)
    return Readiness(False, _reason(details), details)


def _reason(details: dict[str, object]) -> str:
    if isinstance(details.get("reason"), str):
        return str(details["reason"])
    return empty_pools(details) or "the backend reports it cannot serve"


def empty_pools(details: dict[str, object]) -> str | None:
    """Which pools have no ready worker ("no ready worker in the decode pool"), from health
    details that count each pool's ready workers as `{pool}_workers`; None: every pool has one."""
    empty = [
        k.removesuffix("_workers") for k, v in details.items() if k.endswith("_workers") and v == 0
    ]
    if not empty:
        return None
    pools = " and ".join(empty)
    return f"no ready worker in the {pools} pool" + ("s" if len(empty) > 1 else "")
