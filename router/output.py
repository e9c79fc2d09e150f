"""OutputTracker: one request's output state in the router (detokenizer, stop strings, token
counts, timing) turning TokenDeltas into OutputChunks; records its metrics when it ends.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.messages import TokenDelta, TopLogprobs
from common.placement_rules import SloTargets
from engine.finish_reason import FinishReason
from router.errors import BackendError, BackendUnavailable
from router.metrics import RouterMetrics
from router.tokenizer import RouterTokenizer, StopChecker

if TYPE_CHECKING:
    from router.request_spec import Prepared


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from a prefix cache
    speculative_tokens_accepted: int = 0  # completion tokens that were drafted and verified

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class OutputChunk:
    """New output of one request: tokens and the text they completed (maybe empty)."""

    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[float, ...] = ()
    finish_reason: FinishReason | None = None  # on the choice's last chunk (never ERROR)
    usage: Usage | None = None  # on the last chunk
    top_logprobs: tuple[TopLogprobs, ...] = ()  # one per token, when asked
    index: int = 0  # which of the request's n choices (finish_reason: that choice's end)


class OutputTracker:
    def __init__(
        self,
        tokenizer: RouterTokenizer,
        prepared: Prepared,
        metrics: RouterMetrics,
        first_token: Callable[[float], None] | None = None,
        objectives: SloTargets | None = None,
    ):
        """first_token: called with the time of this tracker's first token (None: it observes
        the request's time to first token itself). objectives: what the request is judged by
        when it ends (RouterMetrics.observe_objectives; None: none)."""
        self.first_token = first_token or self._observe_ttft
        self.stop = StopChecker(tokenizer, prepared.stop)
        self.metrics = metrics
        self.arrival = prepared.arrival
        self.model = prepared.request.model
        self.traffic_class = prepared.key_class.kind.value
        # a batch request with deadline_s is placed without the objectives: not judged by them
        placed_for = prepared.request.deadline_s is None
        self.objectives = (objectives if placed_for else None) or SloTargets()
        self.num_prompt_tokens = len(prepared.request.prompt_token_ids)
        self.num_cached_tokens = 0
        self.num_accepted_tokens = 0  # speculative decoding, as the worker counts it
        self.num_output_tokens = 0
        self.finish_reason: FinishReason | None = None
        self.backend_finished = False  # the backend ended the request (no abort needed)
        self._first_token_time: float | None = None
        self._last_token_time: float | None = None

    def on_delta(self, delta: TokenDelta) -> OutputChunk:
        """Consume one backend delta; raise BackendError for a failed request."""
        if delta.finished:
            self.backend_finished = True
        if delta.finish_reason == FinishReason.ERROR:
            self.finish_reason = FinishReason.ERROR
            error = BackendUnavailable if delta.unavailable else BackendError
            raise error(delta.error or "the backend failed the request")
        self._observe_timing(len(delta.token_ids))
        self.num_prompt_tokens = delta.num_prompt_tokens or self.num_prompt_tokens
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        self.num_accepted_tokens = max(self.num_accepted_tokens, delta.num_accepted_tokens)
        token_ids: list[int] = []
        text = ""
        for token_id in delta.token_ids:
            token_ids.append(token_id)
            text += self.stop.add(token_id)
            if self.stop.matched is not None:
                self.finish_reason = FinishReason.STOP
                break
        self.num_output_tokens += len(token_ids)
        if self.finish_reason is None and delta.finished:
            text += self.stop.finish()
            self.finish_reason = delta.finish_reason or FinishReason.STOP
        logprobs = tuple(delta.logprobs[: len(token_ids)])
        top = tuple(delta.top_logprobs[: len(token_ids)])
        if self.finish_reason is None:
            return OutputChunk(tuple(token_ids), text, logprobs, top_logprobs=top)
        return OutputChunk(
            tuple(token_ids), text, logprobs, self.finish_reason, self.usage(), top_logprobs=top
        )

    def usage(self) -> Usage:
        accepted = min(self.num_accepted_tokens, self.num_output_tokens)
        num_prompt, num_output = self.num_prompt_tokens, self.num_output_tokens
        return Usage(num_prompt, num_output, self.num_cached_tokens, accepted)

    def _observe_timing(self, num_tokens: int) -> None:
        if not num_tokens:
            return
        self.metrics.observe_streamed(num_tokens)
        now = time.monotonic()
        if self._last_token_time is None:
            self._first_token_time = now
            self.first_token(now)
        else:
            gap = (now - self._last_token_time) / num_tokens
            itl = self.metrics.itl.labels(model=self.model)
            for _ in range(num_tokens):
                itl.observe(gap)
        self._last_token_time = now

    def _observe_ttft(self, now: float) -> None:
        self.metrics.ttft.labels(model=self.model).observe(now - self.arrival)

    def record_end(self, num_output_tokens: int | None = None) -> None:
        """Called once when the request leaves the router, however it ended; one that finished
        with output joins the recent latencies the objectives are judged on.
        num_output_tokens: the request's total over its choices (None: this tracker's)."""
        first, last = self._first_token_time, self._last_token_time
        ended_well = self.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        if ended_well and first is not None and last is not None:
            n = self.num_output_tokens
            tpot_s = (last - first) / (n - 1) if n > 1 else None
            self.metrics.recent.record(time.monotonic(), first - self.arrival, tpot_s)
            if self.metrics.per_model:
                recent = self.metrics.recent_of(self.model)
                recent.record(time.monotonic(), first - self.arrival, tpot_s)
            self.metrics.observe_objectives(
                self.objectives, first - self.arrival, tpot_s, self.model, self.traffic_class
            )
        self.metrics.observe_finished(
            self.finish_reason or FinishReason.ABORT,
            self.num_prompt_tokens,
            self.num_cached_tokens,
            self.num_output_tokens if num_output_tokens is None else num_output_tokens,
            time.monotonic() - self.arrival,
            self.model,
        )
