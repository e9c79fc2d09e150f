"""DiskTier: the bookkeeping of a worker's disk KV tier (the third tier of the prefix cache). It
owns which block hashes have a file, each one's retention priority (and until when one held for a
while holds), the eviction order (priority, then LRU), the size bound, the blocks read and checked
for a prefix hit but not yet copied back (staged), and the tier's counters; the files are
BlockFiles' (kvtransfer/disk_blocks.py through NIXL). Torch-free: a block's KV is an opaque
payload here.

A block written here is also published to the cluster-shared store below it when one is configured
(SharedStore: once per block cluster-wide). A block reaches this tier when it leaves the host tier
(or the device pool, without a host tier): its spill is queued (OwedCopies) and written before
anything overwrites its bytes (BlockCopies). A prefix hit reads and checks the file when the request
is matched (a bad file is removed and its block recomputed, never loaded) and copies it into a fresh
device block before the step that reads it. With a reader (BlockReads: a tier of one rank) the
read runs behind the step instead: the match issues it (fetch), the request waits holding its
blocks' reads (hold: never trimmed) while others run, and once collect has them checked in,
its next match loads them. With a writer (BlockPublishes: a tier of one rank) a file is written
behind the step too, from a copy of the block's KV: the block is in the tier from put (counted,
indexed), a hit on it before its file lands takes that copy, an eviction waits for its write, and
a write the disk refuses removes it again when collected. On an H100 (the 8B shape), with the
2 MiB files written on the engine thread, prompts whose ~170 blocks spilled to disk had a TTFT of
250-315 ms against ~70 without the tier (bench/RESULTS.md "KV tiers"). Writing is best effort:
a full disk, or a writer past its queue, loses the block, never a request.

A priority held for a while (kv_retention's duration_s) ranks the block here until its deadline,
then the priority it falls back to; a file records the fallback (what a warm restart, whose clock
starts again, adopts), and the shared store ranks by it.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple, Protocol

from engine.kv_cache.block_pool import BlockRemoved, BlockStored, KVEvent
from engine.kv_cache.block_publishes import Published, PublishJob
from engine.kv_cache.block_reads import BlockReads
from engine.kv_cache.expiry import Expiries, Held, lasting
from engine.kv_cache.file_stage import FileStage
from engine.kv_cache.salt_index import SaltIndex
from engine.kv_cache.shared_store import SharedStore

log = logging.getLogger(__name__)


class BlockFiles(Protocol):
    """Where a disk tier's blocks live (kvtransfer.disk_blocks.DiskBlockFiles)."""

    def write(  # OSError
        self, block_hash: int, row: object, salt_root: int, priority: int
    ) -> None: ...

    def read(self, block_hash: int) -> object: ...  # raises an error for a bad file

    def remove(self, block_hash: int) -> None: ...

    def hint(self, block_hash: int) -> tuple[int, int] | None: ...  # (priority, salt root)

    def set_priority(self, block_hash: int, priority: int) -> None: ...  # recorded for restarts


class StageListener(Protocol):
    """Told when a staged block leaves the stage other than by removal (a tensor-parallel
    engine's other ranks keep their own heads of it: engine/parallel/disk_ranks.py)."""

    def taken(self, block_hash: int) -> None: ...  # lent to its copy back

    def unstaged(self, block_hash: int) -> None: ...  # dropped by the staging bound


class Spill(NamedTuple):
    """A block leaving the host tier (from_host: src is its host slot) or the device pool
    (src: its device block) for the disk tier, once its bytes are read."""

    block_hash: int
    src: int
    from_host: bool
    priority: int
    held: Held | None = None  # priority holds until held.until, then ranks as held.then

    @property
    def lasting_priority(self) -> int:
        """The priority that outlives this process (a file records it)."""
        return lasting(self.priority, self.held)


