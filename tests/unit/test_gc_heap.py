"""engine.execution.gc_heap: when the start-up heap is frozen (and the young generation's threshold
raised), and that a later engine's start-up frees what an earlier engine left in reference
cycles."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest
import torch

from engine.execution import gc_heap


@pytest.fixture(autouse=True)
def unfrozen() -> Iterator[None]:
    thresholds = gc.get_threshold()
    gc.unfreeze()
    yield
    gc.unfreeze()  # the test process's heap goes back to the collector
    gc.set_threshold(*thresholds)


class Cycle:
    def __init__(self) -> None:
        self.me = self


def test_cpu_engines_leave_the_collector_alone() -> None:
    assert gc_heap.freeze_heap(torch.device("cpu")) == 0
    assert gc.get_freeze_count() == 0


def test_a_cuda_engine_freezes_what_is_alive() -> None:
    alive = Cycle()
    frozen = gc_heap.freeze_heap(torch.device("cuda"))  # no CUDA call: runs on CPU machines
    # Not compared with gc.get_freeze_count() read again: in the whole suite's process (Ray's
    # and earlier tests' threads alive) the count moved between two reads once (CI at 0783091:
    # 725,997 then 725,999); nothing else in the process calls gc.freeze(), cause not found.
    assert frozen > 0
    # gc.get_objects() leaves out the frozen generation: the cycle is out of the walks ...
    assert all(obj is not alive for obj in gc.get_objects())
    gc.unfreeze()  # ... and back in them once the heap is handed back
    assert any(obj is alive for obj in gc.get_objects())


def test_a_later_freeze_frees_the_cycles_an_earlier_one_pinned() -> None:
    earlier = Cycle()
    gone = weakref.ref(earlier)
    gc_heap.freeze_now()
    del earlier
    gc.collect()
    assert gone() is not None  # frozen: the collector does not walk it
    gc_heap.freeze_now()  # the next engine's start-up
    assert gone() is None


def test_a_cuda_engine_thaws_before_it_sizes_its_pool() -> None:
    earlier = Cycle()  # an earlier engine's objects, dropped while frozen
    gone = weakref.ref(earlier)
    gc_heap.freeze_now()
    del earlier
    gc_heap.thaw_heap(torch.device("cpu"))
    assert gone() is not None and gc.get_freeze_count() > 0  # CPU engines leave it alone
    gc_heap.thaw_heap(torch.device("cuda"))
    assert gone() is None
    assert gc.get_freeze_count() == 0


def test_a_cuda_engine_raises_the_young_threshold() -> None:
    gc.set_threshold(700, 10, 10)
    gc_heap.freeze_heap(torch.device("cpu"))
    assert gc.get_threshold() == (700, 10, 10)  # CPU engines leave it alone
    gc_heap.freeze_heap(torch.device("cuda"))
    assert gc.get_threshold() == (gc_heap.YOUNG_THRESHOLD, 10, 10) == (50_000, 10, 10)
