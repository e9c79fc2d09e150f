"""Keeps Python's cyclic garbage collector off a GPU engine's start-up heap and its steps' short-
lived objects; owns only whether it registered the unfreeze at exit (and reads
KVRELAY_GC_FREEZE and KVRELAY_GC_YOUNG on each call).

With torch, Triton and FlashInfer imported and a model built, the heap holds hundreds of
thousands of objects that live as long as the process. A full collection walks all of them:
~110 ms on a small CPU with torch alone, 214 ms once in a 304-step CPU engine run
(bench.gc_pause_bench), taken on the thread that queues the GPU's next step, so the GPU runs
dry for whatever the pause exceeds the step it is already queued ahead by. gc.freeze() moves
every object alive into a generation the collector never walks; later objects (requests,
their outputs) are collected as before.

The young generation's threshold goes up too (KVRELAY_GC_YOUNG, default YOUNG_DEFAULT
allocations, Python's is 700): a step of a large batch leaves a few thousand objects alive
until the step after it, so at 700 they outlived two collections, landed in the oldest
generation and set off a full collection every ~50 steps: 39 of them, 3.0 s in all, longest
116 ms, in a 55 s 8B fp8 offline run on an H200 (bench/RESULTS.md, issue 12's tenth round).

A GPU engine calls thaw_heap() before it sizes its KV pool (what an earlier engine of the
process froze and has since dropped in reference cycles, its pool among it, is freed then,
not pinned for good) and freeze_heap() once it is built. At exit the frozen heap is handed
back so that finalizers run. CPU engines, which tests build many to a process, and
KVRELAY_GC_FREEZE=0 leave the collector as Python sets it.
"""

from __future__ import annotations

import atexit
import gc
import os

import torch

from engine.env_flags import on_off

ENV = "KVRELAY_GC_FREEZE"
YOUNG_ENV = "KVRELAY_GC_YOUNG"
YOUNG_DEFAULT = 50_000
YOUNG_MAX = 2**31 - 1  # gc.set_threshold takes a C int
_unfreeze_registered = False


def wanted() -> bool:
    """KVRELAY_GC_FREEZE: "1" (default) freezes, "0" does not; other values are refused."""
    return on_off(ENV, default=True)


def young_threshold() -> int:
    """KVRELAY_GC_YOUNG: allocations between collections of the young generation (default
    YOUNG_DEFAULT; a whole number in 1..YOUNG_MAX)."""
    raw = os.environ.get(YOUNG_ENV, str(YOUNG_DEFAULT)).strip()
    if not raw.isdecimal() or not 1 <= int(raw) <= YOUNG_MAX:
        raise ValueError(f"{YOUNG_ENV} must be a whole number in 1..{YOUNG_MAX}, got {raw!r}")
    return int(raw)


def _applies(device: torch.device) -> bool:
    return device.type == "cuda" and wanted()


def thaw_heap(device: torch.device) -> None:
    """For an engine about to be built on a CUDA device: hand the frozen heap back to the
    collector and collect (nothing on other devices or with KVRELAY_GC_FREEZE=0)."""
    if _applies(device):
        gc.unfreeze()
        gc.collect()


def freeze_heap(device: torch.device) -> int:
    """freeze_now() for an engine just built on a CUDA device; 0, and nothing done, on other
    devices or with KVRELAY_GC_FREEZE=0."""
    return freeze_now() if _applies(device) else 0


def freeze_now() -> int:
    """Collect everything unreachable (the frozen heap included), then freeze what is left
    and raise the young generation's threshold (young_threshold()); returns how many objects
    are frozen now."""
    global _unfreeze_registered
    young = young_threshold()  # a bad setting is refused before anything changes
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    gc.set_threshold(young, *gc.get_threshold()[1:])
    if not _unfreeze_registered:
        atexit.register(gc.unfreeze)
        _unfreeze_registered = True
    return gc.get_freeze_count()
