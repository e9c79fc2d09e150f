"""The KV handoff as two state machines (torch-free): LeaseLedger owns a prefill worker's leases
on the blocks it holds for decode workers, PullLedger a decode worker's pulls of such blocks.

Prefill (holder):  held -> being read -> released | expired;  held -> released | expired.
Decode (reader):   queued -> reserved -> reading -> committed | failed;  reserved -> committed
(nothing to read: all reused locally) | failed;  queued -> failed (refused);  any live -> aborted.
The tables below are the only legal moves; each is counted, and an illegal one raises
HandoffError. Ended entries leave the ledger, so a ledger holds live entries only.

Epochs: every grant gets a fresh epoch (a 31-bit random nonce per ledger, so per process, over
a 32-bit counter). The KVHandle carries it; every release and notice names (req_id, epoch) and
is ignored, and counted as stale, unless it names the live lease: a late release of a previous
grant cannot free the blocks of a re-prefill of the same req_id.

Being read: just before posting its READ the decode worker sends the holder a BEGIN notice
(KVTransfer.notify; same connection, so it arrives before the READ's own DONE notice, which
NIXL delivers when the READ completes and which releases the lease). On BEGIN the lease moves to
being read and its expiry to min(begin + lease_s, granted + 2 * lease_s): never earlier, never
past the cap. A being-read lease is only ended by DONE, a fenced release (the reader cancelled or
failed its read first) or expiry; the holder's own abort leaves it to those.

Clocks: each side uses only its own time.monotonic(), passed in as `now`. The holder expires
leases on its clock. The reader's deadline for posting a READ is its receipt of the handle plus
(1 - DEADLINE_MARGIN) * lease_s, where the router has already taken off lease_s the time the
handle spent with it (on its own clock); the margin covers the two RPC hops and the BEGIN
notice's trip, so BEGIN reaches the holder before its unextended expiry. A READ must then
end (seen DONE) within lease_s of being posted, which the extended lease covers; one that does
not is cancelled and its prompt recomputed. No clock value ever crosses a host.
"""

from __future__ import annotations

import enum
import secrets
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Generic, NamedTuple, TypeVar

from kvtransfer.base import TransferHandle

MAX_LEASE_FACTOR = 2.0  # a lease being read lives at most this many lease_s after its grant
DEADLINE_MARGIN = 0.1  # of lease_s: the reader posts no READ this close to the lease's end
NONCE_BITS, SERIAL_BITS = 31, 32
NOTICE_TAG = "kvr-handoff"


class HandoffError(RuntimeError):
    """An illegal handoff transition (a bug, or a peer breaking the protocol)."""


class LeaseState(enum.StrEnum):
    HELD = "held"  # granted; no read announced
    BEING_READ = "being_read"  # a BEGIN notice arrived: a READ may be in flight
    RELEASED = "released"
    EXPIRED = "expired"


class PullState(enum.StrEnum):
    QUEUED = "queued"  # handle received; waiting for local blocks (none held here yet)
    RESERVED = "reserved"  # local blocks allocated for the missing part of the prompt
    READING = "reading"  # one NIXL READ in flight into them
    COMMITTED = "committed"  # the KV is in place; the request decodes
    FAILED = "failed"  # not pulled: recomputed locally, or refused
    ABORTED = "aborted"


_L, _P = LeaseState, PullState
LEASE_TRANSITIONS: Mapping[LeaseState | None, frozenset[LeaseState]] = {
    None: frozenset({_L.HELD}),
    _L.HELD: frozenset({_L.BEING_READ, _L.RELEASED, _L.EXPIRED}),
    _L.BEING_READ: frozenset({_L.RELEASED, _L.EXPIRED}),
}
PULL_TRANSITIONS: Mapping[PullState | None, frozenset[PullState]] = {
    None: frozenset({_P.QUEUED}),
    _P.QUEUED: frozenset({_P.RESERVED, _P.FAILED, _P.ABORTED}),
    _P.RESERVED: frozenset({_P.READING, _P.COMMITTED, _P.FAILED, _P.ABORTED}),
    _P.READING: frozenset({_P.COMMITTED, _P.FAILED, _P.ABORTED}),
}
S = TypeVar("S", LeaseState, PullState)
T = TypeVar("T")


