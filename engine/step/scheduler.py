"""Scheduler: the waiting queue and the running batch; decides which tokens each step computes.

Policy: iteration-level continuous batching under a token budget. Running requests go first
(a decode costs one token, an unfinished prefill a chunk), then waiting requests, both in
priority order (Request.priority, higher first; FCFS within a priority). When blocks run out,
the running request of lowest priority, most recently admitted among those, is preempted: its
blocks are freed (full ones stay in the prefix cache and, inclusive, in the host tier, so its
readmission copies them back instead of recomputing them; only a last partial block is
recomputed) and it returns to the front of its priority in the waiting queue, so it is
readmitted before anything newer of its priority (no starvation within a priority). A waiting
request of higher priority that finds no seat or no blocks preempts running requests of lower
priority the same way, and so does a prefilled request whose KV is to be pulled
(RemoteKVLoader.reserve: preempt_for, between steps). The engine keeps max_model_len <= pool
capacity, so a lone request always fits (no deadlock).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.config import SchedulerConfig
from engine.kv_cache.kept_blocks import Kept
from engine.kv_cache.manager import KVCacheManager
from engine.kv_cache.prefix_cache import NO_MATCH
from engine.step.request import FinishReason, Request, RequestStatus


@dataclass(frozen=True)
class ScheduledChunk:
    """Tokens [start, start + num_new_tokens) of req, computed this step.

    samples is True when the chunk reaches the end of the request's known tokens, so its last
    position's logits yield the next token. draft_token_ids (speculative decoding): tokens
    drafted after the known ones, computed too (the chunk's last len + 1 positions sample).
    """

    req: Request
    start: int
    num_new_tokens: int
    samples: bool
    draft_token_ids: tuple[int, ...] = ()

    @classmethod
    def of(cls, req: Request, num_new_tokens: int) -> ScheduledChunk:
        start = req.num_computed_tokens
        end = start + num_new_tokens
        drafts = tuple(req.draft_token_ids)
        if drafts and end == req.num_tokens + len(drafts):
            return cls(req, start, num_new_tokens, True, drafts)
        return cls(req, start, num_new_tokens, end == req.num_tokens)

    @property
    def is_prompt(self) -> bool:
        """It computes prompt tokens (a prefill chunk), not a decode."""
        return self.start < self.req.num_prompt_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(chunk.num_new_tokens for chunk in self.chunks)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int):
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_priority_preemptions = 0  # of those, for a request of higher priority

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_queued_tokens(self) -> int:
        """Known tokens of the waiting and running requests that are not computed yet."""
        waiting = sum(r.num_tokens - r.num_computed_tokens for r in self.waiting)
        return waiting + sum(r.num_tokens - r.num_computed_tokens for r in self.running)

    def add(self, req: Request) -> None:
        if req.req_id in self.requests:
            raise ValueError(f"request id {req.req_id!r} is already in use")
        self.requests[req.req_id] = req
        self._queue(req, front=False)

    def schedule(self) -> SchedulerOutput:
        """The next step's chunks: running requests first, then waiting ones in priority order
        while budget, seats and blocks last (a waiting request takes a seat or blocks from
        running ones of lower priority, only when preempting them admits it). While a running
        request's last token is in flight (the engine's step run ahead), its blocks are about to
        be freed, or kept (keep_blocks), and it must not be preempted: a request that finds no
        room is then left out of this step instead of preempting others, and nothing waiting is
        admitted."""
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []
        may_preempt: bool | None = None  # decided when a request first finds no room
        starved = False
        idx = 0
        while idx < len(self.running) and budget > 0:
            req = self.running[idx]
            num_new = self._chunk_size(req, budget)
            if num_new == 0:
                idx += 1
                continue
            if req.draft_token_ids and not self.kv.can_allocate(req, num_new):
                num_new -= len(req.draft_token_ids)  # no room to verify drafts: decode plainly
                req.draft_token_ids = []
            while not self.kv.can_allocate(req, num_new):
                if may_preempt is None:
                    may_preempt = not any(self.ends_with_pending(r) for r in self.running)
                if not may_preempt:  # wait a step: the ending request is out of the batch then
                    starved = True
                    idx += 1
                    break
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.req_id)
                if victim is req:
                    break
            else:
                self.kv.allocate(req, num_new)
                chunks.append(ScheduledChunk.of(req, num_new))
                budget -= num_new
                idx += 1
        if not preempted and not starved:
            budget = self._admit_waiting(budget, chunks, preempted)
            if not chunks and self.kv.num_loads_in_flight:  # nothing to run but reads to wait for
                self.kv.wait_loads()
                budget = self._admit_waiting(budget, chunks, preempted)
        for req in self.running:  # the chunks keep this step's drafts; none outlives it
            req.draft_token_ids = []
        return SchedulerOutput(chunks, preempted)

    def _admit_waiting(
        self, budget: int, chunks: list[ScheduledChunk], preempted: list[str]
    ) -> int:
        """Admit waiting requests in order; one whose prefix's disk or shared-store blocks are
        being read behind the step (req.pending_load) waits aside while the others go on."""
        self.kv.poll_loads()
        num_preempted = len(preempted)
        idx = 0
        while idx < len(self.waiting) and budget > 0:
            if len(preempted) > num_preempted:
                break  # a preempted request may have a token in flight: readmitted next step
            req = self.waiting[idx]
            if req.pending_load and not self.kv.load_landed(req):
                idx += 1
                continue
            seated = self._has_seat()
            if not seated and not self.victims_for(req):
                break
            fresh = req.num_computed_tokens == 0
            match = self.kv.match_prefix(req, partial=True) if fresh else NO_MATCH
            if match.pending_hashes:  # its reads run behind the steps; it waits, holding them
                self.kv.wait_for_load(req, match.pending_hashes)
                idx += 1
                continue
            remaining = req.num_tokens - req.num_computed_tokens - match.num_tokens
            num_new = min(remaining, budget)
            if num_new < remaining and not self.config.enable_chunked_prefill:
                break
            # Preempt only what admits it: a seat, then blocks, never victims for nothing.
            victims = [] if seated else self.victims_for(req)[:1]
            if not self.kv.can_allocate(req, num_new, match):
                victims = self.victims_for(req)
                freed = self.kv.num_free_blocks + self.kv.num_freed_by(victims, match)
                if freed < self.kv.num_blocks_needed(req, num_new, match):
                    return budget
            for _ in victims:
                if seated and self.kv.can_allocate(req, num_new, match):
                    break
                self._preempt_lower(req, chunks, preempted)
                seated = True
            budget = self.config.max_num_batched_tokens - sum(c.num_new_tokens for c in chunks)
            self.kv.allocate(req, num_new, match)
            if req.num_cached_tokens is None:
                req.num_cached_tokens = match.num_tokens
            self.waiting.remove(req)  # a preempted request may have been queued before it
            req.status = RequestStatus.RUNNING
            self._insert_running(req)
            chunks.append(ScheduledChunk.of(req, num_new))
            budget -= num_new
        return budget

    def _has_seat(self) -> bool:
        max_num_seqs = self.config.max_num_seqs
        return max_num_seqs is None or len(self.running) < max_num_seqs

    def _preempt_lower(
        self, req: Request, chunks: list[ScheduledChunk], preempted: list[str]
    ) -> bool:
        """Preempt the running request of lowest priority, when lower than req's, dropping its
        chunk of this step; False when there is none (or one running request ends with a token
        in flight: its blocks free themselves next step, as in schedule())."""
        victim = self.preempt_for(req)
        if victim is None:
            return False
        chunks[:] = [chunk for chunk in chunks if chunk.req is not victim]
        preempted.append(victim.req_id)
        return True

    def victims_for(self, req: Request) -> list[Request]:
        """The running requests preempt_for would take for req, in the order it takes them
        (lowest priority, most recently admitted first): those of lower priority than req's;
        none while a running request ends with a token in flight."""
        if any(self.ends_with_pending(r) for r in self.running):
            return []
        victims = []
        for other in reversed(self.running):
            if other.priority >= req.priority:
                break
            victims.append(other)
        return victims

    def preempt_for(self, req: Request) -> Request | None:
        """Preempt the running request of lowest priority, when lower than req's (it returns
        to the front of its priority in the waiting queue, its full blocks cached); the one
        preempted, or None when there is none to take (victims_for)."""
        if not self.victims_for(req):
            return None
        victim = self.running.pop()
        self._preempt(victim)
        self.num_priority_preemptions += 1
        return victim

    def _insert_running(self, req: Request) -> None:
        """After every running request of its priority or higher (running stays ordered)."""
        idx = len(self.running)
        while idx and self.running[idx - 1].priority < req.priority:
            idx -= 1
        self.running.insert(idx, req)

    def _queue(self, req: Request, front: bool) -> None:
        """Into the waiting queue in priority order: at the front of its priority (a preempted
        or readmitted request) or at its back (a new one)."""
        waiting = self.waiting
        if not front and (not waiting or waiting[-1].priority >= req.priority):
            waiting.append(req)  # the common case: every request of one priority
            return
        if front and (not waiting or waiting[0].priority <= req.priority):
            waiting.appendleft(req)
            return
        bound = req.priority + 1 if front else req.priority  # goes before the first below it
        idx = next((i for i, o in enumerate(waiting) if o.priority < bound), len(waiting))
        waiting.insert(idx, req)

    def _chunk_size(self, req: Request, budget: int) -> int:
        if self.ends_with_pending(req):
            return 0  # its last token is in flight (a step run ahead): nothing left to compute
        remaining = req.num_tokens - req.num_computed_tokens
        if req.draft_token_ids:  # verified whole or not at all: drop those the budget lacks
            del req.draft_token_ids[max(0, budget - remaining) :]
            remaining += len(req.draft_token_ids)
        if remaining > budget and not self.config.enable_chunked_prefill:
            return 0
        return min(remaining, budget)

    def ends_with_pending(self, req: Request) -> bool:
        """req has tokens in flight, and with them reaches its end: max_tokens outputs or
        max_model_len positions, or its first token if it keeps its blocks (keep_blocks: it
        finishes with that token). The engine finishes it as it appends them."""
        if not req.num_pending_tokens:
            return False
        num_outputs = req.num_output_tokens + req.num_pending_tokens
        return (
            req.keep_blocks
            or num_outputs >= req.sampling.max_tokens
            or req.num_tokens >= self.max_model_len
        )

    def _preempt(self, req: Request) -> None:
        req.draft_token_ids = []
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.num_preemptions += 1
        self._queue(req, front=True)

    def update(self, output: SchedulerOutput, skip_finished: bool = False) -> None:
        """Record that the scheduled chunks were computed; full blocks enter the prefix cache.

        skip_finished: leave out requests that finished since they were scheduled (overlapped
        steps: the update of a step launched ahead comes after the previous step's tokens)."""
        for chunk in output.chunks:
            if skip_finished and chunk.req.is_finished:
                continue
            # drafted tokens count once accepted (Engine: their KV is then known to be right)
            chunk.req.num_computed_tokens += chunk.num_new_tokens - len(chunk.draft_token_ids)
            self.kv.cache_full_blocks(chunk.req)

    def finish(
        self, req: Request, reason: FinishReason, stop_reason: str | int | None = None
    ) -> Kept | None:
        """Take req out of the batch (or the queue) and free its blocks.

        A keep_blocks request that was not aborted keeps its blocks instead: they are returned
        (kv.release_kept frees them).
        """
        if req.is_finished:
            return None
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
            self.kv.drop_load(req)
        self.kv.cache_full_blocks(req)
        del self.requests[req.req_id]
        if req.keep_blocks and reason is not FinishReason.ABORT:
            return self.kv.keep(req)
        self.kv.free(req)
        return None

    def admit_running(self, req: Request) -> None:
        """Put a request whose KV is already in place straight into the running batch."""
        self.requests[req.req_id] = req
        req.status = RequestStatus.RUNNING
        self._insert_running(req)

    def readmit(self, req: Request) -> None:
        """Queue a known request again at the front of its priority (its KV is recomputed)."""
        self.requests[req.req_id] = req
        req.status = RequestStatus.WAITING
        self._queue(req, front=True)
