"""BlockCopies: runs the block copies the KV cache manager owes, and owns the host tier's tensor
(pinned on CUDA), the offload stream and the copy-back stream. Copies a step needs (partial
reuse and n > 1 forks on the device, copies back from the host tier, an evicted block's offload
still owed) run in order before it: on the copy-back stream while the step in flight computes
when only host-tier copies are owed and none touches a block that step may still use (the new
step waits for them there), else on the step's stream. Committed blocks' copies into the host
tier run on the offload stream behind the steps, off their critical path. Blocks leaving the
host tier (or the device, without one) for the disk tier are written first, before any copy
that may overwrite them (synchronously, through the disk tier's NIXL files).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

import torch

from engine.kv_cache.block_copy import BlockCopy, can_run_ahead
from engine.kv_cache.disk_tier import Spill
from engine.kv_cache.manager import KVCacheManager


class DiskPayloads(Protocol):
    """Where run() finds a "from_disk" copy's KV (the engine's OwedCopies; a tensor-parallel
    follower's own RankDisk)."""

    def take_disk_payload(self, block_id: int) -> object: ...


class BlockCopies:
    def __init__(self, kv_cache: torch.Tensor, host_kv_cache_bytes: int):
        """kv_cache: [num_blocks, ...] one block per row; the host tier gets as many rows of the
        same shape as host_kv_cache_bytes holds (none for 0)."""
        self.kv_cache = kv_cache
        block_bytes = kv_cache[0].nbytes
        num_slots = host_kv_cache_bytes // block_bytes if host_kv_cache_bytes else 0
        if host_kv_cache_bytes and not num_slots:  # asked for a tier: none would be silent
            raise ValueError(
                f"host_kv_cache_bytes: {host_kv_cache_bytes} bytes hold no block "
                f"({block_bytes} bytes each)"
            )
        self.host: torch.Tensor | None = None
        self._offload_stream: torch.cuda.Stream | None = None
        self._offloaded: torch.cuda.Event | None = None  # recorded after the last offloads
        self._copy_back_stream: torch.cuda.Stream | None = None
        self._copied_back: torch.cuda.Event | None = None  # after the last copies run ahead
        self._queued: torch.cuda.Event | None = None
        self.copy_back_ahead = True  # False: every copy on the step's stream (benches compare)
        self.num_copies_ahead = 0  # copies run on the copy-back stream
        self.num_copies_in_step = 0  # copies run on the step's stream
        self.disk_payloads: DiskPayloads | None = None  # "from_disk" copies' KV, for run()
        if num_slots:
            self.host = torch.empty(
                (num_slots, *kv_cache.shape[1:]),
                dtype=kv_cache.dtype,
                pin_memory=kv_cache.is_cuda,
            )
            if kv_cache.is_cuda:
                self._offload_stream = torch.cuda.Stream(kv_cache.device)
                self._offloaded = torch.cuda.Event()
                self._copy_back_stream = torch.cuda.Stream(kv_cache.device)
                self._copied_back = torch.cuda.Event()
                self._queued = torch.cuda.Event()  # recorded to ask whether the steps ran
        # one block's copy back from the host tier, seconds, measured at start (0: no tier)
        self.host_copy_back_s = self._time_copy_back() if num_slots else 0.0

    def _time_copy_back(self, rounds: int = 3) -> float:
        """One block's copy from the host tier into device memory, seconds: the fastest of a
        few rounds of up to 8 copies of one block each, as run() copies a hit back (at start,
        every device block free: they get their own bytes back)."""
        assert self.host is not None
        n = min(8, self.host.shape[0], self.kv_cache.shape[0])
        self.host[:n].copy_(self.kv_cache[:n])
        best = float("inf")
        for _ in range(rounds):
            if self.kv_cache.is_cuda:
                torch.cuda.synchronize(self.kv_cache.device)
            start = time.perf_counter()
            for i in range(n):
                self.kv_cache[i].copy_(self.host[i], non_blocking=True)
            if self.kv_cache.is_cuda:
                torch.cuda.synchronize(self.kv_cache.device)
            best = min(best, (time.perf_counter() - start) / n)
        return best

    @property
    def num_host_slots(self) -> int:
        return 0 if self.host is None else self.host.shape[0]

    def run_owed(self, kv: KVCacheManager, wait: bool = False, writes: Sequence[int] = ()) -> None:
        """Before a step: the copies kv owes it, in order, after the offloads they must wait
        for (a reused block or a read slot still in flight); the step's stream waits for them.
        wait: return once all of them are done, and once the queued steps are if one may still
        write a block in `writes` (before a NIXL pull, which no stream orders, writes into
        those blocks); else the step is being launched."""
        self._spill(kv)
        behind = kv.owed.write_behind
        wait_offloads = False
        if behind is not None and behind.in_flight:
            if wait:
                self._sync_offloads()
                behind.settled()
            elif behind.must_wait:
                wait_offloads = True
                behind.settled()
            elif self._offloads_done():
                behind.settled()
        copies = kv.owed.drain_copies()
        self.disk_payloads = kv.owed
        if kv.disk_tier is not None:
            kv.disk_tier.trim_staged()
        freed = set() if wait else kv.pool.take_freed()
        ahead = self._copy_back_stream is not None and self.copy_back_ahead and not wait
        if ahead and copies and can_run_ahead(copies, set() if self._steps_done() else freed):
            self._run_ahead(copies, wait_offloads)
            return
        if wait_offloads:
            self._wait_for_offloads()
        self.run(copies, wait)
        if wait and self.kv_cache.is_cuda and kv.pool.freed_lately(writes):
            torch.cuda.current_stream(self.kv_cache.device).synchronize()
        self.num_copies_in_step += len(copies)
        if self._copy_back_stream is not None and any(c.kind != "device" for c in copies):
            # host slots these write or read: later copies run ahead come after them
            self._copy_back_stream.wait_stream(torch.cuda.current_stream(self.kv_cache.device))

    def _run_ahead(self, copies: list[BlockCopy], wait_offloads: bool) -> None:
        """The copies on the copy-back stream, at once (beside the step in flight); the work
        queued next on the step's stream waits for them."""
        stream, done = self._copy_back_stream, self._copied_back
        assert stream is not None and done is not None
        if wait_offloads:
            assert self._offloaded is not None
            stream.wait_event(self._offloaded)
        with torch.cuda.stream(stream):
            self.run(copies)
        done.record(stream)
        torch.cuda.current_stream(self.kv_cache.device).wait_event(done)
        self.num_copies_ahead += len(copies)

    def offload_owed(self, kv: KVCacheManager, sync: bool = False) -> None:
        """After a step: copy the blocks it committed into their host slots, on the offload
        stream, behind the work queued so far. sync: return once every offload is done (kept
        blocks' host slots are about to be read by another process)."""
        self._spill(kv)
        self._offload(kv.owed.drain_offloads())
        if sync:
            self._sync_offloads()

    def flush_to_disk(self, kv: KVCacheManager) -> None:
        """Write every cached block of the device and host tiers that the disk tier lacks (a
        clean shutdown: a restart finds them), once the copies in flight are done."""
        if kv.disk_tier is None:
            return
        kv.owed.spill_all(kv.pool.cached_blocks(), kv.pool.expiries.held)
        if self.kv_cache.is_cuda:
            torch.cuda.current_stream(self.kv_cache.device).synchronize()
        self._spill(kv)

    def _spill(self, kv: KVCacheManager) -> None:
        """Write the blocks owed to the disk tier, before any copy runs that may overwrite
        their host slot or device block (and after the offloads that filled those slots)."""
        spills = kv.owed.drain_spills()
        if not spills:
            return
        assert kv.disk_tier is not None
        if self.kv_cache.is_cuda:
            self._sync_offloads()
            torch.cuda.current_stream(self.kv_cache.device).synchronize()
        for spill in spills:
            kv.disk_tier.put(spill, self.spill_row(spill))

    def spill_row(self, spill: Spill) -> object:
        """The payload the disk tier writes for spill: its block's KV row."""
        if spill.from_host:
            assert self.host is not None
            return self.host[spill.src]
        return self.kv_cache[spill.src]

    def _offload(self, copies: list[BlockCopy]) -> None:
        if not copies:
            return
        assert self.host is not None
        if self._offload_stream is None:  # CPU: at once
            self.run(copies)
            return
        assert self._offloaded is not None
        self._offload_stream.wait_stream(torch.cuda.current_stream(self.kv_cache.device))
        with torch.cuda.stream(self._offload_stream):
            self.run(copies)
        self._offloaded.record(self._offload_stream)

    def run(self, copies: Sequence[BlockCopy], wait: bool = False) -> None:
        """Queue the copies in order on the current stream. wait: return once they are done."""
        cache, host = self.kv_cache, self.host
        for copy in copies:
            if copy.kind == "device":
                cache[copy.dst_block_id].copy_(cache[copy.src_block_id])
            elif copy.kind == "to_host":
                assert host is not None
                host[copy.dst_block_id].copy_(cache[copy.src_block_id], non_blocking=True)
            elif copy.kind == "from_disk":  # a checked CPU tensor of its own: copied at once
                assert self.disk_payloads is not None
                payload = self.disk_payloads.take_disk_payload(copy.dst_block_id)
                assert isinstance(payload, torch.Tensor)
                cache[copy.dst_block_id].copy_(payload)
            else:
                assert host is not None
                cache[copy.dst_block_id].copy_(host[copy.src_block_id], non_blocking=True)
        if wait and copies and cache.is_cuda:
            torch.cuda.current_stream(cache.device).synchronize()

    def _steps_done(self) -> bool:
        """Everything queued on the step's stream so far has run (no block freed since the
        last launch can still be written by a step)."""
        assert self._queued is not None
        self._queued.record(torch.cuda.current_stream(self.kv_cache.device))
        return self._queued.query()

    def _offloads_done(self) -> bool:
        return self._offloaded is None or self._offloaded.query()

    def _wait_for_offloads(self) -> None:
        if self._offloaded is not None:
            torch.cuda.current_stream(self.kv_cache.device).wait_event(self._offloaded)

    def _sync_offloads(self) -> None:
        if self._offloaded is not None:
            self._offloaded.synchronize()
