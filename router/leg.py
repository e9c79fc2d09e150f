"""Leg: where one leg of a request stands in the cluster (one prefill and one decode: the first
leg, or a migration's) and what its workers hold of it; the stage moves forward only along
the allowed transitions, and each stage names the one call that leaves nothing behind when the
leg ends there (cancelled, failed, or finished).
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable
from dataclasses import dataclass

from common.messages import KVHandle, WorkerInfo
from common.worker_actors import DecodeActor, PrefillActor


class LegStage(enum.Enum):
    PREFILL = "prefill"  # being placed or computed on a prefill worker
    HANDED = "handed"  # the prefill worker holds the prompt's KV under a lease for a decoder
    DECODE = "decode"  # a decode worker has the request (its KV pulled, or computed there)
    DONE = "done"  # no worker holds anything of it


class Cleanup(enum.Enum):
    """The call a leg that ends in a stage owes its workers."""

    ABORT_PREFILL = "abort the request on its prefill worker"
    RELEASE_LEASE = "release the prefill worker's lease"
    ABORT_DECODE = "abort the request on its decode worker"
    NOTHING = "nothing"


CLEANUP = {
    LegStage.PREFILL: Cleanup.ABORT_PREFILL,
    LegStage.HANDED: Cleanup.RELEASE_LEASE,
    LegStage.DECODE: Cleanup.ABORT_DECODE,
    LegStage.DONE: Cleanup.NOTHING,
}

ALLOWED = {
    # HANDED: the prompt is computed and a decode must follow; DECODE: computed on the decode
    # worker (conditional prefill); DONE: every choice ended on its first token.
    LegStage.PREFILL: frozenset({LegStage.HANDED, LegStage.DECODE, LegStage.DONE}),
    LegStage.HANDED: frozenset({LegStage.DECODE}),
    # HANDED: the decode worker failed the request and the lease may be unread (releasing it
    # twice is harmless); DONE: it finished, or failed with no lease behind it.
    LegStage.DECODE: frozenset({LegStage.HANDED, LegStage.DONE}),
    LegStage.DONE: frozenset(),
}


class IllegalMove(RuntimeError):
    """A leg asked to move along a transition that is not allowed (a bug in the caller)."""


@dataclass
class Leg:
    """Invariants: `stage` only changed through move(); HANDED has its prefill actor and
    handle; DECODE has its decode worker and actor."""

    req_id: str
    stage: LegStage = LegStage.PREFILL
    prefill_actor: PrefillActor | None = None  # set while a prefill worker is being asked
    handle: KVHandle | None = None  # the prefill worker's answer (None: computed locally)
    decode: WorkerInfo | None = None
    decode_actor: DecodeActor | None = None
    # prompt tokens the decode worker computes itself, counted as placed there (the router's
    # view of its queue) until the first token says they are done
    prompt_tokens: int = 0

    def move(self, stage: LegStage) -> None:
        if stage not in ALLOWED[self.stage]:
            raise IllegalMove(f"leg {self.req_id}: {self.stage.value} -> {stage.value}")
        self.stage = stage

    def prefilled(self, handle: KVHandle) -> None:
        """The prefill worker asked (prefill_actor) answered: a decode follows (HANDED) unless
        every choice ended on its first token."""
        assert self.prefill_actor is not None
        self.handle = handle
        self.move(LegStage.HANDED if handle.needs_decode else LegStage.DONE)

    def decoding(self, decode: WorkerInfo, actor: DecodeActor, prompt_tokens: int = 0) -> None:
        """A decode worker took the request (handed over, or to compute its prompt_tokens
        there)."""
        self.decode, self.decode_actor, self.prompt_tokens = decode, actor, prompt_tokens
        self.move(LegStage.DECODE)

    def take_prompt_tokens(self) -> int:
        """The prompt tokens still counted as placed on the decode worker, now counted off."""
        num, self.prompt_tokens = self.prompt_tokens, 0
        return num

    def decode_failed(self) -> None:
        """The decode worker failed the request: nothing is left there, but a lease may be."""
        self.move(LegStage.HANDED if self.handle is not None else LegStage.DONE)

    @property
    def cleanup(self) -> Cleanup:
        return CLEANUP[self.stage]

    def cleanup_call(self) -> Awaitable[object] | None:
        """Start the call this stage owes its workers (None: nothing is owed, or the prefill
        worker was never reached)."""
        cleanup = self.cleanup
        if cleanup is Cleanup.ABORT_PREFILL and self.prefill_actor is not None:
            return self.prefill_actor.abort.remote(self.req_id)
        if cleanup is Cleanup.RELEASE_LEASE:
            assert self.prefill_actor is not None and self.handle is not None
            assert self.handle.epoch is not None  # a lease is held while a decode must follow
            return self.prefill_actor.release.remote(self.req_id, self.handle.epoch)
        if cleanup is Cleanup.ABORT_DECODE:
            assert self.decode_actor is not None
            return self.decode_actor.abort.remote(self.req_id)
        return None
