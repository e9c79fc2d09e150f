"""Values that cross the router's boundaries (front ends <-> backend <-> workers); no state.

Every type here is a frozen dataclass and torch-free, so Ray can pickle it and the router can
import it without pulling in the engine's model code.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class GenerateRequest:
    """A validated, tokenized request. Stop strings stay in the router (it detokenizes);
    the workers see `sampling` with stop=() and only stop token ids."""

    req_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    cache_salt: str | None = None
    arrival_time: float = 0.0


@dataclass(frozen=True)
class TokenDelta:
    """New tokens of one request from one engine step (the backend's streaming unit)."""

    req_id: str
    token_ids: tuple[int, ...]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: tuple[float, ...] = ()
    error: str | None = None  # set with finish_reason "error": why the request failed
    # KV transfer of this request (set on the decode worker's first delta only).
    num_transferred_blocks: int = 0
    transfer_bytes: int = 0
    transfer_s: float = 0.0
    recomputed: bool = False  # the pull failed or was refused: the decode worker recomputed


@dataclass(frozen=True)
class WorkerLoad:
    """A worker's load as published to Redis and used by placement."""

    running: int = 0
    waiting: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    queued_tokens: int = 0


@dataclass(frozen=True)
class WorkerInfo:
    """A live worker as the router sees it (from Redis membership or the local registry)."""

    worker_id: str
    role: str  # "prefill" | "decode"
    actor_name: str = ""
    nixl_agent: str = ""
    load: WorkerLoad = field(default_factory=WorkerLoad)


@dataclass(frozen=True)
class ServedModel:
    """What a worker serves, as the router needs it (the router loads only the tokenizer)."""

    model_id: str
    checkpoint_dir: str
    max_model_len: int
    vocab_size: int
    block_size: int


class Backend(abc.ABC):
    """What the front ends call; the cluster backend routes to Ray workers.

    Invariant: generate() yields deltas in order and ends after exactly one delta with
    finished=True; cancelling the iterator (client gone) aborts the request everywhere.
    """

    model_id: str
    max_model_len: int
    vocab_size: int

    @abc.abstractmethod
    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        """Stream the request's tokens."""

    @abc.abstractmethod
    async def abort(self, req_id: str) -> None:
        """Stop a request and free its blocks on every worker (no-op if unknown)."""

    @abc.abstractmethod
    async def health(self) -> dict[str, object]:
        """Liveness summary: {"ok": bool, ...details}."""
