"""PullLedger: the reader's side of the KV handoff (kvtransfer/handoff.py has the protocol): it
owns a decode worker's live pulls of blocks a prefill worker holds for it, in the order their
handles arrived, with their local blocks, READs and deadlines, and the counted moves between their
states. Torch-free.

queued -> reserved -> reading -> committed | failed;  reserved -> committed (nothing to read: all
reused locally) | failed;  queued -> failed (refused);  any live -> aborted.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Generic, TypeVar

from kvtransfer.base import TransferHandle
from kvtransfer.handoff import DEADLINE_MARGIN, HandoffError, Moves, Transition


class PullState(enum.StrEnum):
    QUEUED = "queued"  # handle received; waiting for local blocks (none held here yet)
    RESERVED = "reserved"  # local blocks allocated for the missing part of the prompt
    READING = "reading"  # one NIXL READ in flight into them
    COMMITTED = "committed"  # the KV is in place; the request decodes
    FAILED = "failed"  # not pulled: recomputed locally, or refused
    ABORTED = "aborted"


_P = PullState
PULL_TRANSITIONS: Mapping[PullState | None, frozenset[PullState]] = {
    None: frozenset({_P.QUEUED}),
    _P.QUEUED: frozenset({_P.RESERVED, _P.FAILED, _P.ABORTED}),
    _P.RESERVED: frozenset({_P.READING, _P.COMMITTED, _P.FAILED, _P.ABORTED}),
    _P.READING: frozenset({_P.COMMITTED, _P.FAILED, _P.ABORTED}),
}
T = TypeVar("T")


@dataclass(frozen=True)
class Pull(Generic[T]):
    """One handle's pull on the reader; times are the reader's time.monotonic().

    block_ids: the local blocks the READ fills (from reserved on); payload: the caller's own
    record of the request (the ledger never looks at it)."""

    req_id: str
    epoch: int
    lease_s: float
    received_at: float
    payload: T
    state: PullState = PullState.QUEUED
    block_ids: tuple[int, ...] = ()
    xfer: TransferHandle | None = None
    read_started_at: float | None = None

    @property
    def read_by(self) -> float | None:
        """Reading: a READ not seen done by then does not count (the lease may be over)."""
        return None if self.read_started_at is None else self.read_started_at + self.lease_s

    @property
    def deadline(self) -> float:
        """The last moment to post a READ (conservative: the handle's trip is in the margin)."""
        return self.received_at + (1 - DEADLINE_MARGIN) * self.lease_s

    def read_window_open(self, now: float) -> bool:
        return now < self.deadline


class PullLedger(Generic[T]):
    """The reader's pulls (engine thread only), in the order their handles arrived.

    Invariants (check_integrity): one live pull per req_id; a queued pull has no blocks and no
    read, a reserved one no read, a reading one a read and its start; the counted moves
    account for every live pull's state; given the engine's loading requests (req_id -> block
    ids), each reserved or reading pull's blocks are among its request's, and no queued pull's
    request is loading.
    """

    def __init__(self) -> None:
        self._live: dict[str, Pull[T]] = {}
        self._moves: Moves[PullState] = Moves(PULL_TRANSITIONS)

    def queue(
        self, req_id: str, epoch: int, lease_s: float, received_at: float, payload: T
    ) -> Pull[T]:
        if lease_s < 0:
            raise ValueError(f"lease_s must be >= 0, got {lease_s}")
        if req_id in self._live:
            raise HandoffError(f"{req_id}: already being pulled (epoch {self._live[req_id].epoch})")
        self._moves.move(req_id, None, PullState.QUEUED)
        self._live[req_id] = pull = Pull(req_id, epoch, lease_s, received_at, payload)
        return pull

    def reserve(self, req_id: str, block_ids: Sequence[int]) -> Pull[T]:
        return self._move(req_id, PullState.RESERVED, block_ids=tuple(block_ids))

    def start_reading(self, req_id: str, xfer: TransferHandle, now: float) -> Pull[T]:
        pull = self._get(req_id)
        if not pull.read_window_open(now):
            raise HandoffError(f"{req_id}: too late to read (deadline {pull.deadline:.3f})")
        return self._move(req_id, PullState.READING, xfer=xfer, read_started_at=now)

    def commit(self, req_id: str) -> Pull[T]:
        return self._end(req_id, PullState.COMMITTED)

    def fail(self, req_id: str) -> Pull[T]:
        return self._end(req_id, PullState.FAILED)

    def abort(self, req_id: str) -> Pull[T] | None:
        return self._end(req_id, PullState.ABORTED) if req_id in self._live else None

    def pull(self, req_id: str) -> Pull[T] | None:
        return self._live.get(req_id)

    def in_state(self, state: PullState) -> list[Pull[T]]:
        return [pull for pull in self._live.values() if pull.state is state]

    @property
    def num_live(self) -> int:
        return len(self._live)

    def num_blocks(self, state: PullState) -> int:
        return sum(len(pull.block_ids) for pull in self._live.values() if pull.state is state)

    def transitions(self) -> tuple[Transition, ...]:
        return self._moves.all()

    def num_stranded(self, loading: Mapping[str, Sequence[int]]) -> int:
        """Blocks the engine holds for loading requests that no reserved or reading pull
        accounts for."""
        holding = (PullState.RESERVED, PullState.READING)
        return sum(
            len(ids)
            for req_id, ids in loading.items()
            if (pull := self._live.get(req_id)) is None or pull.state not in holding
        )

    def check_integrity(self, loading: Mapping[str, Sequence[int]] | None = None) -> None:
        for req_id, pull in self._live.items():
            assert pull.req_id == req_id, pull
            reading = pull.state is PullState.READING
            assert (pull.xfer is not None) == reading == (pull.read_started_at is not None), pull
            if pull.state is PullState.QUEUED:
                assert not pull.block_ids and (loading is None or req_id not in loading), pull
            elif loading is not None:
                missing = set(pull.block_ids) - set(loading.get(req_id, ()))
                assert req_id in loading and not missing, f"{req_id}: blocks {missing} not held"
        self._moves.check(Counter(pull.state for pull in self._live.values()))

    def _get(self, req_id: str) -> Pull[T]:
        pull = self._live.get(req_id)
        if pull is None:
            raise HandoffError(f"{req_id}: no pull in flight")
        return pull

    def _move(self, req_id: str, state: PullState, **changes: object) -> Pull[T]:
        pull = self._get(req_id)
        self._moves.move(req_id, pull.state, state)
        self._live[req_id] = moved = replace(pull, state=state, **changes)
        return moved

    def _end(self, req_id: str, state: PullState) -> Pull[T]:
        pull = self._get(req_id)
        self._moves.move(req_id, pull.state, state)
        del self._live[req_id]
        return replace(pull, state=state)
