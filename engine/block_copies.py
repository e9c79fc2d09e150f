"""BlockCopies: runs the block copies the KV cache manager owes, and owns the host tier's tensor
(pinned on CUDA) and the offload stream. Copies a step needs (partial reuse and n > 1 forks on
the device, copies back from the host tier, an evicted block's offload still owed) run in
order on the step's stream before it; committed blocks' copies into the host tier run on the
offload stream behind the steps, off their critical path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.kv_cache.block_copy import BlockCopy
from engine.kv_cache.manager import KVCacheManager


class BlockCopies:
    def __init__(self, kv_cache: torch.Tensor, host_kv_cache_bytes: int):
        """kv_cache: [num_blocks, ...] one block per row; the host tier gets as many rows of the
        same shape as host_kv_cache_bytes holds (none for 0)."""
        self.kv_cache = kv_cache
        block_bytes = kv_cache[0].nbytes
        num_slots = host_kv_cache_bytes // block_bytes if host_kv_cache_bytes else 0
        self.host: torch.Tensor | None = None
        self._offload_stream: torch.cuda.Stream | None = None
        self._offloaded: torch.cuda.Event | None = None  # recorded after the last offloads
        if num_slots:
            self.host = torch.empty(
                (num_slots, *kv_cache.shape[1:]),
                dtype=kv_cache.dtype,
                pin_memory=kv_cache.is_cuda,
            )
            if kv_cache.is_cuda:
                self._offload_stream = torch.cuda.Stream(kv_cache.device)
                self._offloaded = torch.cuda.Event()

    @property
    def num_host_slots(self) -> int:
        return 0 if self.host is None else self.host.shape[0]

    def run_owed(self, kv: KVCacheManager, wait: bool = False) -> None:
        """Before a step: the copies kv owes it, in order on the current stream, after the
        offloads it must wait for (a reused block or a read slot still in flight). wait: return
        once all of them are done (before a NIXL pull, which no stream orders, writes into
        blocks)."""
        behind = kv.write_behind
        if behind is not None and behind.in_flight:
            if wait:
                self._sync_offloads()
                behind.settled()
            elif behind.must_wait:
                self._wait_for_offloads()
                behind.settled()
            elif self._offloads_done():
                behind.settled()
        self.run(kv.drain_copies(), wait)

    def offload_owed(self, kv: KVCacheManager, sync: bool = False) -> None:
        """After a step: copy the blocks it committed into their host slots, on the offload
        stream, behind the work queued so far. sync: return once every offload is done (a
        host lease's slots are about to be read by another process)."""
        self._offload(kv.drain_offloads())
        if sync:
            self._sync_offloads()

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
            else:
                assert host is not None
                cache[copy.dst_block_id].copy_(host[copy.src_block_id], non_blocking=True)
        if wait and copies and cache.is_cuda:
            torch.cuda.current_stream(cache.device).synchronize()

    def _offloads_done(self) -> bool:
        return self._offloaded is None or self._offloaded.query()

    def _wait_for_offloads(self) -> None:
        if self._offloaded is not None:
            torch.cuda.current_stream(self.kv_cache.device).wait_event(self._offloaded)

    def _sync_offloads(self) -> None:
        if self._offloaded is not None:
            self._offloaded.synchronize()
