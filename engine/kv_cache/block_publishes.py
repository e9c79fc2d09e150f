"""BlockPublishes: the cluster-shared store's publishes running behind the step. It owns a writer
thread (with a files object of its own: its own NIXL agent and staging buffer, never the one the
engine thread's lookups and evictions use), the publishes queued, each with its own copy of the
block's KV, and their outcomes until the engine thread collects them. Torch-free: a payload is
opaque here (the copy is the caller's function).

Publishing a block to an object store is a HEAD and a PUT of a whole block, tens of ms on a
remote store (3 ms on loopback); on the engine thread that time was every step's (the publishing
worker's TTFT p50 799 against 396 ms with a shared directory, bench/RESULTS.md "KV tiers").
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import NamedTuple

log = logging.getLogger(__name__)


class PublishJob(NamedTuple):
    """One block to publish unless the store has it."""

    block_hash: int
    row: object  # the block's KV (queued: a copy of the publisher's own)
    priority: int
    salt_root: int


class Published(NamedTuple):
    """What a publish did: wrote the block (or found it there, wrote False), or failed (error: the
    store refused or did not answer); evicted: the files it removed first for the size bound."""

    block_hash: int
    wrote: bool
    error: OSError | None
    evicted: tuple[int, ...]


class BlockPublishes:
    """Publishes queued by the engine thread (start), done in order by one writer thread,
    collected by the engine thread (collect) between steps; only collect changes the store's
    counters and events."""

    def __init__(
        self,
        run: Callable[[PublishJob], Published],
        copy: Callable[[object], object],
        max_queued: int,
        name: str,
    ):
        """run: a publish on the writer's own files. copy: a block's KV as a payload of its own
        (the publisher's row is overwritten once the step that follows reuses its slot).
        max_queued: publishes queued at most (their copies held); past it a block is not
        published (best effort: recomputed where it is needed)."""
        self._run = run
        self._copy = copy
        self.max_queued = max(1, max_queued)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._queued: dict[int, Future[Published]] = {}
        self.num_issued = 0
        self.num_dropped = 0  # not published: the queue was full
        self._warned_full = False

    def start(self, job: PublishJob) -> bool:
        """Queue job (with a copy of its row); False when the queue is full (not published) or
        the block is queued already."""
        if job.block_hash in self._queued:
            return False
        if len(self._queued) >= self.max_queued:
            self.num_dropped += 1
            if not self._warned_full:
                self._warned_full = True
                log.warning(
                    "shared KV store: %d publishes queued, the store takes them slower than "
                    "blocks reach the disk tier; blocks past that are not published (each "
                    "worker computes them) while this lasts",
                    self.max_queued,
                )
            return False
        job = job._replace(row=self._copy(job.row))
        self._queued[job.block_hash] = self._pool.submit(self._run, job)
        self.num_issued += 1
        return True

    @property
    def num_queued(self) -> int:
        return len(self._queued)

    def queued(self, block_hash: int) -> bool:
        return block_hash in self._queued

    def collect(self) -> list[Published]:
        """The publishes done since the last call, in the order they were queued."""
        landed = []
        for block_hash, future in list(self._queued.items()):
            if not future.done():
                break
            del self._queued[block_hash]
            error = future.exception()
            if error is None:
                landed.append(future.result())
            else:  # a backend's own error type: a failed publish like a refused one
                failed = error if isinstance(error, OSError) else OSError(errno.EIO, repr(error))
                landed.append(Published(block_hash, False, failed, ()))
        return landed

    def settle(self, timeout_s: float = 60.0) -> list[Published]:
        """Wait until every queued publish is done (or timeout_s), then collect."""
        deadline = time.monotonic() + timeout_s
        if self._queued:
            wait(list(self._queued.values()), max(0.0, deadline - time.monotonic()))
        return self.collect()

    def close(self) -> None:
        """Stop the writer: the publish running finishes, those not started are dropped (as are
        the outcomes not collected)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._queued.clear()
