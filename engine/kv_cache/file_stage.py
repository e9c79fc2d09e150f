"""FileStage: what a tier of block files (the disk tier, the cluster-shared store) has read and
checked for a prefix hit and not copied back yet (staged), read at match time or behind the step
(BlockReads), its writes behind the step (BlockPublishes: the subclass says what a landed one
does), and the counters: files read, time spent, bad files found, writes refused. A bad
file or a refused write is logged once; a bad file's block its subclass then forgets (recomputed,
never loaded); which blocks the tier holds is the subclass's. Torch-free: a block's KV is opaque
here."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from engine.kv_cache.block_publishes import BlockPublishes, Published
from engine.kv_cache.block_reads import BlockReads

log = logging.getLogger(__name__)

LOAD_DECAY = 0.1  # recent_load_s follows roughly the last ten reads


class FileStage:
    NAME = "KV block files"  # the tier in log lines
    LOG = log  # its subclass's module logger

    def __init__(self, files: Any, read_errors: tuple[type[BaseException], ...]):
        """files: the tier's (read(hash) -> payload, raising one of read_errors for a file that
        must not be loaded)."""
        self.files = files
        self.read_errors = read_errors
        self._staged: dict[int, object] = {}  # hash -> payload read for a hit, not yet taken
        # reads behind the step (None: at match time, as a tensor-parallel engine's ranks do)
        self.reads: BlockReads | None = None
        # writes behind the step (None: at once, on the caller's thread)
        self.writes: BlockPublishes | None = None
        self.num_reads = 0  # files read and checked for a prefix hit
        self.read_s = 0.0  # time spent reading and checking them (the tier's load cost)
        self.recent_load_s: float | None = None  # a read's seconds, decayed (None: none yet)
        self.num_bad_files = 0  # corrupt or truncated at load: removed and recomputed
        self.num_write_failures = 0  # not written: the filesystem refused (full)
        self.num_passed_over = 0  # matches whose hits here were computed: reading the slower
        self._warned_bad = self._warned_full = False

    def _landed(self, done: Published) -> object:
        """A write behind the step done: into the subclass's counters and events."""
        raise NotImplementedError

    @contextmanager
    def flushing(self, timeout_s: float = 60.0) -> Iterator[None]:
        """A clean stop's flush (every cached block spilled at once): a write waits for room in
        the writer's queue instead of being dropped; at the end every one lands (settle)."""
        if self.writes is None:
            yield
            return
        self.writes.wait_for_room = True
        try:
            yield
        finally:
            self.writes.wait_for_room = False
        self.settle(timeout_s)

    def collect_writes(self) -> None:
        """The writes behind the step that are done, landed (between steps)."""
        if self.writes is not None:
            for done in self.writes.collect():
                self._landed(done)

    def settle(self, timeout_s: float = 60.0) -> None:
        """Wait for the writes queued behind the step (or timeout_s) and collect them."""
        if self.writes is not None:
            for done in self.writes.settle(timeout_s):
                self._landed(done)

    def _holds(self, block_hash: int) -> bool:
        """Whether a read that landed is still of a block the tier holds (else it is dropped)."""
        return True

    def _forget_bad(self, block_hash: int) -> None:
        """Remove a block whose file must not be loaded (its records and its file)."""
        raise NotImplementedError

    def stage(self, block_hash: int) -> bool:
        """A prefix hit: read and check the block's file (kept until take); False, with the
        file removed (its block is recomputed), when it must not be loaded or is gone."""
        if block_hash in self._staged:
            return True
        start = time.perf_counter()
        try:
            self._staged[block_hash] = self.files.read(block_hash)
        except self.read_errors as e:
            self._count_read(time.perf_counter() - start, ok=False)
            self._bad_file(block_hash, e)
            return False
        self._count_read(time.perf_counter() - start, ok=True)
        return True

    def _count_read(self, seconds: float, ok: bool) -> None:
        """One read done; a good one's time goes into recent_load_s."""
        self.num_reads += 1
        self.read_s += seconds
        if ok:
            recent = self.recent_load_s
            self.recent_load_s = (
                seconds if recent is None else recent + LOAD_DECAY * (seconds - recent)
            )

    def fetch(self, block_hash: int) -> bool | None:
        """A prefix hit behind the step: True once staged, None while its read is in flight
        (issued now if it was not), False when its file must not be loaded (removed). Without a
        reader: stage()."""
        if self.reads is None:
            return self.stage(block_hash)
        if block_hash in self._staged:
            return True
        self.reads.start(block_hash)
        return None

    def collect(self) -> None:
        """Between steps: the reads behind the step that are done, staged (a bad file removed,
        its block recomputed)."""
        if self.reads is None:
            return
        for landed in self.reads.collect():
            self._count_read(landed.seconds, ok=landed.error is None)
            if not self._holds(landed.block_hash):
                continue  # evicted while it was read: nothing to stage or count as bad
            if landed.error is None:
                self._staged[landed.block_hash] = landed.payload
            elif isinstance(landed.error, self.read_errors):
                self._bad_file(landed.block_hash, landed.error)
            else:
                raise landed.error

    def is_staged(self, block_hash: int) -> bool:
        return block_hash in self._staged

    def in_hand(self, block_hash: int) -> bool:
        """Staged, or its read behind the step under way: its cost is paid or being paid."""
        reads = self.reads
        return block_hash in self._staged or (reads is not None and reads.reading(block_hash))

    @property
    def mean_load_s(self) -> float | None:
        """Measured seconds to read and check one block (None before the first read)."""
        return self.read_s / self.num_reads if self.num_reads else None

    def _write_failed(self, error: OSError, message: str) -> None:
        """A block file the filesystem refused: counted, logged once (message: what happened
        and what it costs, with a %s for the error)."""
        self.num_write_failures += 1
        if not self._warned_full:
            self._warned_full = True
            self.LOG.warning("%s: " + message, self.NAME, error)

    def _bad_file(self, block_hash: int, error: BaseException) -> None:
        self.num_bad_files += 1
        if not self._warned_bad:
            self._warned_bad = True
            self.LOG.warning("%s: %s; removed, its block is recomputed", self.NAME, error)
        else:
            self.LOG.debug("%s: %s; removed", self.NAME, error)
        self._forget_bad(block_hash)
