"""The cluster's placement rules, as flags set them and the controller hands them to every router:
conditional prefill (LocalPrefill) and the service-level objectives (SloTargets). Frozen values,
no state; router/policy.py and router/slo.py apply them.
"""

from __future__ import annotations

from dataclasses import dataclass

OVERLOAD_MODES = ("queue", "shed", "place")


@dataclass(frozen=True)
class LocalPrefill:
    """Conditional disaggregation: when a decode worker computes a prompt itself instead of
    the prefill pool (the KV transfer and a prefill queue are then skipped).

    max_uncached_tokens: at most this many prompt tokens left to compute on that worker (a
    short prompt, or a long one mostly in its prefix cache); 0 turns the rule off.
    min_cached_fraction: or at least this fraction of the prompt in its cache (a long history
    of a multi-turn chat it served); above 1 turns the rule off.
    on_slo_miss: or whenever the prefill pool is predicted to miss the TTFT objective and the
    decode worker is predicted to meet it (needs SloTargets.ttft_ms).
    chunk_tokens: prompt tokens a decode worker computes per step beside its decodes (what the
    router's prediction of a local prefill's TTFT assumes).
    """

    max_uncached_tokens: int = 0
    min_cached_fraction: float = 2.0
    on_slo_miss: bool = False
    chunk_tokens: int = 256

    def __post_init__(self) -> None:
        if self.max_uncached_tokens < 0:
            raise ValueError(f"max_uncached_tokens must be >= 0, got {self.max_uncached_tokens}")
        if self.min_cached_fraction <= 0:
            raise ValueError(f"min_cached_fraction must be > 0, got {self.min_cached_fraction}")
        if self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {self.chunk_tokens}")

    @property
    def enabled(self) -> bool:
        return self.max_uncached_tokens > 0 or self.min_cached_fraction <= 1.0 or self.on_slo_miss

    def reason(self, num_prompt_tokens: int, num_cached_tokens: int) -> str | None:
        """Why this prompt may be prefilled where `num_cached_tokens` of it are cached
        ("short" / "cached"), or None (on_slo_miss is judged with the predictions)."""
        if num_prompt_tokens - num_cached_tokens <= self.max_uncached_tokens:
            return "short"
        if num_prompt_tokens and num_cached_tokens / num_prompt_tokens >= self.min_cached_fraction:
            return "cached"
        return None


@dataclass(frozen=True)
class SloTargets:
    """Service-level objectives the router places for: time to first token and time per output
    token, in milliseconds (0: no objective).

    overload: what happens to a request no worker is predicted to serve within them:
    "queue" waits in the router for a worker predicted to meet them, at most ttft_ms, then is
    refused (HTTP 503 / gRPC RESOURCE_EXHAUSTED); "shed" is refused at once; "place" is placed
    on the best worker anyway (every objective may then be missed).
    """

    ttft_ms: float = 0.0
    tpot_ms: float = 0.0
    overload: str = "queue"

    def __post_init__(self) -> None:
        if self.ttft_ms < 0 or self.tpot_ms < 0:
            raise ValueError(f"objectives must be >= 0 ms, got {self.ttft_ms}, {self.tpot_ms}")
        if self.overload not in OVERLOAD_MODES:
            raise ValueError(f"overload must be one of {OVERLOAD_MODES}, got {self.overload!r}")

    @property
    def enabled(self) -> bool:
        return self.ttft_ms > 0 or self.tpot_ms > 0
