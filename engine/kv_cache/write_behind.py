"""WriteBehind: the host tier's copies that run off the step's critical path. It owns the
device blocks committed to the prefix cache whose copy into their host slot is owed (not yet
issued) or in flight on the engine's offload stream, and whether the next step must wait for
that stream (it reuses such a block, or reads such a slot). Pure Python, torch-free.

Life of a block: committed -> owed (its slot lent) -> issued after the step (in flight) ->
settled once the offload stream is known done. A block evicted while owed has its copy moved
onto the step's stream, ahead of the step that overwrites it.
"""

from __future__ import annotations

from engine.kv_cache.block_copy import BlockCopy


class WriteBehind:
    def __init__(self) -> None:
        self.owed: dict[int, BlockCopy] = {}  # device block id -> its copy, in commit order
        self._in_flight_blocks: set[int] = set()
        self._in_flight_slots: set[int] = set()
        self.must_wait = False  # the next step reuses a block or reads a slot still in flight
        self.num_issued = 0

    @property
    def in_flight(self) -> bool:
        return bool(self._in_flight_blocks)

    def owe(self, copy: BlockCopy) -> None:
        self.owed[copy.src_block_id] = copy

    def take_owed(self, block_id: int) -> BlockCopy | None:
        """An evicted block's copy, if never issued: the caller queues it before the step."""
        return self.owed.pop(block_id, None)

    def reuse_block(self, block_id: int) -> None:
        self.must_wait |= block_id in self._in_flight_blocks

    def read_slot(self, slot: int) -> None:
        self.must_wait |= slot in self._in_flight_slots

    def issue(self) -> list[BlockCopy]:
        """The owed copies, now in flight (the caller queues them on the offload stream)."""
        copies = list(self.owed.values())
        self.owed.clear()
        self._in_flight_blocks.update(c.src_block_id for c in copies)
        self._in_flight_slots.update(c.dst_block_id for c in copies)
        self.num_issued += len(copies)
        return copies

    def settled(self) -> None:
        """Every issued copy is done, or the step's stream waits for them."""
        self._in_flight_blocks.clear()
        self._in_flight_slots.clear()
        self.must_wait = False
