"""KVCacheManager: each request's block table (BlockTable, by req_id) over one BlockPool:
allocation from a prefix match, caching of full blocks, n > 1 forks, freeing, and keeping a
finished request's blocks for its caller until it releases them.

Its parts own the rest: BlockPool the blocks, PrefixCache (prefix_cache.py) the rules of finding
and committing cached blocks in both tiers, OwedCopies (owed_copies.py) the copies these owe the
storage and the host tier they fill, KeptBlocks (kept_blocks.py) the kept blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.config import CacheConfig
from engine.kv_cache.block_copy import BlockCopy
from engine.kv_cache.block_pool import BlockPool, KVBlock, KVEvent
from engine.kv_cache.disk_tier import DiskTier
from engine.kv_cache.host_tier import HostTier
from engine.kv_cache.kept_blocks import Kept, KeptBlocks
from engine.kv_cache.owed_copies import OwedCopies
from engine.kv_cache.prefix_cache import NO_MATCH, PrefixCache, PrefixMatch
from engine.kv_cache.retention import RetentionRange, block_retention
from engine.kv_cache.salt_index import SaltIndex
from engine.step.request import Request


@dataclass(slots=True)
class BlockTable:
    """One request's blocks in order, the same as ids (what the runner reads every step), and
    how many of the leading ones are in the prefix cache already."""

    blocks: list[KVBlock] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_cached: int = 0

    def extend(self, blocks: Sequence[KVBlock]) -> None:
        self.blocks.extend(blocks)
        self.block_ids.extend(block.block_id for block in blocks)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Invariants (check_integrity): a table's block_ids are its blocks' ids; each block's
    reference count is the number of tables and kept entries naming it (plus the caller's
    extra_refs); the host tier lends only the slots of owed copies and kept entries' pins."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        model_id: str,
        enable_caching: bool = True,
        record_events: bool = False,
        partial_reuse_min_tokens: int = 0,
        host_tier: HostTier | None = None,
        keep_on_host: bool = False,
        disk_tier: DiskTier | None = None,
    ):
        """partial_reuse_min_tokens: reuse the matching tokens of a cached block a prompt
        diverges inside when at least this many match (0: full blocks only). host_tier: where
        cached blocks evicted from the device go, still findable by hash. keep_on_host: keep()
        pins the host copies of a request's leading blocks instead of their device blocks.
        disk_tier: where cached blocks evicted from the host tier (or the device, without one)
        go, still findable by hash."""
        self.block_size = block_size
        self.host_tier = host_tier
        self.disk_tier = disk_tier if enable_caching else None
        self.keep_on_host = keep_on_host and host_tier is not None and enable_caching
        self.num_partial_reused_tokens = 0  # tokens reused from partly matching blocks
        self.num_host_hit_blocks = 0  # prefix blocks copied back from the host tier
        self.num_disk_hit_blocks = 0  # prefix blocks loaded back from the disk tier (or shared)
        self.num_lookup_blocks = 0  # prompt blocks looked up in the prefix cache
        self.num_device_hit_blocks = 0  # of those, found in the device pool
        self.pool = BlockPool(
            num_blocks, enable_caching, record_events, sibling_key_len=partial_reuse_min_tokens
        )
        self.owed = OwedCopies(host_tier, enable_caching, self.disk_tier)
        if (host_tier is not None or self.disk_tier is not None) and enable_caching:
            self.pool.on_evict = self.owed.evicted
        num_slots = num_blocks + (host_tier.num_slots if host_tier is not None else 0)
        num_slots += self.disk_tier.num_slots if self.disk_tier is not None else 0
        self.salts = SaltIndex(2 * num_slots)
        if self.disk_tier is not None:
            self.disk_tier.salts = self.salts
        self.prefix = PrefixCache(
            self.pool,
            block_size,
            model_id,
            partial_reuse_min_tokens,
            host_tier,
            self.owed,
            self.disk_tier,
            self.salts,
        )
        self.kept = KeptBlocks()
        self._tables: dict[str, BlockTable] = {}

    @classmethod
    def from_config(
        cls,
        cache: CacheConfig,
        num_blocks: int,
        model_id: str,
        record_events: bool,
        host_slots: int,
        disk_tier: DiskTier | None = None,
    ) -> KVCacheManager:
        """An engine's manager: its pool of num_blocks, a host tier of host_slots (0: none),
        the disk tier given (engine/execution/disk_setup.py builds it)."""
        tier = HostTier(host_slots, record_events) if host_slots else None
        return cls(
            num_blocks,
            cache.block_size,
            model_id,
            cache.enable_prefix_caching,
            record_events,
            cache.partial_reuse_threshold,
            tier,
            keep_on_host=cache.keep_on_host,
            disk_tier=disk_tier,
        )

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def drain_events(self) -> list[KVEvent]:
        """The KV events of every tier since the last call (each tier's in order)."""
        return self.pool.drain_events() + self.owed.drain_events()

    def block_ids(self, req_id: str) -> list[int]:
        """The request's block table; the live list: read it, do not keep or change it."""
        table = self._tables.get(req_id)
        return [] if table is None else table.block_ids

    # ---- allocation -------------------------------------------------------------------------
    def match_prefix(self, req: Request, partial: bool = False) -> PrefixMatch:
        """Longest cached prefix in both tiers (PrefixCache.match); none for a request that
        is not cacheable."""
        return self.prefix.match(req, partial) if req.cacheable else NO_MATCH

    # ---- loads behind the step (disk tier, shared store) ------------------------------------
    def poll_loads(self) -> None:
        """Stage the block reads behind the step that are done (DiskTier.collect)."""
        if self.disk_tier is not None:
            self.disk_tier.collect()

    def wait_for_load(self, req: Request, block_hashes: tuple[int, ...]) -> None:
        """req waits for its prefix's reads (PrefixMatch.pending_hashes), holding them."""
        assert self.disk_tier is not None and not req.pending_load
        self.disk_tier.hold(block_hashes)
        req.pending_load = block_hashes

    def load_landed(self, req: Request) -> bool:
        """Whether req's reads are all done (then it holds them no more: its match takes them,
        a bad block's file is gone and recomputed)."""
        assert self.disk_tier is not None
        if any(self.disk_tier.in_flight(block_hash) for block_hash in req.pending_load):
            return False
        self.drop_load(req)
        return True

    def drop_load(self, req: Request) -> None:
        """req holds its reads no more (landed, or it finished while waiting)."""
        if req.pending_load:
            assert self.disk_tier is not None
            self.disk_tier.release(req.pending_load)
            req.pending_load = ()

    @property
    def num_loads_in_flight(self) -> int:
        return 0 if self.disk_tier is None else self.disk_tier.num_in_flight

    def wait_loads(self, timeout_s: float = 0.01) -> None:
        """Block until a read behind the step is done (or timeout_s): no step has work."""
        if self.disk_tier is not None:
            self.disk_tier.wait_any(timeout_s)

    def _num_new_blocks(self, req: Request, num_new_tokens: int, match: PrefixMatch) -> int:
        table = self._tables.get(req.req_id)
        num_have = len(match.blocks) if table is None else len(table.blocks) + len(match.blocks)
        total_tokens = req.num_computed_tokens + match.num_tokens + num_new_tokens
        return max(0, cdiv(total_tokens, self.block_size) - num_have)

    def can_allocate(
        self, req: Request, num_new_tokens: int, match: PrefixMatch = NO_MATCH
    ) -> bool:
        return self.num_blocks_needed(req, num_new_tokens, match) <= self.pool.num_free_blocks

    def num_blocks_needed(
        self, req: Request, num_new_tokens: int, match: PrefixMatch = NO_MATCH
    ) -> int:
        """Free blocks that allocate(req, num_new_tokens, match) would take (new ones and
        matched cached ones it revives)."""
        revived = sum(1 for block in match.blocks if block.ref_cnt == 0)
        return self._num_new_blocks(req, num_new_tokens, match) + revived

    def num_freed_by(self, reqs: Sequence[Request], match: PrefixMatch = NO_MATCH) -> int:
        """Blocks that freeing reqs' tables would return to the free pool: those no one else
        holds, leaving out match's blocks (freed, then revived by the match's allocate)."""
        counts: dict[int, int] = {}
        blocks: dict[int, KVBlock] = {}
        for req in reqs:
            table = self._tables.get(req.req_id)
            for block in table.blocks if table is not None else ():
                counts[block.block_id] = counts.get(block.block_id, 0) + 1
                blocks[block.block_id] = block
        matched = {block.block_id for block in match.blocks}
        return sum(
            1
            for block_id, num in counts.items()
            if blocks[block_id].ref_cnt == num and block_id not in matched
        )

    def allocate(self, req: Request, num_new_tokens: int, match: PrefixMatch = NO_MATCH) -> None:
        """Take the matched blocks and enough new ones to hold num_new_tokens more tokens."""
        num_new_blocks = self._num_new_blocks(req, num_new_tokens, match)
        if num_new_blocks == 0 and not match.blocks:
            return  # most decodes: the last block still has a free slot
        table = self._tables.get(req.req_id)
        if table is None:
            table = self._tables[req.req_id] = BlockTable()
        if match.blocks:
            self.pool.touch(match.blocks)
            table.extend(match.blocks)
            table.num_cached = len(table.blocks)
        if req.num_computed_tokens == 0 and self.pool.enable_caching and req.cacheable:
            self.num_lookup_blocks += max(0, req.num_tokens - 1) // self.block_size
            self.num_device_hit_blocks += len(match.blocks)
        req.num_computed_tokens += match.num_tokens  # both tiers and a partial block's tokens
        slots = self.owed.lend_hits(match.host_hashes) if match.host_hashes else []
        # Copies run in the order they are queued, and taking a block may evict (and offload)
        # another: the partial block's copy is queued before any later block is taken, so no
        # copy back can overwrite its source first (a source evicted for its own copy is fine:
        # nothing writes it until the step).
        partial = []
        if match.partial_src is not None:
            partial = self._allocate(1)
            self.owed.queue(BlockCopy(match.partial_src.block_id, partial[0].block_id))
            self.num_partial_reused_tokens += match.num_partial_tokens
        taken = self._allocate(num_new_blocks - len(partial))
        first = len(table.blocks)
        for i, slot in enumerate(slots):  # copied back before the step that reads them
            self.owed.queue(BlockCopy(slot, taken[i].block_id, "from_host"))
            self.prefix.commit(req, taken[i], first + i)
        num_tiers = len(slots) + len(match.disk_hashes)
        if match.disk_hashes:  # loaded before the step that reads them
            self.owed.lend_disk_hits(match.disk_hashes, taken[len(slots) : num_tiers])
            for i in range(len(slots), num_tiers):
                self.prefix.commit(req, taken[i], first + i)
            self.num_disk_hit_blocks += len(match.disk_hashes)
        if num_tiers:
            table.num_cached = first + num_tiers
            self.num_host_hit_blocks += len(slots)
        table.extend([*taken[:num_tiers], *partial, *taken[num_tiers:]])

    def _allocate(self, num_blocks: int) -> list[KVBlock]:
        """Fresh blocks; the next step waits for an offload still reading one of them."""
        blocks = self.pool.allocate(num_blocks)
        self.owed.reused(blocks)
        return blocks

    def can_fork(self, parent_req_id: str, num_tokens: int) -> bool:
        """A fork of num_tokens of the parent's positions needs one free block per copied
        (partial) last block."""
        num_have = len(self.block_ids(parent_req_id))
        need = 1 if num_tokens % self.block_size else 0
        return num_have >= cdiv(num_tokens, self.block_size) and need <= self.pool.num_free_blocks

    def fork(self, parent_req_id: str, child: Request, num_tokens: int) -> BlockCopy | None:
        """Give child the parent's first num_tokens positions: its full blocks are shared (one
        more reference each), a partial last block gets a fresh block that the caller fills
        with a device copy (the returned BlockCopy) before the child writes to it."""
        parent = self._tables[parent_req_id]
        num_full = num_tokens // self.block_size
        shared = parent.blocks[:num_full]
        self.pool.touch(shared)
        table = BlockTable(num_cached=min(parent.num_cached, num_full))
        table.extend(shared)
        copy = None
        if num_tokens % self.block_size:
            (fresh,) = self._allocate(1)
            copy = BlockCopy(parent.blocks[num_full].block_id, fresh.block_id)
            table.extend([fresh])
        self._tables[child.req_id] = table
        child.num_computed_tokens = num_tokens
        return copy

    def cache_full_blocks(self, req: Request) -> None:
        """Register blocks whose tokens are all computed in the prefix cache.

        A position counts as computed only once its token is real (the engine records a step
        launched ahead after the tokens it was launched on are read), so each block has a hash.
        """
        if not self.pool.enable_caching or not req.cacheable:
            return
        table = self._tables.get(req.req_id)
        if table is None:
            return
        num_full = min(req.num_computed_tokens // self.block_size, len(table.blocks))
        if num_full <= table.num_cached:
            return
        self.prefix.update_hashes(req)
        for i in range(table.num_cached, num_full):
            self.prefix.commit(req, table.blocks[i], i)
        table.num_cached = num_full

    # ---- freeing and keeping --------------------------------------------------------------
    def free(self, req: Request) -> None:
        """Release a request's blocks, tail first so that shared prefixes are evicted last."""
        table = self._tables.pop(req.req_id, None)
        if table is not None:
            self._free_blocks(table.blocks, req.retention_priority, req.retention)

    def _free_blocks(
        self,
        blocks: list[KVBlock],
        priority: int,
        retention: tuple[RetentionRange, ...],
        first: int = 0,
    ) -> None:
        """Tail first; each block keeps the priority its token ranges give it (else priority).
        first: the request's block index of blocks[0]."""
        retained = None
        if retention:
            now = self.pool.clock()
            num = first + len(blocks)
            retained = block_retention(retention, num, self.block_size, priority, now)[first:]
        self.pool.free(blocks[::-1], priority, None if retained is None else retained[::-1])

    def keep(self, req: Request) -> Kept:
        """Keep a finished request's blocks referenced for its caller until release_kept. With
        keep_on_host its leading blocks whose copies are in the host tier are kept as those
        (pinned host slots; their device blocks are freed, still cached): Kept.block_ids names
        the host slots first, then the device blocks."""
        table = self._tables.pop(req.req_id, None)
        blocks = [] if table is None else table.blocks
        slots = self.owed.pin_copies(blocks) if self.keep_on_host else []
        if slots:
            self._free_blocks(blocks[: len(slots)], req.retention_priority, req.retention)
        kept = Kept(blocks[len(slots) :], req.retention_priority, req.retention, tuple(slots))
        self.kept.add(req.req_id, kept)
        return kept

    def release_kept(self, req_id: str) -> bool:
        """Free the blocks kept for req_id; False when none are."""
        kept = self.kept.pop(req_id)
        if kept is None:
            return False
        self._free_blocks(kept.blocks, kept.priority, kept.retention, len(kept.host_slots))
        self.owed.unpin(kept.host_slots)
        return True

    # ---- checks ---------------------------------------------------------------------------
    def holders(self) -> dict[int, int]:
        """block_id -> number of request tables and kept entries holding it."""
        refs: dict[int, int] = {}
        tables = [*(table.blocks for table in self._tables.values()), *self.kept.device_blocks()]
        for blocks in tables:
            for block in blocks:
                refs[block.block_id] = refs.get(block.block_id, 0) + 1
        return refs

    def check_integrity(self, extra_refs: dict[int, int] | None = None) -> None:
        for req_id, table in self._tables.items():
            if table.block_ids != [block.block_id for block in table.blocks]:
                raise AssertionError(f"block id table of {req_id} is out of step with its blocks")
        refs = self.holders()
        for block_id, num in (extra_refs or {}).items():
            refs[block_id] = refs.get(block_id, 0) + num
        self.pool.check_integrity(refs)
        self.owed.check_integrity(self.kept.host_slots())

    def assert_all_free(self) -> None:
        """No blocks are kept and every block is free (cached or not), the tables consistent."""
        assert not self.kept, f"{len(self.kept)} requests' kept blocks not released"
        self.check_integrity()
        num_used = self.num_blocks - self.num_free_blocks
        assert num_used == 0, f"{num_used} blocks leaked"
        held = 0 if self.disk_tier is None else self.disk_tier.num_held
        assert held == 0, f"{held} disk or shared-store reads still held"
