"""The physical KV block pool: ref counts, hash -> block prefix cache, each cached block's
tokens under its parent (for partial reuse), eviction order, the deadlines of priorities held
for a while (expiries), KV events.

Invariants (checked by check_integrity):
- a block with ref_cnt > 0 is in no free structure;
- a block with ref_cnt == 0 is either in the uncached free list (no hash) or in the evictable set
  (it has a hash and stays findable in the prefix cache until evicted);
- every hash in the cache map points at a block carrying that hash;
- every block listed under a parent is cached (an evicted block leaves its parent's list);
- only evictable blocks have a deadline (a block taken again or evicted drops its own; one taken
  again keeps the priority it falls back to, what outlives its hold).
Eviction takes uncached blocks first, then cached ones by retention priority (low first), then LRU.
A priority given for a while (retention by token range with duration_s) falls back to the given
default once it expires; expiries are applied when a block is next evicted.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.kv_cache.expiry import Expiries, Held

DEFAULT_PRIORITY = 35
MIN_PRIORITY, MAX_PRIORITY = 0, 100


@dataclass(eq=False)
class KVBlock:
    """Metadata of one physical block (the K/V of every layer for block_size tokens)."""

    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    priority: int = DEFAULT_PRIORITY
    token_ids: tuple[int, ...] = ()  # a cached block's tokens (partial reuse compares them)
    parent_key: int | None = None  # the chain hash it extends (the root's for a first block)


BlockRetention = tuple[int, float | None]  # (priority, expires_at on the pool's clock or None)


@dataclass(frozen=True)
class BlockStored:
    """A full block became findable by hash in a tier, "device" or "host" (parent_hash None:
    first block of a chain)."""

    block_hashes: tuple[int, ...]
    parent_hash: int | None
    tier: str = "device"


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks with these hashes were evicted from a tier and can no longer be reused there."""

    block_hashes: tuple[int, ...]
    tier: str = "device"


KVEvent = BlockStored | BlockRemoved


class NoFreeBlocksError(RuntimeError):
    """Raised by allocate() when asked for more blocks than are free; callers check first."""


