"""Keeps Python's cyclic garbage collector off a GPU engine's start-up heap; owns only whether
it registered the unfreeze at exit (and reads KVRELAY_GC_FREEZE on each call).

With torch, Triton and FlashInfer imported and a model built, the heap holds hundreds of
thousands of objects that live as long as the process. A full collection walks all of them:
~110 ms on a small CPU with torch alone, ~220 ms in a CPU engine run at batch 512 (bench probe
in bench/RESULTS.md), taken on the thread that queues the GPU's next step, so the GPU runs dry
for whatever the pause exceeds the step it is already queued ahead by. gc.freeze() moves every
object alive now into a generation the collector never walks; later objects (requests, their
outputs) are collected as before.

freeze_heap() runs once an engine's device side is built. It first unfreezes and collects, so
that what an earlier engine of the same process left in reference cycles is freed, not pinned
for good; at exit the frozen heap is handed back so that finalizers run. KVRELAY_GC_FREEZE=0
leaves the collector as Python sets it.
"""

from __future__ import annotations

import atexit
import gc
import os

import torch

ENV = "KVRELAY_GC_FREEZE"
_unfreeze_registered = False


def wanted() -> bool:
    """KVRELAY_GC_FREEZE: "1" (default) freezes, "0" does not; other values are refused."""
    raw = os.environ.get(ENV, "1").strip()
    if raw not in ("0", "1"):
        raise ValueError(f"{ENV} must be 0 or 1, got {raw!r}")
    return raw == "1"


def freeze_heap(device: torch.device) -> int:
    """freeze_now() for an engine on a CUDA device; 0, and nothing done, on other devices or
    with KVRELAY_GC_FREEZE=0 (CPU engines are test and reference runs, many to a process)."""
    if device.type != "cuda" or not wanted():
        return 0
    return freeze_now()


def freeze_now() -> int:
    """Collect everything unreachable (the frozen heap included), then freeze what is left;
    returns how many objects are frozen now."""
    global _unfreeze_registered
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    if not _unfreeze_registered:
        atexit.register(gc.unfreeze)
        _unfreeze_registered = True
    return gc.get_freeze_count()
