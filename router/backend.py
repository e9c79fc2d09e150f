"""Backend: what the router's front ends call to run a request (an ABC; holds no state)."""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator

from common.messages import GenerateRequest, TokenDelta
from common.placement_rules import SloTargets
from engine.sampling.validation import MAX_N


class Backend(abc.ABC):
    """What the front ends call; the cluster backend routes to Ray workers.

    Invariant: generate() yields deltas in order and ends after exactly one delta with
    finished=True per choice (n > 1: deltas name their choice in `index`; a delta with
    FinishReason.ERROR ends the whole request); cancelling the iterator (client gone) aborts
    the request everywhere.
    """

    model_id: str
    max_model_len: int
    vocab_size: int
    max_choices: int = MAX_N  # the largest n it serves (a larger n is refused, naming `n`)

    @abc.abstractmethod
    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        """Stream the request's tokens."""

    @abc.abstractmethod
    async def abort(self, req_id: str) -> None:
        """Stop a request and free its blocks on every worker (no-op if unknown)."""

    @abc.abstractmethod
    async def health(self) -> dict[str, object]:
        """Liveness summary: {"ok": bool, ...details}."""

    async def refresh_metrics(self) -> None:  # noqa: B027 - a hook; most backends need none
        """Before a /metrics scrape: fetch what the metrics take from elsewhere (workers)."""

    def objectives(self, model: str) -> SloTargets:
        """The objectives a model's requests are placed for (and judged by, in /metrics'
        kvrelay_slo_requests); none unless the backend places for some."""
        return SloTargets()
