"""KVCacheManager: each request's block table, prefix matching (full blocks on the device, then
in the host tier, then the matching tokens of a cached block the prompt diverges inside),
caching of full blocks, and the block copies these owe the storage (partial reuse, copy back
on a host hit, an evicted block's offload still owed), queued in order for the engine; the
committed blocks' copies into the host tier are owed to the engine's offload stream instead
(WriteBehind).

All physical bookkeeping lives in BlockPool, HostTier and WriteBehind; this class owns
request -> blocks and the copies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from engine.config import CacheConfig
from engine.kv_cache.block_copy import BlockCopy
from engine.kv_cache.block_pool import BlockPool, KVBlock, KVEvent
from engine.kv_cache.hashing import hash_blocks, root_hash
from engine.kv_cache.host_tier import HostTier
from engine.kv_cache.retention import RetentionRange, block_retention
from engine.kv_cache.write_behind import WriteBehind
from engine.request import Request


@dataclass(frozen=True)
class PrefixMatch:
    """Cached blocks covering the longest known prefix of a request's tokens; partial_src: a
    cached block whose first num_partial_tokens tokens continue it (copied into a fresh block)."""

    blocks: list[KVBlock] = field(default_factory=list)
    num_tokens: int = 0  # full blocks' tokens (both tiers) + num_partial_tokens
    partial_src: KVBlock | None = None
    num_partial_tokens: int = 0
    host_hashes: tuple[int, ...] = ()  # the full blocks after `blocks` found in the host tier


NO_MATCH = PrefixMatch()


class HeldBlocks(NamedTuple):
    """A finished request's blocks kept referenced (a prefill lease), with how to free them:
    host_slots pin the host tier's copies of its first blocks, `blocks` are the rest (from
    block index len(host_slots) on)."""

    blocks: list[KVBlock]
    priority: int
    retention: tuple[RetentionRange, ...]
    host_slots: tuple[int, ...] = ()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens a and b share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        model_id: str,
        enable_caching: bool = True,
        record_events: bool = False,
        partial_reuse_min_tokens: int = 0,
        host_tier: HostTier | None = None,
        host_leases: bool = False,
    ):
        """partial_reuse_min_tokens: reuse the matching tokens of a cached block a prompt
        diverges inside when at least this many match (0: full blocks only). host_tier: where
        cached blocks evicted from the device go, still findable by hash. host_leases: hold()
        pins the host copies of a request's leading blocks instead of their device blocks."""
        self.block_size = block_size
        self.host_tier = host_tier
        self.host_leases = host_leases and host_tier is not None and enable_caching
        self.partial_reuse_min_tokens = partial_reuse_min_tokens
        self.num_partial_reused_tokens = 0  # tokens reused from partly matching blocks
        self.num_host_hit_blocks = 0  # prefix blocks copied back from the host tier
        self._pending_copies: list[BlockCopy] = []  # every copy owed, in the order to run
        self.write_behind = WriteBehind() if host_tier is not None and enable_caching else None
        self.model_id = model_id
        self.pool = BlockPool(
            num_blocks, enable_caching, record_events, sibling_key_len=partial_reuse_min_tokens
        )
        if host_tier is not None and enable_caching:
            self.pool.on_evict = self._offload
        self._req_blocks: dict[str, list[KVBlock]] = {}
        self._req_block_ids: dict[str, list[int]] = {}  # the same tables as ids, kept in step
        self._num_cached_blocks: dict[str, int] = {}
        self._held: dict[str, HeldBlocks] = {}

    def drain_events(self) -> list[KVEvent]:
        """The KV events of both tiers since the last call (each tier's in order)."""
        events = self.pool.drain_events()
        if self.host_tier is not None:
            events += self.host_tier.drain_events()
        return events

    @classmethod
    def from_config(
        cls,
        cache: CacheConfig,
        num_blocks: int,
        model_id: str,
        record_events: bool,
        host_slots: int,
    ) -> KVCacheManager:
        """An engine's manager: its pool of num_blocks, a host tier of host_slots (0: none)."""
        tier = HostTier(host_slots, record_events) if host_slots else None
        return cls(
            num_blocks,
            cache.block_size,
            model_id,
            cache.enable_prefix_caching,
            record_events,
            cache.partial_reuse_threshold,
            tier,
            cache.host_leases,
        )

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def update_hashes(self, req: Request) -> None:
        """Extend req.block_hashes to every full block of its real tokens (all_token_ids: a
        pending token has no id, so no hash covers it)."""
        if len(req.block_hashes) < len(req.all_token_ids) // self.block_size:
            req.block_hashes = hash_blocks(
                req.all_token_ids, self.block_size, self.model_id, req.cache_salt, req.block_hashes
            )

    def match_prefix(self, req: Request, partial: bool = False) -> PrefixMatch:
        """Longest cached prefix, leaving at least the last token to compute (it yields logits).

        partial: past the full blocks, also the cached block under the last one whose tokens
        match the prompt's next ones longest (at least partial_reuse_min_tokens of them)."""
        if not self.pool.enable_caching:
            return NO_MATCH
        self.update_hashes(req)
        max_blocks = (req.num_tokens - 1) // self.block_size
        blocks = []
        for block_hash in req.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            blocks.append(block)
        host: list[int] = []
        if self.host_tier is not None:
            for block_hash in req.block_hashes[len(blocks) : max_blocks]:
                if not self.host_tier.has(block_hash):
                    break
                host.append(block_hash)
        num_full = (len(blocks) + len(host)) * self.block_size
        if not partial or self.partial_reuse_min_tokens < 1:
            return PrefixMatch(blocks, num_full, host_hashes=tuple(host))
        chain = [*(b.block_hash for b in blocks), *host]
        parent = chain[-1] if chain else root_hash(self.model_id, req.cache_salt)
        assert parent is not None
        wanted = req.all_token_ids[num_full : min(num_full + self.block_size, req.num_tokens - 1)]
        src, num_same = None, self.partial_reuse_min_tokens - 1
        for child in self.pool.children(parent, wanted):
            same = common_prefix_len(child.token_ids, wanted)
            if same > num_same:
                src, num_same = child, same
        if src is None:
            return PrefixMatch(blocks, num_full, host_hashes=tuple(host))
        return PrefixMatch(blocks, num_full + num_same, src, num_same, tuple(host))

    def _num_new_blocks(self, req: Request, num_new_tokens: int, match: PrefixMatch) -> int:
        held = len(self._req_blocks.get(req.req_id, ())) + len(match.blocks)
        total_tokens = req.num_computed_tokens + match.num_tokens + num_new_tokens
        return max(0, cdiv(total_tokens, self.block_size) - held)

    def can_allocate(
        self, req: Request, num_new_tokens: int, match: PrefixMatch = NO_MATCH
    ) -> bool:
        revived = sum(1 for block in match.blocks if block.ref_cnt == 0)
        need = self._num_new_blocks(req, num_new_tokens, match) + revived
        return need <= self.pool.num_free_blocks

    def allocate(self, req: Request, num_new_tokens: int, match: PrefixMatch = NO_MATCH) -> None:
        """Take the matched blocks and enough new ones to hold num_new_tokens more tokens."""
        num_new_blocks = self._num_new_blocks(req, num_new_tokens, match)
        if num_new_blocks == 0 and not match.blocks:
            return  # most decodes: the last block still has a free slot
        blocks = self._req_blocks.setdefault(req.req_id, [])
        block_ids = self._req_block_ids.setdefault(req.req_id, [])
        if match.blocks:
            self.pool.touch(match.blocks)
            blocks.extend(match.blocks)
            block_ids.extend(block.block_id for block in match.blocks)
            self._num_cached_blocks[req.req_id] = len(blocks)
        req.num_computed_tokens += match.num_tokens  # both tiers and a partial block's tokens
        assert self.host_tier is not None or not match.host_hashes
        slots = [self.host_tier.lend(h) for h in match.host_hashes] if match.host_hashes else []
        for slot in slots:
            self._wb.read_slot(slot)
        # Copies run in the order they are queued, and taking a block may evict (and offload)
        # another: the partial block's copy is queued before any later block is taken, so no
        # copy back can overwrite its source first (a source evicted for its own copy is fine:
        # nothing writes it until the step).
        partial = []
        if match.partial_src is not None:
            partial = self._allocate(1)
            self._pending_copies.append(BlockCopy(match.partial_src.block_id, partial[0].block_id))
            self.num_partial_reused_tokens += match.num_partial_tokens
        taken = self._allocate(num_new_blocks - len(partial))
        for i, slot in enumerate(slots):  # copied back before the step that reads them
            self._pending_copies.append(BlockCopy(slot, taken[i].block_id, "from_host"))
            self._cache(req, taken[i], len(blocks) + i)
        if slots:
            self._num_cached_blocks[req.req_id] = len(blocks) + len(slots)
            self.num_host_hit_blocks += len(slots)
        new_blocks = [*taken[: len(slots)], *partial, *taken[len(slots) :]]
        blocks.extend(new_blocks)
        block_ids.extend(block.block_id for block in new_blocks)

    def _allocate(self, num_blocks: int) -> list[KVBlock]:
        """Fresh blocks; the next step waits for an offload still reading one of them."""
        blocks = self.pool.allocate(num_blocks)
        if self.write_behind is not None:
            for block in blocks:
                self.write_behind.reuse_block(block.block_id)
        return blocks

    @property
    def _wb(self) -> WriteBehind:
        assert self.write_behind is not None
        return self.write_behind

    def _offload(self, block: KVBlock) -> None:
        """BlockPool.on_evict: a cached block leaves the device; it stays in the host tier."""
        assert self.host_tier is not None and block.block_hash is not None
        owed = self._wb.take_owed(block.block_id)
        if owed is not None:  # committed but never copied: before the step that reuses it
            self._pending_copies.append(owed)
        if self.host_tier.has(block.block_hash):
            self.host_tier.refresh(block.block_hash, block.priority)
            return
        slot = self.host_tier.store(block.block_hash, block.priority)  # none was free at commit
        if slot is not None:
            self._pending_copies.append(BlockCopy(block.block_id, slot, "to_host"))

    def _write_behind(self, block: KVBlock) -> None:
        """A block just committed: give it a host slot; its copy runs behind the step."""
        assert self.host_tier is not None and block.block_hash is not None
        slot = self.host_tier.store(block.block_hash, block.priority)
        if slot is not None:
            self._wb.owe(BlockCopy(block.block_id, slot, "to_host"))

    def drain_offloads(self) -> list[BlockCopy]:
        """The committed blocks' copies into the host tier, owed since the last call (the
        caller queues them on the offload stream, after the steps queued so far)."""
        if self.write_behind is None or not self.write_behind.owed:
            return []
        copies = self.write_behind.issue()
        assert self.host_tier is not None
        for copy in copies:
            self.host_tier.release(copy.dst_block_id)
        return copies

    def queue_copy(self, copy: BlockCopy) -> None:
        """A copy (an n > 1 fork's partial block) queued after the ones already owed."""
        self._pending_copies.append(copy)

    def drain_copies(self) -> list[BlockCopy]:
        """The block copies owed since the last call, in the order they must run; the caller
        queues them, in that order on one stream, before the next forward pass. The host slots
        they use are released here (stream order protects them from then on)."""
        copies, self._pending_copies = self._pending_copies, []
        if self.host_tier is not None:
            for copy in copies:
                if copy.kind == "to_host":
                    self.host_tier.release(copy.dst_block_id)
                elif copy.kind == "from_host":
                    self.host_tier.release(copy.src_block_id)
        return copies

    def can_fork(self, parent_req_id: str, num_tokens: int) -> bool:
        """A fork of num_tokens of the parent's positions needs one free block per copied
        (partial) last block."""
        held = len(self._req_blocks.get(parent_req_id, ()))
        need = 1 if num_tokens % self.block_size else 0
        return held >= cdiv(num_tokens, self.block_size) and need <= self.pool.num_free_blocks

    def fork(self, parent_req_id: str, child: Request, num_tokens: int) -> BlockCopy | None:
        """Give child the parent's first num_tokens positions: its full blocks are shared (one
        more reference each), a partial last block gets a fresh block that the caller fills
        with a device copy (the returned BlockCopy) before the child writes to it."""
        parent_blocks = self._req_blocks[parent_req_id]
        num_full = num_tokens // self.block_size
        shared = parent_blocks[:num_full]
        self.pool.touch(shared)
        blocks = list(shared)
        copy = None
        if num_tokens % self.block_size:
            (fresh,) = self._allocate(1)
            copy = BlockCopy(parent_blocks[num_full].block_id, fresh.block_id)
            blocks.append(fresh)
        self._req_blocks[child.req_id] = blocks
        self._req_block_ids[child.req_id] = [block.block_id for block in blocks]
        self._num_cached_blocks[child.req_id] = min(
            self._num_cached_blocks.get(parent_req_id, 0), num_full
        )
        child.num_computed_tokens = num_tokens
        return copy

    def cache_full_blocks(self, req: Request) -> None:
        """Register blocks whose tokens are all computed in the prefix cache.

        A position counts as computed only once its token is real (the engine records a step
        launched ahead after the tokens it was launched on are read), so each block has a hash.
        """
        if not self.pool.enable_caching:
            return
        blocks = self._req_blocks.get(req.req_id)
        if not blocks:
            return
        num_full = min(req.num_computed_tokens // self.block_size, len(blocks))
        start = self._num_cached_blocks.get(req.req_id, 0)
        if num_full <= start:
            return
        self.update_hashes(req)
        for i in range(start, num_full):
            self._cache(req, blocks[i], i)
        self._num_cached_blocks[req.req_id] = num_full

    def _cache(self, req: Request, block: KVBlock, i: int) -> None:
        """Make block i of req findable: its hash, and with partial reuse on, its tokens under
        its parent."""
        parent = req.block_hashes[i - 1] if i else None
        if self.partial_reuse_min_tokens < 1:
            self.pool.cache_block(block, req.block_hashes[i], parent)
        else:
            key = parent if parent is not None else root_hash(self.model_id, req.cache_salt)
            tokens = tuple(req.all_token_ids[i * self.block_size : (i + 1) * self.block_size])
            self.pool.cache_block(block, req.block_hashes[i], parent, tokens, key)
        tier, block_hash = self.host_tier, block.block_hash  # None: another block has the hash
        stored = tier is None or block_hash is None or tier.has(block_hash)
        if self.write_behind is not None and not stored:
            self._write_behind(block)

    def free(self, req: Request) -> None:
        """Release a request's blocks, tail first so that shared prefixes are evicted last."""
        blocks = self._req_blocks.pop(req.req_id, [])
        self._req_block_ids.pop(req.req_id, None)
        self._num_cached_blocks.pop(req.req_id, None)
        self._free_blocks(blocks, req.retention_priority, req.retention)

    def _free_blocks(
        self,
        blocks: list[KVBlock],
        priority: int,
        retention: tuple[RetentionRange, ...],
        first: int = 0,
    ) -> None:
        """Tail first; each block keeps the priority its token ranges give it (else priority).
        first: the request's block index of blocks[0]."""
        kept = None
        if retention:
            now = self.pool.clock()
            num = first + len(blocks)
            kept = block_retention(retention, num, self.block_size, priority, now)[first:][::-1]
        self.pool.free(blocks[::-1], priority, kept)

    def hold(self, req: Request) -> list[int]:
        """Keep a finished request's blocks referenced (a prefill lease) until release_held:
        the ids of its host slots (with host leases: its leading blocks copied there, whose
        device blocks are freed, still cached), then of its device blocks."""
        blocks = self._req_blocks.pop(req.req_id, [])
        self._req_block_ids.pop(req.req_id, None)
        self._num_cached_blocks.pop(req.req_id, None)
        slots: list[int] = []
        if self.host_leases:
            assert self.host_tier is not None
            for block in blocks:
                if block.block_hash is None or not self.host_tier.has(block.block_hash):
                    break
                slots.append(self.host_tier.pin(block.block_hash))
            self._free_blocks(blocks[: len(slots)], req.retention_priority, req.retention)
            blocks = blocks[len(slots) :]
        held = HeldBlocks(blocks, req.retention_priority, req.retention, tuple(slots))
        self._held[req.req_id] = held
        return [*slots, *(block.block_id for block in blocks)]

    def num_held_host_blocks(self, req_id: str) -> int:
        """How many of a held request's first ids (see hold) are host slots."""
        held = self._held.get(req_id)
        return 0 if held is None else len(held.host_slots)

    def is_held(self, req_id: str) -> bool:
        return req_id in self._held

    def release_held(self, req_id: str) -> bool:
        held = self._held.pop(req_id, None)
        if held is None:
            return False
        self._free_blocks(held.blocks, held.priority, held.retention, len(held.host_slots))
        for slot in held.host_slots:
            assert self.host_tier is not None
            self.host_tier.release(slot)
        return True

    @property
    def num_held(self) -> int:
        return len(self._held)

    def held_block_ids(self) -> dict[str, tuple[int, ...]]:
        """req_id -> the block ids held for it (a copy; the prefill worker checks its leases)."""
        return {
            req_id: (*held.host_slots, *(b.block_id for b in held.blocks))
            for req_id, held in self._held.items()
        }

    def block_ids(self, req_id: str) -> list[int]:
        """The request's block table; the live list: read it, do not keep or change it."""
        return self._req_block_ids.get(req_id, [])

    def holders(self) -> dict[int, int]:
        """block_id -> number of request tables holding it (for integrity checks)."""
        refs: dict[int, int] = {}
        tables = [*self._req_blocks.values(), *(held.blocks for held in self._held.values())]
        for blocks in tables:
            for block in blocks:
                refs[block.block_id] = refs.get(block.block_id, 0) + 1
        return refs

    def check_integrity(self, extra_refs: dict[int, int] | None = None) -> None:
        for req_id, blocks in self._req_blocks.items():
            if self._req_block_ids.get(req_id) != [block.block_id for block in blocks]:
                raise AssertionError(f"block id table of {req_id} is out of step with its blocks")
        if self._req_block_ids.keys() != self._req_blocks.keys():
            raise AssertionError("block id tables and block tables name different requests")
        refs = self.holders()
        for block_id, num in (extra_refs or {}).items():
            refs[block_id] = refs.get(block_id, 0) + num
        self.pool.check_integrity(refs)
        if self.host_tier is not None:
            owed = {c.dst_block_id for c in self._pending_copies if c.kind == "to_host"}
            owed |= {c.src_block_id for c in self._pending_copies if c.kind == "from_host"}
            if self.write_behind is not None:
                owed |= {c.dst_block_id for c in self.write_behind.owed.values()}
            owed |= {slot for held in self._held.values() for slot in held.host_slots}
            self.host_tier.check_integrity(owed)

    def assert_all_free(self) -> None:
        """No lease is held and every block is free (cached or not), the tables consistent."""
        assert self.num_held == 0, f"{self.num_held} prefill leases not released"
        self.check_integrity()
        num_used = self.num_blocks - self.num_free_blocks
        assert num_used == 0, f"{num_used} blocks leaked"
