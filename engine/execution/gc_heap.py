"""Keeps Python's cyclic garbage collector off a GPU engine's start-up heap and its steps' short-
lived objects; owns only whether it registered the unfreeze at exit.

With torch, Triton and FlashInfer imported and a model built, the heap holds hundreds of
thousands of objects that live as long as the process. A full collection walks all of them:
~110 ms on a small CPU with torch alone, 214 ms once in a 304-step CPU engine run
(bench.gc_pause_bench), taken on the thread that queues the GPU's next step, so the GPU runs
dry for whatever the pause exceeds the step it is already queued ahead by. gc.freeze() moves
every object alive into a generation the collector never walks; later objects (requests,
their outputs) are collected as before.

The young generation's threshold goes up too (YOUNG_THRESHOLD allocations, Python's is 700): a
step of a large batch leaves a few thousand objects alive until the step after it, so at 700
they outlived two collections, landed in the oldest generation and set off a full collection
every ~50 steps: 39 of them, 3.0 s in all, longest 116 ms, in a 55 s 8B fp8 offline run on an
H200, and none at 50,000 (53.2 s against 55.1; bench/RESULTS.md as of 31b779a).

A GPU engine calls thaw_heap() before it sizes its KV pool (what an earlier engine of the
process froze and has since dropped in reference cycles, its pool among it, is freed then,
not pinned for good) and freeze_heap() once it is built. At exit the frozen heap is handed
back so that finalizers run. CPU engines, which tests build many to a process, leave the
collector as Python sets it.
"""

from __future__ import annotations

import atexit
import gc

import torch

YOUNG_THRESHOLD = 50_000  # allocations between collections of the young generation
_unfreeze_registered = False


def thaw_heap(device: torch.device) -> None:
    """For an engine about to be built on a CUDA device: hand the frozen heap back to the
    collector and collect (nothing on other devices)."""
    if device.type == "cuda":
        gc.unfreeze()
        gc.collect()


def freeze_heap(device: torch.device) -> int:
    """freeze_now() for an engine just built on a CUDA device; 0, and nothing done, on other
    devices."""
    return freeze_now() if device.type == "cuda" else 0


def freeze_now() -> int:
    """Collect everything unreachable (the frozen heap included), then freeze what is left
    and raise the young generation's threshold (YOUNG_THRESHOLD); returns how many objects
    are frozen now."""
    global _unfreeze_registered
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, *gc.get_threshold()[1:])
    if not _unfreeze_registered:
        atexit.register(gc.unfreeze)
        _unfreeze_registered = True
    return gc.get_freeze_count()
