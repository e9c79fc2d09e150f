"""ChoiceTrackers: one request's output state over its n choices, one OutputTracker per choice
(its own detokenizer, stop strings and finish); the request ends when every choice has ended.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from common.messages import TokenDelta
from common.placement_rules import SloTargets
from router.metrics import RouterMetrics
from router.output import OutputChunk, OutputTracker, Usage
from router.tokenizer import RouterTokenizer

if TYPE_CHECKING:
    from router.request_spec import Prepared


class ChoiceTrackers:
    """Invariant: trackers[i] has seen only deltas with index i; a choice that ended in the
    router (a stop string) drops its later deltas, which the backend still sends until the
    request ends (an abort names the whole request, every choice)."""

    def __init__(
        self,
        tokenizer: RouterTokenizer,
        prepared: Prepared,
        metrics: RouterMetrics,
        objectives: SloTargets | None = None,
    ):
        """objectives: what the request is judged by when it ends (choice 0's timing)."""
        num_choices = prepared.request.sampling.n
        self.arrival, self.metrics = prepared.arrival, metrics
        self.model = prepared.request.model
        self._first_token_seen = False
        self.refused = False  # the backend refused it before any output (Overloaded)
        self.trackers = [
            OutputTracker(tokenizer, prepared, metrics, self._first_token, objectives)
            for _ in range(num_choices)
        ]

    def _first_token(self, now: float) -> None:
        """A choice's first token: the request's time to first token is observed once, at
        the first choice's (n choices counted it n times)."""
        if not self._first_token_seen:
            self._first_token_seen = True
            self.metrics.ttft.labels(model=self.model).observe(now - self.arrival)

    @property
    def finished(self) -> bool:
        """Every choice has its finish reason (the request's last chunk was made)."""
        return all(t.finish_reason is not None for t in self.trackers)

    @property
    def backend_finished(self) -> bool:
        """The backend ended every choice (no abort needed)."""
        return all(t.backend_finished for t in self.trackers)

    def on_delta(self, delta: TokenDelta) -> OutputChunk | None:
        """The chunk of delta's choice (None: that choice had already ended); usage comes on the
        request's last chunk only. Raises BackendError for a failed request."""
        if not 0 <= delta.index < len(self.trackers):
            raise ValueError(
                f"delta for choice {delta.index} of a {len(self.trackers)}-choice request"
            )
        tracker = self.trackers[delta.index]
        if tracker.finish_reason is not None:
            tracker.backend_finished = tracker.backend_finished or delta.finished
            return None
        chunk = tracker.on_delta(delta)
        usage = self.usage() if self.finished else None
        return replace(chunk, index=delta.index, usage=usage)

    def usage(self) -> Usage:
        """The prompt counted once; completion tokens summed over the choices."""
        first = self.trackers[0]
        num_cached = max(t.num_cached_tokens for t in self.trackers)
        num_output = sum(t.num_output_tokens for t in self.trackers)
        accepted = sum(t.usage().speculative_tokens_accepted for t in self.trackers)
        return Usage(first.num_prompt_tokens, num_output, num_cached, accepted)

    def record_end(self) -> None:
        """Once, when the request leaves the router: one request in the metrics (choice 0's
        timing and finish, every choice's tokens); one the backend refused before any output
        (HTTP 503) is counted as refused, not as a finished request."""
        if self.refused:
            self.metrics.unavailable.inc()
            return
        self.trackers[0].record_end(sum(t.num_output_tokens for t in self.trackers))