class BlockPool:
    """Owns all KVBlock objects of one worker's KV cache."""

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        record_events: bool = False,
        clock: Callable[[], float] = time.monotonic,
        sibling_key_len: int = 0,
    ):
        """sibling_key_len: cached blocks registered with their tokens are listed under their
        parent and their first sibling_key_len tokens (partial reuse looks up only blocks that
        share at least that many tokens with a prompt)."""
        self.num_blocks = num_blocks
        self.sibling_key_len = sibling_key_len
        self.expiries: Expiries[int] = Expiries(clock)  # evictable block ids kept for a while
        # Called with a cached block about to be evicted for reuse (its hash still set) and the
        # deadline its priority held to (the slower tier it goes to keeps it): the host tier's
        # offload. Not called by evict_all_cached (a cold cache is wanted there).
        self.on_evict: Callable[[KVBlock, Held | None], None] | None = None
        self.enable_caching = enable_caching
        self.record_events = record_events
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._uncached_free: deque[KVBlock] = deque(self.blocks)
        self._evictable: dict[int, OrderedDict[int, KVBlock]] = {}
        self._num_evictable = 0
        self._cached: dict[int, KVBlock] = {}
        # (parent key, first sibling_key_len tokens) -> hash -> block
        self._children: dict[tuple[int, tuple[int, ...]], dict[int, KVBlock]] = {}
        self._events: list[KVEvent] = []
        # blocks whose last reference went since take_freed(): work queued before may still
        # read or write them (the engine's copy-back stream must not overwrite them early)
        self._freed_since_take: set[int] = set()

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._uncached_free) + self._num_evictable

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def num_holding_blocks(self) -> int:
        """Blocks holding KV: in use, or cached (evictable or not)."""
        return self.num_blocks - len(self._uncached_free)

    def lookup(self, block_hash: int) -> KVBlock | None:
        return self._cached.get(block_hash) if self.enable_caching else None

    def cached_blocks(self) -> list[KVBlock]:
        """Every block in the prefix cache (in use or evictable)."""
        return list(self._cached.values())

    def cached_hashes(self) -> list[int]:
        return list(self._cached)

    def children(self, parent_key: int, token_ids: Sequence[int]) -> list[KVBlock]:
        """Cached blocks that extend the chain ending in parent_key and begin with the first
        sibling_key_len of token_ids (registered with their tokens)."""
        if not self.enable_caching or len(token_ids) < self.sibling_key_len:
            return []
        key = (parent_key, tuple(token_ids[: self.sibling_key_len]))
        return list(self._children.get(key, {}).values())

    # ---- ref counting --------------------------------------------------------------------
    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on cached blocks found by lookup (removing them from eviction)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self._remove_evictable(block)
            block.ref_cnt += 1

    @property
    def clock(self) -> Callable[[], float]:
        """The clock retention deadlines are set and judged on (one: its Expiries')."""
        return self.expiries.clock

    @clock.setter
    def clock(self, clock: Callable[[], float]) -> None:
        self.expiries.clock = clock

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        if num_blocks > self.num_free_blocks:
            raise NoFreeBlocksError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(num_blocks):
            block = self._uncached_free.popleft() if self._uncached_free else self._evict_one(True)
            block.ref_cnt = 1
            block.priority = DEFAULT_PRIORITY  # not its last occupant's (the host tier's store)
            out.append(block)
        return out

    def free(
        self,
        blocks: list[KVBlock],
        priority: int = DEFAULT_PRIORITY,
        retention: Sequence[BlockRetention] | None = None,
    ) -> None:
        """Drop one reference from each block; blocks are released in the given order (LRU).

        A cached block left unreferenced keeps `priority`, or its own (priority, expires_at)
        from `retention` (one per block, same order): after expires_at it falls back to
        `priority`."""
        if retention is not None and len(retention) != len(blocks):
            raise ValueError(f"{len(retention)} retention entries for {len(blocks)} blocks")
        for i, block in enumerate(blocks):
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt:
                continue
            self._freed_since_take.add(block.block_id)
            if block.block_hash is None:
                self._uncached_free.append(block)
                continue
            kept, expires_at = (priority, None) if retention is None else retention[i]
            self._add_evictable(block, kept)
            if expires_at is not None and kept != priority:
                self.expiries.hold(block.block_id, Held(expires_at, priority))

    def take_freed(self) -> set[int]:
        """The ids of blocks left unreferenced since the last call (the engine calls it as it
        launches a step: the ids freed after the step in flight was launched)."""
        freed, self._freed_since_take = self._freed_since_take, set()
        return freed

    def freed_lately(self, block_ids: Sequence[int]) -> bool:
        """Any of the blocks left unreferenced since the last take_freed()."""
        return not self._freed_since_take.isdisjoint(block_ids)

    # ---- prefix cache --------------------------------------------------------------------
    def cache_block(
        self,
        block: KVBlock,
        block_hash: int,
        parent_hash: int | None,
        token_ids: tuple[int, ...] = (),
        parent_key: int | None = None,
    ) -> None:
        """Make a full, computed block findable by its hash (first writer wins on duplicates).

        With token_ids and parent_key (the chain hash it extends; the root's for a first block,
        where parent_hash is None), it is also listed under that parent for partial reuse."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block
        if token_ids and parent_key is not None:
            block.token_ids, block.parent_key = token_ids, parent_key
            self._children.setdefault(self._sibling_key(block), {})[block_hash] = block
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

    def drop_cached(self, block_hashes: Sequence[int]) -> int:
        """Make these blocks unfindable (an operator's eviction): an unreferenced one is freed,
        one in use stays with its holders and is freed uncached. Returns how many were here."""
        num = 0
        for block_hash in set(block_hashes):
            block = self._cached.get(block_hash)
            if block is None:
                continue
            num += 1
            if block.ref_cnt == 0:
                self._remove_evictable(block)
                self._uncache(block)
                self._uncached_free.append(block)
            else:
                self._uncache(block)
        return num

    # ---- internals -----------------------------------------------------------------------
    def _sibling_key(self, block: KVBlock) -> tuple[int, tuple[int, ...]]:
        assert block.parent_key is not None
        return block.parent_key, block.token_ids[: self.sibling_key_len]

    def _add_evictable(self, block: KVBlock, priority: int) -> None:
        block.priority = priority
        self._evictable.setdefault(priority, OrderedDict())[block.block_id] = block
        self._num_evictable += 1

    def _remove_evictable(self, block: KVBlock) -> None:
        del self._evictable[block.priority][block.block_id]
        self._num_evictable -= 1
        held = self.expiries.cancel(block.block_id)  # a later free sets its own
        if held is not None:  # taken again: what outlives its hold (a clean stop's spill)
            block.priority = held.then

    def _expire(self) -> None:
        """Move evictable blocks whose kept priority has expired to their fallback priority."""
        for block_id, fallback in self.expiries.due():
            block = self.blocks[block_id]
            self._remove_evictable(block)
            self._add_evictable(block, fallback)

    def _evict_one(self, for_reuse: bool = False) -> KVBlock:
        if len(self.expiries):
            self._expire()
        for priority in sorted(self._evictable):
            bucket = self._evictable[priority]
            if bucket:
                _, block = bucket.popitem(last=False)
                self._num_evictable -= 1
                held = self.expiries.cancel(block.block_id)
                if for_reuse and self.on_evict is not None:
                    self.on_evict(block, held)
                self._uncache(block)
                return block
        raise NoFreeBlocksError("no evictable block")

    def _uncache(self, block: KVBlock) -> None:
        assert block.block_hash is not None
        del self._cached[block.block_hash]
        if block.parent_key is not None:
            key = self._sibling_key(block)
            siblings = self._children[key]
            del siblings[block.block_hash]
            if not siblings:
                del self._children[key]
        if self.record_events:
            self._events.append(BlockRemoved((block.block_hash,)))
        block.block_hash, block.token_ids, block.parent_key = None, (), None
        self.expiries.cancel(block.block_id)

    def check_integrity(self, expected_refs: dict[int, int] | None = None) -> None:
        """Raise AssertionError when the invariants above do not hold.

        expected_refs maps block_id -> number of references known to the caller (request
        tables, kept blocks); blocks not in it must be unreferenced.
        """
        expected_refs = expected_refs or {}
        free_ids = [b.block_id for b in self._uncached_free]
        evictable_ids = [bid for bucket in self._evictable.values() for bid in bucket]
        assert len(set(free_ids)) == len(free_ids), "duplicate block in free list"
        assert not set(free_ids) & set(evictable_ids), "block both free and evictable"
        assert len(evictable_ids) == self._num_evictable, "evictable count drifted"
        assert set(self.expiries.keys()) <= set(evictable_ids), "a deadline for a block in use"
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
        for key, siblings in self._children.items():
            assert siblings, f"empty child list under {key}"
            for block_hash, block in siblings.items():
                assert self._cached.get(block_hash) is block, f"uncached child {block.block_id}"
                assert self._sibling_key(block) == key, f"child {block.block_id} under wrong key"
        in_use = sum(1 for b in self.blocks if b.ref_cnt > 0)
        assert in_use + self.num_free_blocks == self.num_blocks, "blocks lost"
