"""The physical KV block pool: ref counts, hash -> block prefix cache, eviction order, KV events.

Invariants (checked by check_integrity):
- a block with ref_cnt > 0 is in no free structure;
- a block with ref_cnt == 0 is either in the uncached free list (no hash) or in the evictable set
  (it has a hash and stays findable in the prefix cache until evicted);
- every hash in the cache map points at a block carrying that hash.
Eviction takes uncached blocks first, then cached ones by retention priority (low first), then LRU.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

DEFAULT_PRIORITY = 35
MIN_PRIORITY, MAX_PRIORITY = 0, 100


@dataclass(eq=False)
class KVBlock:
    """Metadata of one physical block (the K/V of every layer for block_size tokens)."""

    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    priority: int = DEFAULT_PRIORITY


@dataclass(frozen=True)
class BlockStored:
    """A full block became findable by hash (parent_hash None: first block of a chain)."""

    block_hashes: tuple[int, ...]
    parent_hash: int | None


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks with these hashes were evicted and can no longer be reused."""

    block_hashes: tuple[int, ...]


KVEvent = BlockStored | BlockRemoved


class NoFreeBlocksError(RuntimeError):
    """Raised by allocate() when asked for more blocks than are free; callers check first."""


class BlockPool:
    """Owns all KVBlock objects of one worker's KV cache."""

    def __init__(self, num_blocks: int, enable_caching: bool = True, record_events: bool = False):
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.record_events = record_events
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._uncached_free: deque[KVBlock] = deque(self.blocks)
        self._evictable: dict[int, OrderedDict[int, KVBlock]] = {}
        self._num_evictable = 0
        self._cached: dict[int, KVBlock] = {}
        self._events: list[KVEvent] = []

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._uncached_free) + self._num_evictable

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def lookup(self, block_hash: int) -> KVBlock | None:
        return self._cached.get(block_hash) if self.enable_caching else None

    def cached_hashes(self) -> list[int]:
        return list(self._cached)

    # ---- ref counting --------------------------------------------------------------------
    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on cached blocks found by lookup (removing them from eviction)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self._remove_evictable(block)
            block.ref_cnt += 1

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        if num_blocks > self.num_free_blocks:
            raise NoFreeBlocksError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(num_blocks):
            block = self._uncached_free.popleft() if self._uncached_free else self._evict_one()
            block.ref_cnt = 1
            out.append(block)
        return out

    def free(self, blocks: list[KVBlock], priority: int = DEFAULT_PRIORITY) -> None:
        """Drop one reference from each block; blocks are released in the given order (LRU)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt:
                continue
            if block.block_hash is None:
                self._uncached_free.append(block)
            else:
                block.priority = priority
                self._evictable.setdefault(priority, OrderedDict())[block.block_id] = block
                self._num_evictable += 1

    # ---- prefix cache --------------------------------------------------------------------
    def cache_block(self, block: KVBlock, block_hash: int, parent_hash: int | None) -> None:
        """Make a full, computed block findable by its hash (first writer wins on duplicates)."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block
        if self.record_events:
            self._events.append(BlockStored((block_hash,), parent_hash))

    def drain_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def evict_all_cached(self) -> int:
        """Drop every unreferenced cached block from the prefix cache; returns how many."""
        num = 0
        while self._num_evictable:
            self._uncached_free.append(self._evict_one())
            num += 1
        return num

    # ---- internals -----------------------------------------------------------------------
    def _remove_evictable(self, block: KVBlock) -> None:
        del self._evictable[block.priority][block.block_id]
        self._num_evictable -= 1

    def _evict_one(self) -> KVBlock:
        for priority in sorted(self._evictable):
            bucket = self._evictable[priority]
            if bucket:
                _, block = bucket.popitem(last=False)
                self._num_evictable -= 1
                self._uncache(block)
                return block
        raise NoFreeBlocksError("no evictable block")

    def _uncache(self, block: KVBlock) -> None:
        assert block.block_hash is not None
        del self._cached[block.block_hash]
        if self.record_events:
            self._events.append(BlockRemoved((block.block_hash,)))
        block.block_hash = None

    def check_integrity(self, expected_refs: dict[int, int] | None = None) -> None:
        """Raise AssertionError when the invariants above do not hold.

        expected_refs maps block_id -> number of holders known to the caller (request tables,
        leases); blocks not in it must be unreferenced.
        """
        expected_refs = expected_refs or {}
        free_ids = [b.block_id for b in self._uncached_free]
        evictable_ids = [bid for bucket in self._evictable.values() for bid in bucket]
        assert len(set(free_ids)) == len(free_ids), "duplicate block in free list"
        assert not set(free_ids) & set(evictable_ids), "block both free and evictable"
        assert len(evictable_ids) == self._num_evictable, "evictable count drifted"
        for block in self.blocks:
            want = expected_refs.get(block.block_id, 0)
            assert block.ref_cnt == want, (
                f"block {block.block_id}: ref_cnt {block.ref_cnt}, holders {want}"
            )
        for block in self._uncached_free:
            assert block.block_hash is None, f"free block {block.block_id} still has a hash"
        for bucket in self._evictable.values():
            for block in bucket.values():
                assert block.block_hash is not None and block.ref_cnt == 0
        for block_hash, block in self._cached.items():
            assert block.block_hash == block_hash, f"cache map wrong for {block.block_id}"
        in_use = sum(1 for b in self.blocks if b.ref_cnt > 0)
        assert in_use + self.num_free_blocks == self.num_blocks, "blocks lost"
