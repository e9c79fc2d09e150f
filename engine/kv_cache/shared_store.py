"""SharedStore: a worker's view of the cluster-shared KV store (the tier below its disk tier). It
owns the blocks it read and checked for a prefix hit but has not copied back yet (staged), its
estimate of how many files the store holds (for the size bound), and its counters; the store
itself is the directory every worker shares (kvtransfer/shared_blocks.py) or the objects under
an S3 prefix (kvtransfer/object_blocks.py), both through NIXL, behind one small interface
(SharedFiles), so which blocks it holds is asked of the store, never remembered. Torch-free: a
block's KV is opaque here.

Whether the store has a block is asked of it for each prefix match that reaches it: on the
engine thread while the store answers within ASK_BEHIND_S (a local directory's stat), else
behind the step on the reader thread (an object store's HEAD is a round trip, which would hold
every request's step), the request waiting for the answer as it waits for reads; answers are
kept ANSWER_KEEP_S, and a run of hits asks its next blocks along (ASK_AHEAD at most).

A block is published when it reaches this worker's disk tier (DiskTier.put): once per block
cluster-wide (the first complete copy wins), behind the step (BlockPublishes: a writer thread
with its own files; its outcomes land in the counters and events between steps) or, without a
writer, at once. A prefix hit past the device, host and disk tiers
reads and checks the block's file (a bad one is removed and its block recomputed, never loaded)
and copies it into a fresh device block before the step, as a disk hit does. The size bound
holds files of num_blocks blocks: a writer that finds the store at its bound evicts the lowest
priority, then least recently used files down to LOW_WATER of it. Publishing is best effort: a
full filesystem or an object store that refuses a write (or cannot be reached) loses the
block (recomputed when needed), never a request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Container, Sequence
from typing import Protocol

from engine.kv_cache.block_pool import BlockRemoved, BlockStored, KVEvent
from engine.kv_cache.block_publishes import Published, PublishJob
from engine.kv_cache.file_stage import FileStage

log = logging.getLogger(__name__)

LOW_WATER = 0.9  # an eviction pass leaves the store this full (a pass scans the directory)
# Each worker scans the store again once it has published 1 / WRITERS of the room its last scan
# saw: up to WRITERS workers publishing at once stay within the bound (more pass it by at most
# (workers / WRITERS - 1) x the room below it, until their next scans).
WRITERS = 8


# A store whose answers (does it have a block?) take this long is asked behind the step.
ASK_BEHIND_S = 0.001
ANSWER_KEEP_S = 2.0  # an answer asked behind the step is trusted this long
ASK_AHEAD = 32  # at most this many of a hit run's next blocks asked along with one

# One file of the store as a scan saw it: (priority, modification time, block hash, salt root).
Entry = tuple[int, float, int, int]


class SharedFiles(Protocol):
    """The store's backend: files in a shared directory (kvtransfer.shared_blocks.
    SharedBlockFiles) or objects in an S3-compatible store (kvtransfer.object_blocks.
    ObjectBlockFiles). publish, remove and entries raise OSError when the store refuses."""

    def exists(self, block_hash: int) -> bool: ...

    def publish(self, block_hash: int, row: object, priority: int, salt_root: int) -> bool: ...

    def read(self, block_hash: int) -> object: ...  # raises an error for a bad file

    def remove(self, block_hash: int) -> None: ...

    def entries(self) -> list[Entry]: ...


class SharedStore(FileStage):
    NAME = "shared KV store"
    LOG = log

    def __init__(
        self,
        num_blocks: int,
        files: SharedFiles,
        read_errors: tuple[type[BaseException], ...] = (Exception,),
        block_bytes: int = 0,
        max_staged_bytes: int = 256 << 20,
    ):
        """num_blocks: the store's size bound (files of num_blocks blocks, all workers'
        together). read_errors: what files.read raises for a file that must not be loaded."""
        if num_blocks < 1:
            raise ValueError(
                f"a shared store holds at least one block, got num_blocks={num_blocks}"
            )
        super().__init__(files, read_errors)
        self.num_slots = num_blocks
        self.block_bytes = block_bytes
        self.max_staged = max_staged_bytes // block_bytes if block_bytes else 0
        self.record_events = False  # KV events (tier "shared") for the cluster index
        self._events: list[KVEvent] = []
        try:  # the store's size at start
            num_files = len(files.entries())
        except OSError as e:  # unreachable now: its first bound check scans it again
            log.warning(
                "%s: cannot list the store at start (%s); its size is taken as 0 until a scan",
                self.NAME,
                e,
            )
            num_files = 0
        # the size bound's accounting: the writer thread's while publishes run behind the step
        self.bound = StoreBound(num_blocks, num_files)
        self.num_published = 0  # blocks this worker wrote to the store
        self.num_found_published = 0  # blocks it would have published: another worker had
        self.num_hit_blocks = 0  # prefix blocks loaded from the store
        self.num_evicted = 0  # files this worker removed for the size bound
        self.num_removed = 0  # files removed on request (evict_hashes)
        self.answer_s: float | None = None  # the store's answer time (a moving average)
        self._answers: dict[int, tuple[bool, float]] = {}  # hash -> (present, monotonic time)

    def lookup(self, block_hash: int, ahead: Sequence[int] = ()) -> bool | None:
        """Whether the store has the block, for a prefix match: True for a block this worker has
        staged or is reading; else an answer kept from behind the step, or the store asked
        here (a HEAD on an object store), or, when it is slower than ASK_BEHIND_S and has a
        reader, None while it is asked behind the step, the blocks of `ahead` (the chain's next
        ones) asked along."""
        reads = self.reads
        if self.is_staged(block_hash) or (reads is not None and reads.reading(block_hash)):
            return True
        answer = self._answers.get(block_hash)
        if answer is not None:
            if time.monotonic() - answer[1] < ANSWER_KEEP_S:
                return answer[0]
            del self._answers[block_hash]  # stale: asked again below
        slow = self.answer_s is not None and self.answer_s >= ASK_BEHIND_S
        if reads is None or not reads.can_ask or not slow:
            return self._ask_here(block_hash)
        for each in (block_hash, *ahead):
            if each not in self._answers and not reads.in_flight(each):
                reads.ask(each)
        return None

    def _ask_here(self, block_hash: int) -> bool:
        start = time.perf_counter()
        present = self.files.exists(block_hash)
        self._note_answer_s(time.perf_counter() - start)
        return present

    def _note_answer_s(self, seconds: float) -> None:
        self.answer_s = seconds if self.answer_s is None else 0.8 * self.answer_s + 0.2 * seconds

    def _collect_answers(self) -> None:
        """The answers asked behind the step that came, kept ANSWER_KEEP_S (older ones go)."""
        now = time.monotonic()
        if self.reads is not None:
            for answer in self.reads.answers():
                self._answers[answer.block_hash] = (answer.present, now)
                self._note_answer_s(answer.seconds)
        stale = [h for h, (_, when) in self._answers.items() if now - when >= ANSWER_KEEP_S]
        for block_hash in stale:
            del self._answers[block_hash]

    def drain_events(self) -> list[KVEvent]:
        """Blocks this worker published to the store or removed from it since the last call
        (the publishes landed so far counted first)."""
        self.collect_writes()
        events, self._events = self._events, []
        return events

    def _removed(self, block_hash: int) -> None:
        self._answers.pop(block_hash, None)
        if self.record_events:
            self._events.append(BlockRemoved((block_hash,), "shared"))

    # ---- publishing -----------------------------------------------------------------------
    def publish(
        self, block_hash: int, row: object, priority: int, salt_root: int = 0
    ) -> bool | None:
        """Publish a block reaching this worker's disk tier unless the store has it. With a
        writer: queued (None; False when it is not: queued already, or the queue is full), its
        outcome counted when it lands (collect). Without one: True once written, False when the
        store has it or refused it (logged once: the block is recomputed when needed, no
        request is lost). salt_root: its cache_salt's chain root (0: none)."""
        job = PublishJob(block_hash, row, priority, salt_root)
        if self.writes is None:
            return self._landed(self.bound.publish(self.files, job))
        return None if self.writes.start(job) else False

    @property
    def num_files(self) -> int:
        """The store's size as this worker knows it: at its last scan, + its writes since."""
        return self.bound.num_files

    def collect(self) -> None:
        """Between steps: the reads, answers and publishes behind the step that are done."""
        super().collect()
        self._collect_answers()
        self.collect_writes()

    def settle(self, timeout_s: float = 60.0) -> None:
        """Wait for the publishes queued (or timeout_s) and count them."""
        super().settle(timeout_s)
        if self.writes is not None and self.writes.num_queued:
            log.warning(
                "%s: %d publishes still queued after %.0f s (a slow store); they land later or "
                "not at all",
                self.NAME,
                self.writes.num_queued,
                timeout_s,
            )

    def close(self) -> None:
        """Stop the reader and the writer (the publish running lands and is counted, those not
        started are dropped); later reads and publishes run on the caller's thread."""
        if self.reads is not None:
            self.reads.close()
        if self.writes is not None:
            for done in self.writes.close():
                self._landed(done)
        self.reads = self.writes = None

    @property
    def num_publish_dropped(self) -> int:
        """Blocks not published because the writer's queue was full."""
        return 0 if self.writes is None else self.writes.num_dropped

    def _landed(self, done: Published) -> bool:
        """A publish's outcome into the counters and events; True when it wrote its block."""
        for block_hash in done.evicted:
            self._staged.pop(block_hash, None)
            self._removed(block_hash)
        self.num_evicted += len(done.evicted)
        if done.error is not None:
            self._write_failed(
                done.error,
                "cannot publish a block file (%s); blocks are not shared (each worker "
                "recomputes them) while this lasts",
            )
            return False
        if not done.wrote:
            self.num_found_published += 1
            return False
        self.num_published += 1
        self._answers.pop(done.block_hash, None)
        if self.record_events:
            self._events.append(BlockStored((done.block_hash,), None, "shared"))
        return True

    def evict_salt(self, salt_root: int) -> int:
        """Remove every file of the salt whose chain root is salt_root (any worker's)."""
        self._withdraw(lambda job: job.salt_root == salt_root)
        return self.evict_hashes([e[2] for e in self.files.entries() if e[3] == salt_root])

    def evict_hashes(self, block_hashes: list[int]) -> int:
        """Remove these blocks' files (an operator's eviction); returns how many were there."""
        dropped = set(block_hashes)
        self._withdraw(lambda job: job.block_hash in dropped)
        removed = 0
        for block_hash in block_hashes:
            self._staged.pop(block_hash, None)
            if self.files.exists(block_hash):
                self.files.remove(block_hash)
                self._removed(block_hash)
                removed += 1
        self.num_removed += removed
        self.bound.removed(removed)
        return removed

    def _withdraw(self, dropped: Callable[[PublishJob], bool]) -> None:
        """Before an operator's eviction: the queued publishes of the blocks it drops never land
        after it (cancelled, or the one running waited for); the others go on."""
        if self.writes is not None:
            self.writes.withdraw(dropped)
            self.collect_writes()

    # ---- reading --------------------------------------------------------------------------
    def _forget_bad(self, block_hash: int) -> None:
        self.files.remove(block_hash)
        self._removed(block_hash)

    def take(self, block_hash: int) -> object:
        """A staged block's payload for its copy back."""
        self.num_hit_blocks += 1
        return self._staged.pop(block_hash)

    def trim_staged(self, held: Container[int] = ()) -> None:
        """Blocks read for a match that was not admitted: the newest kept up to the bound (and
        those held: a waiting request's, read behind the step)."""
        excess = len(self._staged) - self.max_staged
        if excess > 0:
            for block_hash in [h for h in self._staged if h not in held][:excess]:
                del self._staged[block_hash]