class Transition(NamedTuple):
    src: LeaseState | PullState | None  # None: the entry was created
    dst: LeaseState | PullState
    count: int

    @property
    def name(self) -> str:
        return f"{self.src or 'new'}->{self.dst}"


class _Moves(Generic[S]):
    """A transition table and how often each move was made."""

    def __init__(self, table: Mapping[S | None, frozenset[S]]) -> None:
        self.table = table
        self._counts: Counter[tuple[S | None, S]] = Counter()

    def move(self, req_id: str, src: S | None, dst: S) -> None:
        if dst not in self.table.get(src, frozenset()):
            allowed = sorted(self.table.get(src, ())) or "none: it has ended"
            raise HandoffError(
                f"{req_id}: illegal handoff move {src} -> {dst} (from {src}: {allowed})"
            )
        self._counts[src, dst] += 1

    def num(self, src: S | None, dst: S) -> int:
        return self._counts[src, dst]

    def all(self) -> tuple[Transition, ...]:
        return tuple(
            Transition(src, dst, self._counts[src, dst])
            for src, dsts in self.table.items()
            for dst in sorted(dsts)
        )

    def check(self, live: Counter[S]) -> None:
        """Every live entry is in the state the counted moves put it in: nothing in no state."""
        for state in (s for s in self.table if s is not None):
            inflow = sum(n for (_, dst), n in self._counts.items() if dst == state)
            outflow = sum(n for (src, _), n in self._counts.items() if src == state)
            if inflow - outflow != live[state]:
                raise AssertionError(
                    f"{live[state]} entries {state}, but moves put {inflow - outflow} there"
                )


class NoticeKind(enum.StrEnum):
    BEGIN = "begin"  # the reader is about to post its READ (KVTransfer.notify)
    DONE = "done"  # the READ completed (rides on the READ)


class Notice(NamedTuple):
    """A NIXL notification of the handoff, reader -> holder."""

    kind: NoticeKind
    req_id: str
    epoch: int

    def encode(self) -> bytes:
        return f"{NOTICE_TAG} {self.kind} {self.epoch} {self.req_id}".encode()

    @classmethod
    def decode(cls, msg: bytes) -> Notice:
        """Raises ValueError for a message that is not a handoff notice."""
        parts = msg.decode(errors="replace").split(" ", 3)
        if len(parts) != 4 or parts[0] != NOTICE_TAG:
            raise ValueError(f"not a handoff notice: {msg[:80]!r}")
        return cls(NoticeKind(parts[1]), parts[3], int(parts[2]))


@dataclass(frozen=True)
class Lease:
    """One grant of a request's held blocks; times are the holder's time.monotonic()."""

    req_id: str
    epoch: int
    block_ids: tuple[int, ...]
    lease_s: float
    granted_at: float
    expires_at: float
    state: LeaseState = LeaseState.HELD

    @property
    def cap_at(self) -> float:
        return self.granted_at + MAX_LEASE_FACTOR * self.lease_s


