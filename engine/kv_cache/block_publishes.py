"""BlockPublishes: a file tier's block writes running behind the step (the cluster-shared store's
publishes, the disk tier's writes). It owns a writer thread (with a files object of its own: its
own NIXL agent and staging buffer, never the one the engine thread's lookups and evictions use),
the writes queued, each with its own copy of the block's KV, and their outcomes until the engine
thread collects them. Torch-free: a payload is opaque here (the copy is the caller's function).

Publishing a block to an object store is a HEAD and a PUT of a whole block, tens of ms on a
remote store (a few ms on loopback); on the engine thread that time was every step's (the
publishing worker's TTFT p50 ~0.95 s against ~0.48 s with a shared directory; behind the step
~0.57 s: bench/RESULTS.md "KV tiers").
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
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
        what: str = "shared KV store: %d publishes queued, the store takes them slower than "
        "blocks reach the disk tier; blocks past that are not published (each worker computes "
        "them) while this lasts",
    ):
        """run: a publish on the writer's own files (raises OSError when the store refuses;
        anything else is a bug, raised on the engine thread by collect). copy: a block's KV as a
        payload of its own (the publisher's row is overwritten once a later step reuses its
        slot). max_queued: publishes not yet done at most (their copies held); past it a block
        is not published (best effort: recomputed where it is needed), unless wait_for_room."""
        self._run = run
        self._copy = copy
        self.max_queued = max(1, max_queued)
        self.wait_for_room = False  # a clean stop's flush: wait for the writer, drop nothing
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._what = what  # the warning when the queue is full (%d: max_queued)
        self._queued: dict[int, tuple[PublishJob, Future[Published]]] = {}
        self.num_issued = 0
        self.num_dropped = 0  # not published: the queue was full
        self._warned_full = False

    def start(self, job: PublishJob) -> bool:
        """Queue job (with a copy of its row); False when the block is queued already or the
        writer has max_queued publishes not done (not published)."""
        if job.block_hash in self._queued:
            return False
        while self._num_running() >= self.max_queued:
            if not self.wait_for_room:
                self._dropped()
                return False
            running = [f for _, f in self._queued.values() if not f.done()]
            wait(running, return_when=FIRST_COMPLETED)
        job = job._replace(row=self._copy(job.row))
        self._queued[job.block_hash] = (job, self._pool.submit(self._run, job))
        self.num_issued += 1
        return True

    def _num_running(self) -> int:
        """Publishes queued and not done (done ones wait for collect, holding no room)."""
        return sum(1 for _, future in self._queued.values() if not future.done())

    def _dropped(self) -> None:
        self.num_dropped += 1
        if not self._warned_full:
            self._warned_full = True
            log.warning(self._what, self.max_queued)

    def row_of(self, block_hash: int) -> object | None:
        """The copy a queued write holds of block_hash's KV (None: not queued, or collected)."""
        queued = self._queued.get(block_hash)
        return None if queued is None else queued[0].row

    @property
    def num_queued(self) -> int:
        """Publishes not collected yet (done or not)."""
        return len(self._queued)

    def collect(self) -> list[Published]:
        """The publishes done since the last call, in the order they were queued (cancelled
        ones dropped). An error other than OSError is a bug: raised here."""
        landed = []
        for block_hash, (_, future) in list(self._queued.items()):
            if not future.done():
                break
            del self._queued[block_hash]
            if not future.cancelled():
                landed.append(future.result())
        return landed

    def settle(self, timeout_s: float = 60.0) -> list[Published]:
        """Wait until every queued publish is done (or timeout_s), then collect."""
        if self._queued:
            wait([future for _, future in self._queued.values()], timeout_s)
        return self.collect()

    def withdraw(self, dropped: Callable[[PublishJob], bool]) -> None:
        """The queued writes that dropped(job) says must not land (their blocks were evicted: by
        an operator, or the disk tier's bound): cancelled if not started (and forgotten: the same
        block may be queued again at once), else waited for (at most one runs; its outcome is
        collected as any other); once this returns none of them can land later."""
        for block_hash, (job, future) in list(self._queued.items()):
            if not dropped(job):
                continue
            if future.cancel():
                del self._queued[block_hash]
            else:
                wait([future])

    def close(self) -> list[Published]:
        """Stop the writer: the publish running finishes, those not started are dropped; returns
        the outcomes not collected yet."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        return self.collect()
