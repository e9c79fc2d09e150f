"""KVHandle: where a prefilled prompt's KV blocks live and how long they stay pinned (no state)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVHandle:
    """Returned by a prefill worker; the blocks stay pinned until released or lease_expires_at.

    finish_reason is set when the first token already ends the request (eos, a stop token,
    or max_tokens == 1): no decode is needed and the lease is already released.
    """

    req_id: str
    worker_id: str
    actor_name: str
    agent_name: str
    block_ids: tuple[int, ...]
    num_tokens: int
    first_token_id: int
    protocol_version: int
    lease_expires_at: float  # time.time() on the prefill worker's clock
    num_cached_tokens: int = 0
    first_logprob: float | None = None
    finish_reason: str | None = None
