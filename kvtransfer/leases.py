"""LeaseLedger: the holder's side of the KV handoff (kvtransfer/handoff.py has the protocol): it
owns a prefill worker's live leases on the blocks its engine keeps for decode workers, their
epochs and expiries, and the counted moves between their states. Torch-free.

held -> being read -> released | expired;  held -> released | expired.
"""

from __future__ import annotations

import enum
import secrets
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from kvtransfer.handoff import (
    MAX_LEASE_FACTOR,
    NONCE_BITS,
    SERIAL_BITS,
    HandoffError,
    Moves,
    Transition,
)


class LeaseState(enum.StrEnum):
    HELD = "held"  # granted; no read announced
    BEING_READ = "being_read"  # a BEGIN notice arrived: a READ may be in flight
    RELEASED = "released"
    EXPIRED = "expired"


_L = LeaseState
LEASE_TRANSITIONS: Mapping[LeaseState | None, frozenset[LeaseState]] = {
    None: frozenset({_L.HELD}),
    _L.HELD: frozenset({_L.BEING_READ, _L.RELEASED, _L.EXPIRED}),
    _L.BEING_READ: frozenset({_L.RELEASED, _L.EXPIRED}),
}


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
    + lease_s; the counted moves account for every live lease's state; given the engine's kept
    blocks, each live lease's blocks are exactly what the engine keeps for its req_id.
    """

    def __init__(self, nonce: int | None = None) -> None:
        self._nonce = secrets.randbits(NONCE_BITS) if nonce is None else nonce
        self._serial = 0
        self._live: dict[str, Lease] = {}
        self._moves: Moves[LeaseState] = Moves(LEASE_TRANSITIONS)
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

    def num_stranded(self, kept: Mapping[str, Sequence[int]]) -> int:
        """Blocks the engine keeps (req_id -> block ids) that no live lease accounts for."""
        return sum(
            len(set(ids) - set(lease.block_ids if (lease := self._live.get(req_id)) else ()))
            for req_id, ids in kept.items()
        )

    def check_integrity(self, kept: Mapping[str, Sequence[int]] | None = None) -> None:
        epochs = [lease.epoch for lease in self._live.values()]
        assert len(set(epochs)) == len(epochs), "two live leases share an epoch"
        for req_id, lease in self._live.items():
            assert lease.req_id == req_id and lease.state in (_L.HELD, _L.BEING_READ), lease
            assert lease.granted_at < lease.expires_at <= lease.cap_at, lease
            if lease.state is LeaseState.HELD:
                assert lease.expires_at == lease.granted_at + lease.lease_s, lease
            if kept is not None:
                assert tuple(kept.get(req_id, ())) == lease.block_ids, (
                    f"{req_id}: leased {lease.block_ids}, the engine keeps {kept.get(req_id)}"
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
