"""HostTier: the bookkeeping of a worker's host-memory KV tier (the second tier of the prefix
cache). It owns which host slot holds which block hash, each slot's retention priority (and
until when a priority held for a while holds), the eviction order (priority, then LRU) and the
slots lent out to a copy not yet queued; the bytes live in the engine's host tensor. Pure
Python, torch-free.

The tiers are inclusive: a block committed to the device's prefix cache gets a slot here at
once and is copied in behind the step (engine/kv_cache/write_behind.py), so a device eviction
costs no copy; a prefix hit here is copied back into a fresh device block and stays here.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence

from engine.kv_cache.block_pool import BlockRemoved, BlockStored, KVEvent
from engine.kv_cache.expiry import Expiries, Held


class HostTier:
    def __init__(
        self,
        num_slots: int,
        record_events: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.num_slots = num_slots
        self.record_events = record_events  # KV events (tier "host") for the cluster index
        self._events: list[KVEvent] = []
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() takes slot 0 first
        self._by_priority: dict[int, OrderedDict[int, int]] = {}  # priority -> hash -> slot
        self._slot_of: dict[int, tuple[int, int]] = {}  # hash -> (slot, priority)
        self._lent: Counter[int] = Counter()  # slots a copy still to be queued reads or writes
        self.expiries: Expiries[int] = Expiries(clock)  # hashes whose priority holds a while
        self.num_stored = 0  # blocks given a slot (copied in from the device)
        self.num_taken = 0  # blocks copied back to the device on a prefix hit
        self.num_dropped = 0  # evicted from this tier (or not stored: every slot lent)
        # (hash, slot, priority, until when it holds) of a block evicted here, before its slot
        # is given again: the disk tier's spill (OwedCopies)
        self.on_evict: Callable[[int, int, int, Held | None], None] | None = None

    @property
    def num_cached(self) -> int:
        return len(self._slot_of)

    def has(self, block_hash: int) -> bool:
        return block_hash in self._slot_of

    def cached_hashes(self) -> list[int]:
        return list(self._slot_of)

    def entries(self) -> list[tuple[int, int, int, Held | None]]:
        """(hash, slot, priority, until when it holds) of every block here."""
        held = self.expiries.held
        return [(h, slot, priority, held(h)) for h, (slot, priority) in self._slot_of.items()]

    def drain_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def store(self, block_hash: int, priority: int, held: Held | None = None) -> int | None:
        """A slot for a block's copy (lent until release); None when the hash is here already
        or every slot is lent. May evict the lowest-priority, oldest block. held: priority
        holds until held.until, then ranks as held.then."""
        if block_hash in self._slot_of:
            return None
        slot = self._free.pop() if self._free else self._evict()
        if slot is None:
            self.num_dropped += 1
            return None
        self._rank(block_hash, slot, priority, held)
        self._lent[slot] += 1
        self.num_stored += 1
        if self.record_events:
            self._events.append(BlockStored((block_hash,), None, "host"))
        return slot

    def lend(self, block_hash: int) -> int:
        """A hit: its slot, lent until its copy back is queued, and now the most recent."""
        slot, priority = self._slot_of[block_hash]
        self._by_priority[priority].move_to_end(block_hash)
        self._lent[slot] += 1
        self.num_taken += 1
        return slot

    def pin(self, block_hash: int) -> int:
        """A kept request's pin on a block's copy here: its slot, lent until release."""
        slot, _ = self._slot_of[block_hash]
        self._lent[slot] += 1
        return slot

    def refresh(self, block_hash: int, priority: int, held: Held | None = None) -> None:
        """The block left the device: here it now ranks by the priority it had there (held for
        as long as it held there), newest."""
        slot, old = self._slot_of[block_hash]
        del self._by_priority[old][block_hash]
        self.expiries.cancel(block_hash)
        self._rank(block_hash, slot, priority, held)

    def _rank(self, block_hash: int, slot: int, priority: int, held: Held | None) -> None:
        self._slot_of[block_hash] = (slot, priority)
        self._by_priority.setdefault(priority, OrderedDict())[block_hash] = slot
        if held is not None and held.then != priority:
            self.expiries.hold(block_hash, held)

    def drop(self, block_hashes: Sequence[int]) -> int:
        """Forget these blocks (an operator's eviction), but those whose slot a copy still uses
        (lent: they stay until evicted). Returns how many were dropped."""
        num = 0
        for block_hash in set(block_hashes):
            if block_hash not in self._slot_of:
                continue
            slot, priority = self._slot_of[block_hash]
            if slot in self._lent:
                continue
            del self._slot_of[block_hash]
            del self._by_priority[priority][block_hash]
            self.expiries.cancel(block_hash)
            self._free.append(slot)
            num += 1
            if self.record_events:
                self._events.append(BlockRemoved((block_hash,), "host"))
        return num

    def release(self, slot: int) -> None:
        """The copy using a lent slot is queued (stream order protects it from then on)."""
        self._lent[slot] -= 1
        if not self._lent[slot]:
            del self._lent[slot]

    def _evict(self) -> int | None:
        for block_hash, fallback in self.expiries.due():  # ranked by what they fall back to
            slot, priority = self._slot_of[block_hash]
            del self._by_priority[priority][block_hash]
            self._rank(block_hash, slot, fallback, None)
        for priority in sorted(self._by_priority):
            bucket = self._by_priority[priority]
            for block_hash, slot in bucket.items():
                if slot in self._lent:
                    continue
                del bucket[block_hash]
                del self._slot_of[block_hash]
                held = self.expiries.cancel(block_hash)
                self.num_dropped += 1
                if self.on_evict is not None:
                    self.on_evict(block_hash, slot, priority, held)
                if self.record_events:
                    self._events.append(BlockRemoved((block_hash,), "host"))
                return slot
        return None

    def check_integrity(self, in_copies: set[int] | None = None) -> None:
        """Every slot is free or holds exactly one hash, and only the slots of copies still owed
        (in_copies) are lent."""
        used = [slot for slot, _ in self._slot_of.values()]
        assert set(self._lent) == (in_copies or set()), f"host slots lent: {sorted(self._lent)}"
        assert len(set(used)) == len(used), "a host slot holds two blocks"
        assert not set(used) & set(self._free), "a host slot both free and holding a block"
        assert set(self._lent) <= set(used), "a lent host slot holds no block"
        assert len(used) + len(self._free) == self.num_slots, "host slots lost"
        by_priority = sum(len(bucket) for bucket in self._by_priority.values())
        assert by_priority == len(used), "host eviction order out of step"
        assert set(self.expiries.keys()) <= set(self._slot_of), "a deadline for a block not here"
