"""OwedCopies: the block copies the KV cache owes its storage, and the host tier they fill. It
owns the queue of copies owed before the next step, in the order they must run (a partial
block's or an n > 1 fork's copy on the device, a host hit's copy back, an evicted block's
offload still owed), and drives the host tier (HostTier: which slot holds which hash) and the
committed blocks' copies into it behind the step (WriteBehind). Pure Python, torch-free.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from engine.kv_cache.block_copy import BlockCopy
from engine.kv_cache.block_pool import KVBlock, KVEvent
from engine.kv_cache.disk_tier import DiskTier, Spill
from engine.kv_cache.expiry import Held
from engine.kv_cache.host_tier import HostTier
from engine.kv_cache.write_behind import WriteBehind


class OwedCopies:
    """Copies owed to the engine's storage (engine/execution/block_copies.py runs them).

    Invariants (check_integrity): the host tier lends exactly the slots of the copies still
    owed (queued here, or owed behind the step) and the slots pinned by kept blocks; a copy
    leaves this queue once, in the order it was queued (drain_copies), and a lent slot is
    released once its copy is handed over (stream order protects it from then on).
    """

    def __init__(
        self,
        host_tier: HostTier | None = None,
        write_behind: bool = False,
        disk_tier: DiskTier | None = None,
    ):
        """host_tier: where cached blocks evicted from the device go, still findable by hash.
        write_behind: copy each block committed to the prefix cache into the host tier behind
        the step (a device eviction then costs no copy); needs a host tier. disk_tier: where
        blocks evicted from the host tier (without one: from the device) go."""
        self.host_tier = host_tier
        self.disk_tier = disk_tier
        self.write_behind = WriteBehind() if host_tier is not None and write_behind else None
        self._queued: list[BlockCopy] = []  # every copy owed before the next step, in order
        # blocks leaving for the disk tier: written before any copy queued after them runs
        self._spills: list[Spill] = []
        self._disk_payloads: dict[int, object] = {}  # device block -> its "from_disk" KV
        if host_tier is not None and disk_tier is not None:
            host_tier.on_evict = self._host_evicted

    def _host_evicted(self, block_hash: int, slot: int, priority: int, held: Held | None) -> None:
        assert self.disk_tier is not None
        if self.disk_tier.has(block_hash):
            self.disk_tier.refresh(block_hash, priority, held)
        else:
            self._spills.append(Spill(block_hash, slot, True, priority, held))

    def lend_disk_hits(self, block_hashes: Sequence[int], blocks: Sequence[KVBlock]) -> None:
        """A prefix hit in the disk tier or the shared store (staged by the match): each
        block's KV is copied into its fresh device block before the next step."""
        disk = self.disk_tier
        assert disk is not None
        for block_hash, block in zip(block_hashes, blocks, strict=True):
            if disk.shared is not None and not disk.is_staged(block_hash):  # the shared store's
                self._disk_payloads[block.block_id] = disk.shared.take(block_hash)
            else:
                self._disk_payloads[block.block_id] = disk.take(block_hash)
            self._queued.append(BlockCopy(block_hash, block.block_id, "from_disk"))

    def spill_all(
        self,
        device_blocks: Iterable[KVBlock],
        held: Callable[[int], Held | None] = lambda block_id: None,
    ) -> None:
        """Owe the disk tier every cached block it lacks: the host tier's, then the device's
        (a clean shutdown keeps them for the next start). held: a device block's deadline."""
        assert self.disk_tier is not None
        owed = {spill.block_hash for spill in self._spills}
        if self.host_tier is not None:
            for block_hash, slot, priority, until in self.host_tier.entries():
                if not self.disk_tier.has(block_hash) and block_hash not in owed:
                    self._spills.append(Spill(block_hash, slot, True, priority, until))
                    owed.add(block_hash)
        for block in device_blocks:
            block_hash = block.block_hash
            if block_hash is None or block_hash in owed or self.disk_tier.has(block_hash):
                continue
            spill = Spill(block_hash, block.block_id, False, block.priority, held(block.block_id))
            self._spills.append(spill)
            owed.add(block_hash)

    def drain_spills(self) -> list[Spill]:
        """The blocks owed to the disk tier since the last call; the caller writes them before
        it runs any copy (one may overwrite a spilled block's slot or device block)."""
        spills, self._spills = self._spills, []
        return spills

    def take_disk_payload(self, block_id: int) -> object:
        """The KV of a queued "from_disk" copy into device block block_id."""
        return self._disk_payloads.pop(block_id)

    def queue(self, copy: BlockCopy) -> None:
        """A copy queued after the ones already owed."""
        self._queued.append(copy)

    def lend_hits(self, block_hashes: Sequence[int]) -> list[int]:
        """A prefix hit in the host tier: the slots of its blocks, lent until copied back (the
        next step waits for an offload still writing one of them)."""
        assert self.host_tier is not None
        slots = [self.host_tier.lend(block_hash) for block_hash in block_hashes]
        if self.write_behind is not None:
            for slot in slots:
                self.write_behind.read_slot(slot)
        return slots

    def reused(self, blocks: Iterable[KVBlock]) -> None:
        """Fresh device blocks: the next step waits for an offload still reading one of them."""
        if self.write_behind is not None:
            for block in blocks:
                self.write_behind.reuse_block(block.block_id)

    def committed(self, block: KVBlock) -> None:
        """A block just committed to the prefix cache: give it a host slot unless its hash has
        one (or it is a duplicate: no hash); its copy runs behind the step."""
        tier, block_hash = self.host_tier, block.block_hash
        if self.write_behind is None or tier is None or block_hash is None or tier.has(block_hash):
            return
        slot = tier.store(block_hash, block.priority)
        if slot is not None:
            self.write_behind.owe(BlockCopy(block.block_id, slot, "to_host"))

    def evicted(self, block: KVBlock, held: Held | None = None) -> None:
        """BlockPool.on_evict: a cached block leaves the device; it stays in the host tier
        (without one: it is spilled to the disk tier), its priority held as long as it was."""
        assert block.block_hash is not None
        if self.host_tier is None:
            self._spill_device(block, held)
            return
        owed = self.write_behind.take_owed(block.block_id) if self.write_behind else None
        if owed is not None:  # committed but never copied: before the step that reuses it
            self._queued.append(owed)
        if self.host_tier.has(block.block_hash):
            self.host_tier.refresh(block.block_hash, block.priority, held)
            return
        slot = self.host_tier.store(block.block_hash, block.priority, held)  # none free at commit
        if slot is not None:
            self._queued.append(BlockCopy(block.block_id, slot, "to_host"))
        elif self.disk_tier is not None:  # every host slot lent: straight to the disk tier
            self._spill_device(block, held)

    def _spill_device(self, block: KVBlock, held: Held | None) -> None:
        """A block leaving the device for the disk tier (its bytes read before any copy or step
        overwrites them)."""
        assert self.disk_tier is not None and block.block_hash is not None
        if self.disk_tier.has(block.block_hash):
            self.disk_tier.refresh(block.block_hash, block.priority, held)
        else:
            spill = Spill(block.block_hash, block.block_id, False, block.priority, held)
            self._spills.append(spill)

    def pin_copies(self, blocks: Sequence[KVBlock]) -> list[int]:
        """The host slots of the leading blocks whose copies are in the host tier, pinned
        (never evicted) until unpin."""
        assert self.host_tier is not None
        slots = []
        for block in blocks:
            if block.block_hash is None or not self.host_tier.has(block.block_hash):
                break
            slots.append(self.host_tier.pin(block.block_hash))
        return slots

    def unpin(self, slots: Iterable[int]) -> None:
        for slot in slots:
            assert self.host_tier is not None
            self.host_tier.release(slot)

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

    def drain_copies(self) -> list[BlockCopy]:
        """The block copies owed since the last call, in the order they must run; the caller
        queues them, in that order on one stream, before the next forward pass. The host slots
        they use are released here (stream order protects them from then on)."""
        copies, self._queued = self._queued, []
        if self.host_tier is not None:
            for copy in copies:
                if copy.kind == "to_host":
                    self.host_tier.release(copy.dst_block_id)
                elif copy.kind == "from_host":
                    self.host_tier.release(copy.src_block_id)
        return copies

    def drain_events(self) -> list[KVEvent]:
        """The host and disk tiers' KV events since the last call (each tier's in order)."""
        host = [] if self.host_tier is None else self.host_tier.drain_events()
        return host + ([] if self.disk_tier is None else self.disk_tier.drain_events())

    def check_integrity(self, pinned: Iterable[int] = ()) -> None:
        """pinned: the host slots kept blocks pin (KVCacheManager.keep)."""
        if self.disk_tier is not None:
            self.disk_tier.check_integrity()
            loads = {c.dst_block_id for c in self._queued if c.kind == "from_disk"}
            assert loads == set(self._disk_payloads), "disk loads out of step with their KV"
        if self.host_tier is None:
            return
        owed = {c.dst_block_id for c in self._queued if c.kind == "to_host"}
        owed |= {c.src_block_id for c in self._queued if c.kind == "from_host"}
        if self.write_behind is not None:
            owed |= {c.dst_block_id for c in self.write_behind.owed.values()}
        self.host_tier.check_integrity(owed | set(pinned))
