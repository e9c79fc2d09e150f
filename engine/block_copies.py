"""BlockCopies: runs, in order, the block copies the KV cache manager owes (partial reuse and
n > 1 forks on the device, offloads to and copies back from the host tier), and owns the host
tier's tensor (pinned on CUDA, so the copies are asynchronous on the step's stream).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.kv_cache.manager import BlockCopy


class BlockCopies:
    def __init__(self, kv_cache: torch.Tensor, host_kv_cache_bytes: int):
        """kv_cache: [num_blocks, ...] one block per row; the host tier gets as many rows of the
        same shape as host_kv_cache_bytes holds (none for 0)."""
        self.kv_cache = kv_cache
        block_bytes = kv_cache[0].nbytes
        num_slots = host_kv_cache_bytes // block_bytes if host_kv_cache_bytes else 0
        self.host: torch.Tensor | None = None
        if num_slots:
            self.host = torch.empty(
                (num_slots, *kv_cache.shape[1:]),
                dtype=kv_cache.dtype,
                pin_memory=kv_cache.is_cuda,
            )

    @property
    def num_host_slots(self) -> int:
        return 0 if self.host is None else self.host.shape[0]

    def run(self, copies: Sequence[BlockCopy], wait: bool = False) -> None:
        """Queue the copies in order on the current stream (before the step that needs them).
        wait: return once they are done (before a NIXL pull, which the stream does not order,
        writes into a block whose old KV an offload reads)."""
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
