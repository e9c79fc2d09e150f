"""Per-step host -> GPU copies (execution/host_tensors.py): queued behind the GPU's work without
the host waiting for it, and correct when many are queued from short-lived host tensors."""

from __future__ import annotations

import pytest
import torch

from engine.execution.host_tensors import copy_from_host, index_tensor, to_device

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

SLEEP_CYCLES = 2_000_000_000  # ~1 s of one SM spinning: far longer than any copy call


def test_copy_does_not_wait_for_queued_work() -> None:
    """A 4 MiB table copied behind a long kernel: the call returns before that kernel ends (a
    plain non-blocking copy of this size from pageable memory waits for the stream first)."""
    table = torch.arange(1 << 20, dtype=torch.int32)  # pageable, as built by the planner
    dst = torch.empty_like(table, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    slept = torch.cuda.Event()
    slept.record()
    copy_from_host(dst, table)
    moved = to_device(table, "cuda")
    still_running = not slept.query()
    torch.cuda.synchronize()
    assert still_running, "the host waited for the queued kernel before copying"
    assert torch.equal(dst.cpu(), table) and torch.equal(moved.cpu(), table)


def test_queued_copies_from_dropped_host_tensors_stay_correct() -> None:
    """Many plans into one static buffer while the GPU is busy, each read by a kernel queued
    after it: every read sees its own plan's values, though each host tensor was dropped (its
    page-locked block returned to the cache) right after its copy was queued; small copies
    (pageable) interleaved keep their order too."""
    size = 200_000  # 1.6 MB: page-locked
    static = torch.zeros(size, dtype=torch.long, device="cuda")
    sums = torch.zeros(40, dtype=torch.long, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES // 10)
    for i in range(40):
        copy_from_host(static, index_tensor([i] * size))
        sums[i] = static.sum()
        on_device = index_tensor(range(i, i + 1000), device="cuda")
        sums[i] += on_device[-1] - (i + 999)  # adds 0 when this copy was right too
    torch.cuda.synchronize()
    assert sums.tolist() == [i * size for i in range(40)]
