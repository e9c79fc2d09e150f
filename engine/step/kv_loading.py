"""RemoteKVLoader: owns the requests whose prompt KV is being pulled from a peer.

Life cycle: reserve() allocates local blocks (reusing the local prefix cache, so only missing
blocks are pulled; preempting running requests of lower priority when that makes room, between
steps only: their KV stays cached and in the host tier, and they resume from there like any
preempted request) -> the caller moves the KV -> commit() puts the request in the running batch,
or fail() queues it for local recompute. abort() frees the blocks at any point.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engine.kv_cache.manager import KVCacheManager, cdiv
from engine.kv_cache.prefix_cache import PrefixMatch
from engine.step.request import FinishReason, Request, RequestStatus
from engine.step.scheduler import Scheduler


@dataclass(frozen=True)
class KVLoadPlan:
    """Which local blocks to fill: remote prompt blocks [first_block, first_block + n) go to
    local_block_ids (n = len(local_block_ids)); blocks before first_block are reused locally.

    num_cached_tokens here is the decode side's own reuse (it only shortens the pull); the
    request's cached tokens are the prefill engine's, reported in its KVHandle."""

    req_id: str
    local_block_ids: tuple[int, ...]
    first_block: int
    num_cached_tokens: int


class RemoteKVLoader:
    def __init__(self, scheduler: Scheduler, kv: KVCacheManager, between_steps: Callable[[], bool]):
        """between_steps: True when no step is in flight, so a running request may be
        preempted now (RunAhead.between_steps; False asks for a pause after the next step)."""
        self.scheduler = scheduler
        self.kv = kv
        self.between_steps = between_steps
        self.loading: dict[str, Request] = {}
        self.num_preemptions = 0  # running requests preempted for a loading one's blocks

    def reserve(self, req: Request) -> KVLoadPlan | None:
        """Allocate blocks for req's prompt; None when the pool cannot hold it now, even with
        the blocks of the running requests of lower priority (preempted for it when they make
        room, as the scheduler does for a waiting request: Scheduler.preempt_for)."""
        match = self.kv.match_prefix(req)
        num_missing = req.num_prompt_tokens - match.num_tokens
        fits = self.kv.can_allocate(req, num_missing, match)
        if not fits and not self._make_room(req, num_missing, match):
            return None
        self.kv.allocate(req, num_missing, match)
        req.status = RequestStatus.LOADING_KV
        self.loading[req.req_id] = req
        num_prompt_blocks = cdiv(req.num_prompt_tokens, self.kv.block_size)
        num_local = match.num_tokens // self.kv.block_size  # on the device or copied back to it
        block_ids = self.kv.block_ids(req.req_id)[num_local:num_prompt_blocks]
        return KVLoadPlan(req.req_id, tuple(block_ids), num_local, match.num_tokens)

    def _make_room(self, req: Request, num_missing: int, match: PrefixMatch) -> bool:
        """Preempt running requests of lower priority than req until its blocks fit; False
        (none preempted) when even all of them would not make room, or a step is in flight."""
        victims = self.scheduler.victims_for(req)
        if not victims:
            return False
        need = self.kv.num_blocks_needed(req, num_missing, match)
        if self.kv.num_free_blocks + self.kv.num_freed_by(victims, match) < need:
            return False
        if not self.between_steps():  # its chunks would land on blocks given to req
            return False
        while not self.kv.can_allocate(req, num_missing, match):
            if self.scheduler.preempt_for(req) is None:
                return False
            self.num_preemptions += 1
        return True

    def commit(self, req_id: str) -> None:
        """The pulled KV is in place: the request joins the running batch."""
        req = self.loading.pop(req_id)
        req.num_computed_tokens = req.num_prompt_tokens
        self.kv.cache_full_blocks(req)
        self.scheduler.admit_running(req)

    def fail(self, req_id: str) -> None:
        """The pull failed: free the blocks and recompute the prompt locally."""
        req = self.loading.pop(req_id)
        self.kv.free(req)
        req.num_computed_tokens = 0
        self.scheduler.readmit(req)

    def abort(self, req_id: str) -> Request | None:
        """Free the blocks of req_id if it is loading; returns it (None: it was not)."""
        req = self.loading.pop(req_id, None)
        if req is None:
            return None
        self.kv.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = FinishReason.ABORT
        return req
