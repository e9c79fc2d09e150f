"""KeptBlocks: the blocks of finished requests kept referenced for their caller until it releases
them (KVCacheManager.keep / release_kept), by req_id. It owns that table only; what the caller
does with the blocks meanwhile (lets another process read them) is not its business.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

from engine.kv_cache.block_pool import KVBlock
from engine.kv_cache.retention import RetentionRange


class Kept(NamedTuple):
    """One finished request's kept blocks, with how to free them: host_slots pin the host
    tier's copies of its first blocks, `blocks` are the rest (from block index len(host_slots)
    on)."""

    blocks: list[KVBlock]
    priority: int
    retention: tuple[RetentionRange, ...]
    host_slots: tuple[int, ...] = ()

    @property
    def block_ids(self) -> tuple[int, ...]:
        """The ids the caller reads: its host slots first, then its device blocks."""
        return (*self.host_slots, *(block.block_id for block in self.blocks))

    @property
    def num_host_blocks(self) -> int:
        return len(self.host_slots)


class KeptBlocks:
    """req_id -> Kept. Invariant: a req_id is here from keep to its one release; each of its
    device blocks holds one reference for it and each host slot one pin (KVCacheManager's
    check_integrity counts them)."""

    def __init__(self) -> None:
        self._kept: dict[str, Kept] = {}

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._kept

    def __len__(self) -> int:
        return len(self._kept)

    def add(self, req_id: str, kept: Kept) -> None:
        assert req_id not in self._kept, f"blocks are kept for {req_id!r} already"
        self._kept[req_id] = kept

    def pop(self, req_id: str) -> Kept | None:
        return self._kept.pop(req_id, None)

    def block_ids(self) -> dict[str, tuple[int, ...]]:
        """req_id -> the ids kept for it (a copy)."""
        return {req_id: kept.block_ids for req_id, kept in self._kept.items()}

    def device_blocks(self) -> Iterator[list[KVBlock]]:
        return (kept.blocks for kept in self._kept.values())

    def host_slots(self) -> set[int]:
        return {slot for kept in self._kept.values() for slot in kept.host_slots}
