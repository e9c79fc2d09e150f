"""HostTier: the bookkeeping of a worker's host-memory KV tier (the second tier of the prefix
cache). It owns which host slot holds which block hash, each slot's retention priority, the
eviction order (priority, then LRU) and the slots lent out to a copy in flight; the bytes live
in the engine's host tensor. Pure Python, torch-free.

A device block evicted from the prefix cache is stored here (the engine copies its KV into the
slot before the step that reuses the device block); a prefix hit here is taken back (the slot
is lent until its KV is copied into a fresh device block, then freed): the tiers are exclusive.
"""

from __future__ import annotations

from collections import OrderedDict


class HostTier:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() takes slot 0 first
        self._by_priority: dict[int, OrderedDict[int, int]] = {}  # priority -> hash -> slot
        self._slot_of: dict[int, tuple[int, int]] = {}  # hash -> (slot, priority)
        self._lent: set[int] = set()  # slots whose KV a copy still reads or writes
        self.num_stored = 0  # blocks copied in from the device
        self.num_taken = 0  # blocks copied back to the device on a prefix hit
        self.num_dropped = 0  # evicted from this tier (or not stored: every slot lent)

    @property
    def num_cached(self) -> int:
        return len(self._slot_of)

    def has(self, block_hash: int) -> bool:
        return block_hash in self._slot_of

    def store(self, block_hash: int, priority: int) -> int | None:
        """A slot for a block leaving the device (lent until release); None when the hash is
        here already or every slot is lent. May evict the lowest-priority, oldest block."""
        if block_hash in self._slot_of:
            return None
        slot = self._free.pop() if self._free else self._evict()
        if slot is None:
            self.num_dropped += 1
            return None
        self._slot_of[block_hash] = (slot, priority)
        self._by_priority.setdefault(priority, OrderedDict())[block_hash] = slot
        self._lent.add(slot)
        self.num_stored += 1
        return slot

    def take(self, block_hash: int) -> int:
        """Remove a hit from the tier; its slot stays lent until release (the copy back)."""
        slot, priority = self._slot_of.pop(block_hash)
        del self._by_priority[priority][block_hash]
        self._lent.add(slot)
        self.num_taken += 1
        return slot

    def release(self, slot: int, keep: bool) -> None:
        """The copy using a lent slot is queued: a stored slot now holds its block (keep), a
        taken one is free again."""
        self._lent.discard(slot)
        if not keep:
            self._free.append(slot)

    def _evict(self) -> int | None:
        for priority in sorted(self._by_priority):
            bucket = self._by_priority[priority]
            for block_hash, slot in bucket.items():
                if slot in self._lent:
                    continue
                del bucket[block_hash]
                del self._slot_of[block_hash]
                self.num_dropped += 1
                return slot
        return None

    def check_integrity(self, in_copies: set[int] | None = None) -> None:
        """Every slot is free, lent or holds exactly one hash, and only the slots of copies
        still owed (in_copies) are lent."""
        held = [slot for slot, _ in self._slot_of.values()]
        assert self._lent == (in_copies or set()), f"host slots lent: {sorted(self._lent)}"
        assert len(set(held)) == len(held), "a host slot holds two blocks"
        assert not set(held) & set(self._free), "a host slot both free and holding a block"
        taken = self._lent - set(held)  # lent for a copy back: neither free nor holding
        assert len(held) + len(self._free) + len(taken) == self.num_slots, "host slots lost"
        by_priority = sum(len(bucket) for bucket in self._by_priority.values())
        assert by_priority == len(held), "host eviction order out of step"
