"""Choices of an n > 1 request: ChoiceForks owns each parent's live choice ids, the first tokens
of a prefilled parent's choices until its KV is in, and makes the n - 1 choices of a parent whose
prompt is computed (KV shared, partial block copied).

A request with sampling.n > 1 runs as choice 0 under its own id; once its prompt is computed,
choices 1..n-1 are forked from it: they share its full prompt blocks (one more reference each),
get a device copy of its last partial block, draw their first token from the same prompt logits
(choice i with seed + i when a seed is set) and then decode on their own. Each choice is an
ordinary Request (id `{req_id}#{i}`) whose outputs carry the parent's id and its index.

Across the pools: the prefill engine samples every choice's first token from the prompt's logits
(first_token_choices, for a keep_blocks parent: the choices end there, with no block; only
the parent's blocks are kept); the decode engine forks the choices that go on (fork_prefilled)
once the parent's pulled KV is committed, each with its first token already appended.
"""

from __future__ import annotations

from dataclasses import replace

from engine.finish_reason import FinishReason
from engine.kv_cache.manager import KVCacheManager
from engine.step.request import PrefilledChoices, Request
from engine.step.scheduler import Scheduler


def choice_req_id(req_id: str, index: int) -> str:
    """The engine-internal id of choice `index` (> 0) of request req_id."""
    return f"{req_id}#{index}"


class ChoiceForks:
    """Invariant: every id in _live[parent] names a choice in the scheduler (running or
    waiting); a finished, aborted or preempted-and-finished choice leaves it (discard)."""

    def __init__(self, scheduler: Scheduler, kv: KVCacheManager):
        self.scheduler = scheduler
        self.kv = kv
        self._live: dict[str, list[str]] = {}
        self.num_forked = 0  # choices that shared their parent's prompt KV
        self.num_recomputed = 0  # choices queued to recompute a partial block (no room)

    def owes_choices(self, req: Request) -> bool:
        """req samples its first token now (no output, none pending) and has n - 1 choices to
        fork from its logits."""
        first = req.num_tokens == req.num_prompt_tokens
        return first and req.sampling.n > 1 and req.choice_index == 0

    def fork(self, parent: Request) -> list[Request]:
        """Make and schedule parent's choices 1..n-1 (call before parent's first token is
        appended: they start from its prompt alone)."""
        children = [self._child(parent, i) for i in range(1, parent.sampling.n)]
        self._live[parent.req_id] = [child.req_id for child in children]
        for child in children:
            self._place(parent, child)
        return children

    def first_token_choices(self, parent: Request) -> list[Request]:
        """A keep_blocks parent's choices 1..n-1, unscheduled and with no block: each only
        samples its first token (from the parent's prompt logits) and ends with it."""
        children = [self._child(parent, i) for i in range(1, parent.sampling.n)]
        for child in children:
            child.keep_blocks = True
        return children

    def expect_prefilled(self, parent: Request, choices: PrefilledChoices) -> None:
        """A prefilled parent (choice 0, its first token appended) is loading its prompt KV;
        fork_prefilled makes `choices` (kept on the parent until then) once it is in."""
        bad = [i for i in choices.first_token_ids if not 0 < i < parent.sampling.n]
        if bad:
            raise ValueError(f"choice indexes {bad} are outside [1, n) for n={parent.sampling.n}")
        parent.prefilled_choices = choices

    def fork_prefilled(self, parent: Request) -> tuple[list[Request], FinishReason | None]:
        """A prefilled parent's KV is committed (or queued for recompute): schedule its choices
        that go on, each sharing the prompt's KV (or recomputing it) with its own first token
        appended. Returns them and choice 0's finish reason when it ended at prefill."""
        choices, parent.prefilled_choices = parent.prefilled_choices, None
        if choices is None:
            return [], None
        num_full = parent.num_prompt_tokens // self.kv.block_size
        children = []
        for index, token_id in sorted(choices.first_token_ids.items()):
            child = self._child(parent, index)
            child.block_hashes = child.block_hashes[:num_full]  # the parent's first is not its
            child.append_token(token_id)
            children.append(child)
        if children:
            self._live[parent.req_id] = [child.req_id for child in children]
        for child in children:
            self._place(parent, child)
        return children, choices.parent_finish_reason

    def _child(self, parent: Request, index: int) -> Request:
        params = replace(parent.sampling, n=1)
        if params.seed is not None:
            params = replace(params, seed=params.seed + index)
        child = Request(
            choice_req_id(parent.req_id, index),
            list(parent.prompt_token_ids),
            params,
            parent.cache_salt,
            parent.retention_priority,
            parent.arrival_time,
        )
        child.choice_of, child.choice_index = parent.req_id, index
        child.retention = parent.retention
        child.num_resumed_tokens = parent.num_resumed_tokens
        child.priority = parent.priority
        child.block_hashes = list(parent.block_hashes)
        child.num_cached_tokens = parent.num_cached_tokens
        return child

    def _place(self, parent: Request, child: Request) -> None:
        """Running with the parent's KV when a block (for the partial copy) and a batch slot
        are free; otherwise waiting, to recompute what the prefix cache lacks."""
        num_tokens = parent.num_prompt_tokens
        max_num_seqs = self.scheduler.config.max_num_seqs
        has_slot = max_num_seqs is None or len(self.scheduler.running) < max_num_seqs
        if not (has_slot and self.kv.can_fork(parent.req_id, num_tokens)):
            self.num_recomputed += 1
            self.scheduler.add(child)
            return
        copy = self.kv.fork(parent.req_id, child, num_tokens)
        if copy is not None:  # run with the copies already owed, before the child's first step
            self.kv.owed.queue(copy)
        self.num_forked += 1
        self.scheduler.admit_running(child)

    def live_choices(self, req_id: str) -> list[str]:
        """The internal ids of req_id's choices 1..n-1 still running or waiting."""
        return list(self._live.get(req_id, ()))

    def discard(self, req: Request) -> None:
        """req (a choice) finished or was aborted."""
        if req.choice_of is None:
            return
        live = self._live.get(req.choice_of)
        if live is not None and req.req_id in live:
            live.remove(req.req_id)
            if not live:
                del self._live[req.choice_of]

    @property
    def num_live(self) -> int:
        return sum(len(ids) for ids in self._live.values())