class StoreBound:
    """The store's size bound as one worker keeps it: how many files it holds at the last scan
    (after that scan's evictions), + this worker's writes since, - its removals on request. The
    writer thread publishes, the engine thread removes: the counts change under a lock."""

    def __init__(self, num_slots: int, num_files: int):
        self.num_slots = num_slots
        self.num_files = num_files
        self._scanned = num_files
        self._lock = threading.Lock()

    def publish(self, files: SharedFiles, job: PublishJob) -> Published:
        """job on files (the writer thread's, or the store's own): when this worker is at the
        bound or has written 1 / WRITERS of the room its last scan saw, first a scan of the store
        (every worker's files) that removes the lowest priority, least recently used ones down
        to LOW_WATER of the bound if it is at it; then the block written unless the store has it
        (files.publish asks: one HEAD for an object)."""
        evicted: list[int] = []
        with self._lock:
            rescan_after = max(1, (self.num_slots - self._scanned) // WRITERS)
            due = self.num_files >= self.num_slots or self.num_files - self._scanned >= rescan_after
        try:
            if due:
                entries = sorted(files.entries())
                keep = int(self.num_slots * LOW_WATER)
                excess = max(0, len(entries) - keep) if len(entries) >= self.num_slots else 0
                for _, _, block_hash, _ in entries[:excess]:
                    files.remove(block_hash)
                    evicted.append(block_hash)
                with self._lock:
                    self.num_files = self._scanned = len(entries) - excess
            wrote = files.publish(job.block_hash, job.row, job.priority, job.salt_root)
        except OSError as e:
            return Published(job.block_hash, False, e, tuple(evicted))
        with self._lock:
            self.num_files += wrote
        return Published(job.block_hash, wrote, None, tuple(evicted))

    def removed(self, num: int) -> None:
        """num files of the store removed on request."""
        with self._lock:
            self.num_files = max(0, self.num_files - num)
