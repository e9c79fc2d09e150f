"""The values an Engine step deals in: RequestOutput (what a step produced for a request),
InFlightStep (a step queued on the device), EngineStats (step counters), EngineSnapshot (load,
leak counts and counters) and KVMemory (what peers read). Types only; owns no state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from engine.finish_reason import FinishReason
from engine.kv_cache.tier_stats import TierStats
from engine.sampling.sampler import PendingSample, TopLogprobs
from engine.step.request import Request
from engine.step.scheduler import SchedulerOutput
from engine.step.step_rate import StepRate


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request."""

    req_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int
    new_logprobs: list[float] | None = None
    kept_block_ids: tuple[int, ...] = ()  # keep_blocks: the blocks kept (Engine.release_blocks)
    num_kept_host_blocks: int = 0  # of which the first ones are host-tier slots (keep_on_host)
    index: int = 0  # which of the request's n choices (engine/step/fork.py)
    new_top_logprobs: list[TopLogprobs] | None = None  # one per new token, when asked
    num_accepted_tokens: int = 0  # speculative decoding: drafted tokens accepted so far


@dataclass
class InFlightStep:
    """A step queued on the device whose sampled tokens the host has not read yet."""

    scheduled: SchedulerOutput
    reqs: list[Request]  # the requests that sample this step, in row order
    sample: PendingSample
    update_pending: bool  # scheduler.update waits until the step before it has finished
    pending_reqs: list[Request] = field(default_factory=list)  # a pending token each: ran ahead
    # n > 1: the prompt's last logits row of each request whose choices fork off this step.
    fork_logits: dict[str, torch.Tensor] = field(default_factory=dict)
    # Speculative decoding: each verifying request's drafted tokens (its rows: 1 + len).
    drafts: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # perf_counter when its scheduling began: its wall time starts there, or when the step
    # before it was read, whichever is later (Engine.step)
    started_s: float = 0.0


@dataclass
class EngineStats:
    num_steps: int = 0
    num_computed_tokens: int = 0  # tokens run through the model (prefill chunks + decodes)
    num_generated_tokens: int = 0
    num_steps_ahead: int = 0  # steps launched before the previous step's tokens were read
    rate: StepRate = field(default_factory=StepRate)  # recent step times and token rate
    # the same over steps that were mostly prompt tokens (engine.PREFILL_STEP_TOKENS or more):
    # what computing a prompt's block costs (decode steps would make computing look slow)
    prefill_rate: StepRate = field(default_factory=StepRate)
    last_step_s: float = 0.0  # wall time of the latest step (traces report it)


class EngineSnapshot(NamedTuple):
    """An engine's load, leak counts and cumulative counters between two steps
    (Engine.snapshot): all a worker reports of its engine."""

    num_running: int
    num_waiting: int  # queued, or loading their prompt's KV from a peer
    num_requests: int  # known to the engine: queued, running or loading (0 once drained)
    num_free_blocks: int
    num_total_blocks: int
    num_queued_tokens: int  # known tokens of queued and running requests not computed yet
    num_kept_requests: int  # finished requests whose blocks are kept (keep_blocks)
    tokens_per_s: float  # tokens computed per second of recent steps (0: not measured yet)
    step_s: float  # mean wall time of a recent step (0: not measured yet)
    # tokens computed per second of recent steps that were mostly prompt tokens: how fast it
    # computes prompts (0: none yet; an aggregated worker's decode steps would make prompts
    # look slow)
    prompt_tokens_per_s: float
    # Cumulative counters since the engine started.
    num_computed_tokens: int  # tokens run through the model (prefill chunks + decodes)
    # Running requests preempted (short of blocks or seats, or for a higher priority, a waiting
    # or a prefilled one's), and of those for a higher priority.
    num_preemptions: int
    num_priority_preemptions: int
    num_partial_reused_tokens: int  # reused from a partly matching cached block
    num_host_offloaded_blocks: int  # cached blocks given a host-tier slot
    num_host_hit_blocks: int  # prefix blocks copied back from the host tier
    num_spec_verify_steps: int  # request-steps that verified drafted tokens
    num_spec_drafted_tokens: int
    num_spec_accepted_tokens: int
    # The disk tier (zeros without one): blocks written, loaded back on a hit (and their
    # bytes), files found bad at load (recomputed), writes the disk refused, files held now,
    # time spent reading and checking files.
    num_disk_stored_blocks: int = 0
    num_disk_hit_blocks: int = 0
    num_disk_hit_bytes: int = 0
    num_disk_bad_files: int = 0
    num_disk_write_failures: int = 0
    num_disk_cached_blocks: int = 0
    disk_load_s: float = 0.0
    num_disk_reads: int = 0  # files read and checked (hits and bad files)
    tiers: tuple[TierStats, ...] = ()  # each KV tier's size, use, hits and loads (the shared
    # store's figures only here)


class KVMemory(NamedTuple):
    """The memory a peer reads an engine's KV from (Engine.kv_memory): its device KV cache and,
    with host leases, its host tier's storage."""

    device: torch.Tensor
    host: torch.Tensor | None