class LeaseLedger:
    """The holder's leases (engine thread only).

    Invariants (check_integrity): at most one live lease per req_id, held or being read; epochs
    are never reused; granted_at < expires_at <= cap_at, and a held lease expires at granted_at
    + lease_s; the counted moves account for every live lease's state; given the engine's held
    blocks, each live lease's blocks are exactly what the engine holds for its req_id.
    """

    def __init__(self, nonce: int | None = None) -> None:
        self._nonce = secrets.randbits(NONCE_BITS) if nonce is None else nonce
        self._serial = 0
        self._live: dict[str, Lease] = {}
        self._moves: _Moves[LeaseState] = _Moves(LEASE_TRANSITIONS)
        self.num_stale = 0  # releases and notices that named no live lease (ignored)

    def grant(self, req_id: str, block_ids: Sequence[int], lease_s: float, now: float) -> Lease:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        if req_id in self._live:
            raise HandoffError(f"{req_id}: already leased (epoch {self._live[req_id].epoch})")
        self._moves.move(req_id, None, LeaseState.HELD)
        lease = Lease(req_id, self._new_epoch(), tuple(block_ids), lease_s, now, now + lease_s)
        self._live[req_id] = lease
        return lease

    def begin_read(self, req_id: str, epoch: int, now: float) -> Lease | None:
        """A BEGIN notice: extend the lease to cover the read; None (counted) when stale."""
        lease = self._fenced(req_id, epoch)
        if lease is None:
            return None
        expires_at = min(max(lease.expires_at, now + lease.lease_s), lease.cap_at)
        return self._move(lease, LeaseState.BEING_READ, expires_at=expires_at)

    def release(self, req_id: str, epoch: int) -> Lease | None:
        """A DONE notice or a release call: the lease it ended, or None (counted) when stale."""
        lease = self._fenced(req_id, epoch)
        return None if lease is None else self._end(lease, LeaseState.RELEASED)

    def revoke(self, req_id: str) -> Lease | None:
        """The holder's own abort: ends a held lease; a lease being read is left to its read."""
        lease = self._live.get(req_id)
        if lease is None or lease.state is not LeaseState.HELD:
            return None
        return self._end(lease, LeaseState.RELEASED)

    def expire(self, now: float) -> list[Lease]:
        """End every lease whose expiry is at or before `now` (the holder's monotonic clock)."""
        due = [lease for lease in self._live.values() if lease.expires_at <= now]
        return [self._end(lease, LeaseState.EXPIRED) for lease in due]

    def lease(self, req_id: str) -> Lease | None:
        return self._live.get(req_id)

    @property
    def num_live(self) -> int:
        return len(self._live)

    @property
    def num_expired(self) -> int:
        return sum(self._moves.num(src, LeaseState.EXPIRED) for src in (_L.HELD, _L.BEING_READ))

    def num_blocks(self, state: LeaseState) -> int:
        return sum(len(lease.block_ids) for lease in self._live.values() if lease.state is state)

    def transitions(self) -> tuple[Transition, ...]:
        return self._moves.all()

    def num_stranded(self, held: Mapping[str, Sequence[int]]) -> int:
        """Blocks the engine holds (req_id -> block ids) that no live lease accounts for."""
        return sum(
            len(set(ids) - set(lease.block_ids if (lease := self._live.get(req_id)) else ()))
            for req_id, ids in held.items()
        )

    def check_integrity(self, held: Mapping[str, Sequence[int]] | None = None) -> None:
        epochs = [lease.epoch for lease in self._live.values()]
        assert len(set(epochs)) == len(epochs), "two live leases share an epoch"
        for req_id, lease in self._live.items():
            assert lease.req_id == req_id and lease.state in (_L.HELD, _L.BEING_READ), lease
            assert lease.granted_at < lease.expires_at <= lease.cap_at, lease
            if lease.state is LeaseState.HELD:
                assert lease.expires_at == lease.granted_at + lease.lease_s, lease
            if held is not None:
                assert tuple(held.get(req_id, ())) == lease.block_ids, (
                    f"{req_id}: leased {lease.block_ids}, the engine holds {held.get(req_id)}"
                )
        self._moves.check(Counter(lease.state for lease in self._live.values()))

    def _new_epoch(self) -> int:
        self._serial += 1
        if self._serial >= 1 << SERIAL_BITS:  # a new nonce rather than reuse an epoch
            self._nonce, self._serial = secrets.randbits(NONCE_BITS), 1
        return self._nonce << SERIAL_BITS | self._serial

    def _fenced(self, req_id: str, epoch: int) -> Lease | None:
        lease = self._live.get(req_id)
        if lease is None or lease.epoch != epoch:
            self.num_stale += 1
            return None
        return lease

    def _move(self, lease: Lease, state: LeaseState, **changes: float) -> Lease:
        self._moves.move(lease.req_id, lease.state, state)
        self._live[lease.req_id] = moved = replace(lease, state=state, **changes)
        return moved

    def _end(self, lease: Lease, state: LeaseState) -> Lease:
        self._moves.move(lease.req_id, lease.state, state)
        del self._live[lease.req_id]
        return replace(lease, state=state)


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
        self._moves: _Moves[PullState] = _Moves(PULL_TRANSITIONS)

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