class DiskTier(FileStage):
    NAME = "disk KV tier"
    LOG = log

    def __init__(
        self,
        num_blocks: int,
        files: BlockFiles,
        record_events: bool = False,
        read_errors: tuple[type[BaseException], ...] = (Exception,),
        block_bytes: int = 0,
        max_staged_bytes: int = 256 << 20,
        clock: Callable[[], float] = time.monotonic,
    ):
        """num_blocks: the size bound (files of num_blocks blocks at most). read_errors: what
        files.read raises for a file that must not be loaded. block_bytes: one block's KV (for
        the byte counters). max_staged_bytes: blocks read for a match not admitted yet are kept
        up to this many bytes (a request waiting for memory does not re-read its files)."""
        if num_blocks < 1:
            raise ValueError(f"a disk tier holds at least one block, got num_blocks={num_blocks}")
        super().__init__(files, read_errors)
        self.num_slots = num_blocks
        self.record_events = record_events  # KV events (tier "disk") for the cluster index
        self.block_bytes = block_bytes
        self.max_staged = max_staged_bytes // block_bytes if block_bytes else 0
        # the cluster-shared store below this tier: every block written here is published
        self.shared: SharedStore | None = None
        self.salts: SaltIndex | None = None  # each salted block's salt root (for its files)
        self._events: list[KVEvent] = []
        self._by_priority: dict[int, OrderedDict[int, None]] = {}  # priority -> hashes, LRU first
        self._priority: dict[int, int] = {}  # hash -> priority
        self.expiries: Expiries[int] = Expiries(clock)  # hashes whose priority holds a while
        # hashes re-ranked while their write was queued: the file records the priority once
        # it lands (the queued job carries the one of its put)
        self._relabel: set[int] = set()
        # hash -> how many waiting requests hold its read (this tier's or the shared store's)
        self._held: dict[int, int] = {}
        self.listener: StageListener | None = None
        self.give_back_folder: Callable[[], None] | None = None  # for another worker (close)
        self.num_stored = 0  # blocks written (behind the step: once their files landed)
        self.num_hit_blocks = 0  # blocks loaded back on a prefix hit
        self.num_evicted = 0  # removed by the size bound

    @property
    def num_cached(self) -> int:
        return len(self._priority)

    def has(self, block_hash: int) -> bool:
        return block_hash in self._priority

    def cached_hashes(self) -> list[int]:
        return list(self._priority)

    def drain_events(self) -> list[KVEvent]:
        """This tier's KV events since the last call, then the shared store's."""
        events, self._events = self._events, []
        return events + ([] if self.shared is None else self.shared.drain_events())

    # ---- writing --------------------------------------------------------------------------
    def adopt(self, block_hashes: list[int], priority: Callable[[int], int]) -> int:
        """Files found at start (a warm restart), oldest first: tracked up to the bound, each
        at priority(its hash) (what its file recorded); past the bound the lowest priority,
        oldest ones are removed, as eviction would take them. Returns how many are kept."""
        ranked = {h: priority(h) for h in block_hashes}
        extra = max(0, len(block_hashes) - self.num_slots)
        age = {h: i for i, h in enumerate(block_hashes)}
        dropped = set(sorted(block_hashes, key=lambda h: (ranked[h], age[h]))[:extra])
        for block_hash in block_hashes:
            if block_hash in dropped:
                self.files.remove(block_hash)
            else:
                self._add(block_hash, ranked[block_hash])
        return len(block_hashes) - extra

    def put(self, spill: Spill, row: object) -> bool:
        """Write a spilled block's file (evicting the lowest-priority, oldest ones past the
        bound); False when it is here already, the disk refused it (logged once) or the writer
        behind the step is past its queue (logged once; nothing evicted for it)."""
        if spill.block_hash in self._priority:
            self.refresh(spill.block_hash, spill.priority, spill.held)
            return False
        salt_root = 0 if self.salts is None else self.salts.root_of(spill.block_hash)
        recorded = spill.lasting_priority
        if self.shared is not None:
            self.shared.publish(spill.block_hash, row, recorded, salt_root)
        if self.writes is not None:  # behind the step, from a copy of the row
            job = PublishJob(spill.block_hash, row, recorded, salt_root)
            if not self.writes.start(job):
                return False  # the writer is behind: not stored (recomputed when needed)
            while len(self._priority) >= self.num_slots:
                self._evict()  # its file goes now; the new one lands behind the step
        else:
            while len(self._priority) >= self.num_slots:
                self._evict()
            try:
                self.files.write(spill.block_hash, row, salt_root, recorded)
            except OSError as e:
                self._refused(e)
                return False
            self.num_stored += 1
        self._add(spill.block_hash, spill.priority, spill.held)
        return True

    @property
    def num_write_dropped(self) -> int:
        """Blocks not stored because the writer behind the step was past its queue."""
        return 0 if self.writes is None else self.writes.num_dropped

    def _refused(self, error: OSError) -> None:
        self._write_failed(
            error,
            "cannot write a block file (%s); blocks that leave the host tier are not stored "
            "(recomputed when needed) while this lasts",
        )

    def _landed(self, done: Published) -> None:
        """A write behind the step done: counted once written; one the disk refused takes its
        block out of the tier (no file)."""
        if done.error is None:
            self.num_stored += 1
            block_hash = done.block_hash
            if block_hash in self._relabel and self._pending_row(block_hash) is None:
                self._relabel.discard(block_hash)
                if block_hash in self._priority:
                    self._record_priority(block_hash)
            return
        self._refused(done.error)
        if done.block_hash in self._priority:
            self._drop(done.block_hash)

    def _pending_row(self, block_hash: int) -> object | None:
        """The copy of a block's KV whose file is still being written behind the step."""
        if self.writes is None or block_hash not in self._priority:
            return None
        return self.writes.row_of(block_hash)

    def refresh(self, block_hash: int, priority: int, held: Held | None = None) -> None:
        """The block left a faster tier again: it ranks by that priority (held for as long as
        it held there), newest; the priority that outlives this process is recorded in its
        file when it changed, for a warm restart (a write still queued records its own)."""
        old = self._priority[block_hash]
        old_held = self.expiries.cancel(block_hash)
        del self._by_priority[old][block_hash]
        self._rank(block_hash, priority, held)
        if lasting(priority, held) != lasting(old, old_held):
            if self._pending_row(block_hash) is not None:  # no file yet: once it lands
                self._relabel.add(block_hash)
            else:
                self._record_priority(block_hash)

    def _record_priority(self, block_hash: int) -> None:
        """Record in its file the priority that outlives this process (for a warm restart)."""
        recorded = lasting(self._priority[block_hash], self.expiries.held(block_hash))
        try:
            self.files.set_priority(block_hash, recorded)
        except OSError as e:  # the ranking holds; a restart would adopt the old one
            log.debug("disk KV tier: could not record block %016x's priority: %s", block_hash, e)

    def _add(self, block_hash: int, priority: int, held: Held | None = None) -> None:
        self._rank(block_hash, priority, held)
        if self.record_events:
            self._events.append(BlockStored((block_hash,), None, "disk"))

    def _rank(self, block_hash: int, priority: int, held: Held | None) -> None:
        self._priority[block_hash] = priority
        self._by_priority.setdefault(priority, OrderedDict())[block_hash] = None
        if held is not None and held.then != priority:
            self.expiries.hold(block_hash, held)

    def _evict(self) -> None:
        for block_hash, fallback in self.expiries.due():  # its file records fallback already
            del self._by_priority[self._priority[block_hash]][block_hash]
            self._rank(block_hash, fallback, None)
        for priority in sorted(self._by_priority):
            bucket = self._by_priority[priority]
            if bucket:
                block_hash, _ = bucket.popitem(last=False)
                self._drop(block_hash, priority)
                self.num_evicted += 1
                return
        raise AssertionError("disk tier full with no block to evict")

    def _drop(self, block_hash: int, priority: int | None = None) -> None:
        if priority is None:
            priority = self._priority[block_hash]
            del self._by_priority[priority][block_hash]
        del self._priority[block_hash]
        self.expiries.cancel(block_hash)
        self._relabel.discard(block_hash)
        self._staged.pop(block_hash, None)
        if self.writes is not None and self.writes.row_of(block_hash) is not None:
            # its write behind the step: cancelled, or waited for, before the file goes
            self.writes.withdraw(lambda job: job.block_hash == block_hash)
        self.files.remove(block_hash)
        if self.record_events:
            self._events.append(BlockRemoved((block_hash,), "disk"))

    def hashes_of_salt(self, salt_root: int) -> list[int]:
        """The blocks here whose file names salt_root as their salt's (a restart's too)."""
        return [h for h in self._priority if (self.files.hint(h) or (0, 0))[1] == salt_root]

    # ---- reading --------------------------------------------------------------------------
    def _holds(self, block_hash: int) -> bool:
        """Whether a read that landed is of a block held here, and of its file: not while a
        newer write of it is queued (the block was dropped and put again while the old read
        ran; the copy being written serves its hits)."""
        return block_hash in self._priority and self._pending_row(block_hash) is None

    def _forget_bad(self, block_hash: int) -> None:
        if block_hash in self._priority:
            self._drop(block_hash)

    def stage(self, block_hash: int) -> bool:
        """FileStage's, but a block whose file is still being written is staged from its copy."""
        row = self._pending_row(block_hash)
        if row is None:
            return super().stage(block_hash)
        self._staged[block_hash] = row
        return True

    def fetch(self, block_hash: int) -> bool | None:
        """FileStage's, but a block whose file is still being written is staged from its copy."""
        if self._pending_row(block_hash) is not None:
            return self.stage(block_hash)
        return super().fetch(block_hash)

    def in_hand(self, block_hash: int) -> bool:
        return self._pending_row(block_hash) is not None or super().in_hand(block_hash)

    def collect(self) -> None:
        """Between steps: the reads behind the step that are done, staged (a bad file removed,
        its block recomputed), this tier's and the shared store's; the writes that landed."""
        super().collect()
        self.collect_writes()
        if self.shared is not None:
            self.shared.collect()

    def _readers(self) -> list[BlockReads]:
        shared = None if self.shared is None else self.shared.reads
        return [r for r in (self.reads, shared) if r is not None]

    def in_flight(self, block_hash: int) -> bool:
        """Whether block_hash's read behind the step (here or in the shared store) is not done."""
        return any(reads.in_flight(block_hash) for reads in self._readers())

    @property
    def num_in_flight(self) -> int:
        return sum(reads.num_in_flight for reads in self._readers())

    def wait_any(self, timeout_s: float) -> None:
        """Block until a read behind the step is done (or timeout_s): no step has work."""
        busy = [reads for reads in self._readers() if reads.num_in_flight]
        if busy:
            busy[0].wait_any(timeout_s)

    def hold(self, block_hashes: tuple[int, ...]) -> None:
        """A waiting request's blocks read for it: kept staged (never trimmed) until release."""
        for block_hash in block_hashes:
            self._held[block_hash] = self._held.get(block_hash, 0) + 1

    def release(self, block_hashes: tuple[int, ...]) -> None:
        for block_hash in block_hashes:
            num = self._held[block_hash] - 1
            if num:
                self._held[block_hash] = num
            else:
                del self._held[block_hash]

    @property
    def num_held(self) -> int:
        return len(self._held)

    def take(self, block_hash: int) -> object:
        """A staged block's payload for its copy back (it stays in this tier, now newest)."""
        payload = self._staged.pop(block_hash)
        priority = self._priority[block_hash]
        self._by_priority[priority].move_to_end(block_hash)
        self.num_hit_blocks += 1
        if self.listener is not None:
            self.listener.taken(block_hash)
        return payload

    def trim_staged(self) -> None:
        """Blocks read for a match that was not admitted: the newest kept up to the bound
        (max_staged_bytes), the rest read again when matched again."""
        excess = len(self._staged) - self.max_staged
        if excess > 0:  # oldest first, those a waiting request holds aside
            for block_hash in [h for h in self._staged if h not in self._held][:excess]:
                del self._staged[block_hash]
                if self.listener is not None:
                    self.listener.unstaged(block_hash)
        if self.shared is not None:
            self.shared.trim_staged(self._held)

    def close(self) -> None:
        """Stop the reader threads (this tier's and the shared store's) and the writers (the
        write or publish running lands, those not started are dropped: a flush settled them
        first); later reads, writes and publishes run on the caller's thread."""
        if self.reads is not None:
            self.reads.close()
            self.reads = None
        if self.writes is not None:
            writes, self.writes = self.writes, None
            pending = [h for h in self._priority if writes.row_of(h) is not None]
            landed = writes.close()
            for done in landed:
                self._landed(done)
            written = {done.block_hash for done in landed if done.error is None}
            for block_hash in pending:  # not started: no file
                if block_hash not in written and block_hash in self._priority:
                    self._drop(block_hash)
        if self.shared is not None:
            self.shared.close()
        if self.give_back_folder is not None:
            self.give_back_folder()
            self.give_back_folder = None

    def evict_hashes(self, block_hashes: list[int]) -> int:
        """Remove these blocks' files here (an operator's eviction; the shared store's are the
        caller's to remove); returns how many this tier held."""
        held = [block_hash for block_hash in set(block_hashes) if block_hash in self._priority]
        for block_hash in held:
            self._drop(block_hash)
        return len(held)

    def snapshot_fields(self) -> dict[str, int | float]:
        """This tier's EngineSnapshot fields (the engine's summary of its counters)."""
        return {
            "num_disk_stored_blocks": self.num_stored,
            "num_disk_hit_blocks": self.num_hit_blocks,
            "num_disk_hit_bytes": self.num_hit_blocks * self.block_bytes,
            "num_disk_bad_files": self.num_bad_files,
            "num_disk_write_failures": self.num_write_failures,
            "num_disk_cached_blocks": self.num_cached,
            "disk_load_s": self.read_s,
            "num_disk_reads": self.num_reads,
        }

    def check_integrity(self) -> None:
        by_priority = sum(len(bucket) for bucket in self._by_priority.values())
        assert by_priority == len(self._priority), "disk eviction order out of step"
        assert set(self.expiries.keys()) <= set(self._priority), "a deadline for a block not here"
        assert self._relabel <= set(self._priority), "a relabel owed for a block not here"
        assert len(self._priority) <= self.num_slots, "disk tier past its bound"
        assert set(self._staged) <= set(self._priority), "a staged block left the disk tier"
