"""Request: one sequence's tokens, pending-token count, progress (num_computed_tokens), block
hashes and status, and what it decodes with: its seeded generator, stop checker and grammar
matcher (set by engine/step/output_processor.py)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from engine.finish_reason import FinishReason
from engine.kv_cache.block_pool import DEFAULT_PRIORITY
from engine.kv_cache.retention import RetentionRange
from engine.priority import DEFAULT_LEVEL
from engine.sampling.sampling_params import SamplingParams
from engine.step.stop_checker import StopChecker

if TYPE_CHECKING:  # torch-free at run time
    import torch
    import xgrammar as xgr


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    LOADING_KV = "loading_kv"  # blocks allocated, its prompt's KV being pulled from a peer
    RUNNING = "running"
    FINISHED = "finished"


class PrefilledChoices(NamedTuple):
    """A prefilled parent's choices as its prefill engine left them (engine/step/fork.py): the first
    token of each choice 1..n-1 that goes on decoding (index -> token id), and the finish reason
    of choice 0 when its first token ended it (the parent then only carries the KV)."""

    first_token_ids: dict[int, int]
    parent_finish_reason: FinishReason | None = None


@dataclass(eq=False)
class Request:
    """Mutable state of one request inside an engine. Owned by the scheduler.

    Invariants:
    - all_token_ids holds real tokens only: the prompt, then every sampled token the host has
      read, so len(all_token_ids) == num_prompt_tokens + num_output_tokens and every id is in
      the vocabulary.
    - A token sampled by a step still in flight (overlapped steps) is pending: it is counted in
      num_pending_tokens (0 or 1; one step at most runs ahead) and has no id on the host. It
      occupies the position after all_token_ids; num_tokens (real + pending) is what the
      scheduler and the KV cache allocate positions for. Its id reaches the next step's inputs
      on the device only (step_inputs.TokenFill), and no request has a pending token between two
      Engine.step() calls.
    - block_hashes cover full blocks of all_token_ids only, so no hash ever sees a pending
      token.
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    cache_salt: str | None = None
    retention_priority: int = DEFAULT_PRIORITY
    arrival_time: float = field(default_factory=time.monotonic)
    # Retention by token range (engine/kv_cache/retention.py): its blocks' priorities when freed.
    retention: tuple[RetentionRange, ...] = ()
    # The request ends after its first token and keeps its blocks for the caller until it
    # releases them (Engine.release_blocks): how a prefill worker hands a prompt's KV over.
    keep_blocks: bool = False
    # The prompt's last tokens that an earlier leg generated (a migrated request resumes with its
    # sent tokens as prompt): presence / frequency penalties count them as output.
    num_resumed_tokens: int = 0
    # n > 1 (engine/step/fork.py): choice i > 0 of request choice_of (its outputs carry that id).
    choice_of: str | None = None
    choice_index: int = 0
    # n > 1, its prompt's KV pulled from a peer: the choices to fork once that KV is in.
    prefilled_choices: PrefilledChoices | None = None
    # Scheduling priority (engine/priority.py): higher is admitted first and may preempt lower.
    priority: int = DEFAULT_LEVEL
    # False: its blocks are never looked up nor registered in the prefix cache (no hash, no KV
    # event, no tier copy), and go back uncached: the engine's start-up warm-up.
    cacheable: bool = True

    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_pending_tokens: int = 0  # sampled by a step in flight; their ids are on the device
    block_hashes: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Prompt tokens found in the prefix cache at first admission (None until then); written by
    # the scheduler only.
    num_cached_tokens: int | None = None
    # Waiting for its prefix's disk or shared-store blocks, read behind the step: their hashes
    # (held staged until its next match takes them; engine/kv_cache/block_reads.py).
    pending_load: tuple[int, ...] = ()
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    # Speculative decoding: tokens drafted for the next step (verified there, none is real yet)
    # and how many drafted tokens were verified and accepted so far.
    draft_token_ids: list[int] = field(default_factory=list)
    num_drafted_tokens: int = 0
    num_accepted_tokens: int = 0
    # Misses in a row (no draft found, or none of one accepted) and the token count before which
    # it does not try again (Speculator: a request that does not repeat keeps running ahead).
    num_draft_misses: int = 0
    draft_again_at: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    # While the engine decodes it (OutputProcessor.start .. release): a seeded request's own
    # generator, its text and stop strings, its grammar's matcher (structured outputs).
    generator: torch.Generator | None = None
    stop_checker: StopChecker | None = None
    grammar: xgr.GrammarMatcher | None = None
    # sampling.stop_token_ids as a set, built once: a request may list the whole vocabulary,
    # and its stop check runs on every token it samples
    stop_token_ids: frozenset[int] = field(init=False)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self.stop_token_ids = frozenset(self.sampling.stop_token_ids)

    @property
    def num_tokens(self) -> int:
        """Positions the request spans: its real tokens, then its pending ones."""
        return len(self.all_token_ids) + self.num_pending_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int, logprob: float | None = None) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if logprob is not None:
            self.output_logprobs.append(logprob)
