"""Host list -> tensor conversion for per-step index tables, copied to the GPU without waiting
for it (large ones through page-locked memory); owns no state (the page-locked blocks belong to
torch's caching host allocator).

torch.tensor() walks a Python list element by element (~1.6 ms for 30k ints); going through
a numpy array is ~4x faster, which matters for page tables rebuilt every step at large batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

_NUMPY_DTYPES = {torch.long: np.int64, torch.int32: np.int32}
# Measured on an H200 (bench.host_copy_bench): a non-blocking copy from pageable memory returned
# at once up to 1 MiB and waited for the queued kernels at 4 MiB; below the limit it is also
# cheaper on the host than pinning first (0.02-0.03 ms against 0.03-0.1 ms). But on the GPU a
# batch-768 decode step sat idle ~0.4 ms between two such pageable copies; page-locking every
# copy did not make the 8B fp8 offline run faster and left the GPU idle longer between steps.
PAGE_LOCK_FROM_BYTES = 1 << 20


def index_tensor(
    values: Sequence[int], dtype: torch.dtype = torch.long, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """An integer tensor of values (int64 or int32) on device."""
    host = torch.from_numpy(np.asarray(values, dtype=_NUMPY_DTYPES[dtype]))
    return to_device(host, device)


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Copy a host tensor to device without waiting for the GPU (see copy_from_host)."""
    if torch.device(device).type == "cpu":
        return host
    return page_locked(host).to(device, non_blocking=True)


def copy_from_host(dst: torch.Tensor, host: torch.Tensor) -> None:
    """dst.copy_(host), queued behind the GPU's work without the host waiting for it.

    From pageable memory a non-blocking copy is so only while the driver's own staging buffer
    holds it: past that, it first waits for the stream to drain, and planning step N+1 while
    step N runs would stall until N ends. A copy of PAGE_LOCK_FROM_BYTES or more goes from a
    page-locked block of torch's caching host allocator instead, which records the copy and
    reuses the block only after it has run.
    """
    if dst.device.type == "cpu":
        dst.copy_(host)
        return
    dst.copy_(page_locked(host), non_blocking=True)


def page_locked(host: torch.Tensor) -> torch.Tensor:
    """host itself when small or already page-locked, else a page-locked copy of it."""
    if host.is_pinned() or host.numel() * host.element_size() < PAGE_LOCK_FROM_BYTES:
        return host
    return host.pin_memory()
