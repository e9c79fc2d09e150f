"""The KV handoff as two state machines (torch-free); this module holds what both sides share
(the moves' counts, the notices); the holder's leases are in leases.py (LeaseLedger) and
kv_holder.py (KVHolder: the leases over an engine's kept blocks), the reader's pulls in pulls.py
(PullLedger). A prefill worker holds blocks for decode workers, which pull them.

Prefill (holder):  held -> being read -> released | expired;  held -> released | expired.
Decode (reader):   queued -> reserved -> reading -> committed | failed;  reserved -> committed
(nothing to read: all reused locally) | failed;  queued -> failed (refused);  any live -> aborted.
Their tables (LEASE_TRANSITIONS, PULL_TRANSITIONS) are the only legal moves; each is counted
(Moves), and an illegal one raises HandoffError. Ended entries leave the ledger, so a ledger
holds live entries only.

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
from collections import Counter
from collections.abc import Mapping
from typing import Generic, NamedTuple, TypeVar

MAX_LEASE_FACTOR = 2.0  # a lease being read lives at most this many lease_s after its grant
DEADLINE_MARGIN = 0.1  # of lease_s: the reader posts no READ this close to the lease's end
NONCE_BITS, SERIAL_BITS = 31, 32
NOTICE_TAG = "kvr-handoff"
S = TypeVar("S", bound=enum.StrEnum)


class HandoffError(RuntimeError):
    """An illegal handoff transition (a bug, or a peer breaking the protocol)."""


class Transition(NamedTuple):
    src: enum.StrEnum | None  # None: the entry was created
    dst: enum.StrEnum
    count: int

    @property
    def name(self) -> str:
        return f"{self.src or 'new'}->{self.dst}"


class Moves(Generic[S]):
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
