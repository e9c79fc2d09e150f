"""engine.gc_heap: when the start-up heap is frozen (and the young generation's threshold
raised), and that a later engine's start-up frees what an earlier engine left in reference
cycles."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest
import torch

from engine import gc_heap


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


def test_a_cuda_engine_freezes_what_is_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(gc_heap.ENV, raising=False)
    alive = Cycle()
    frozen = gc_heap.freeze_heap(torch.device("cuda"))  # no CUDA call: runs on CPU machines
    assert frozen == gc.get_freeze_count() > 0
    # gc.get_objects() leaves out the frozen generation: the cycle is out of the walks.
    assert all(obj is not alive for obj in gc.get_objects())


def test_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(gc_heap.ENV, "0")
    assert gc_heap.freeze_heap(torch.device("cuda")) == 0
    assert gc.get_freeze_count() == 0


def test_bad_setting_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(gc_heap.ENV, "yes")
    with pytest.raises(ValueError, match="KVRELAY_GC_FREEZE must be 0 or 1"):
        gc_heap.freeze_heap(torch.device("cuda"))


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


def test_a_cuda_engine_raises_the_young_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(gc_heap.YOUNG_ENV, raising=False)
    gc.set_threshold(700, 10, 10)
    gc_heap.freeze_heap(torch.device("cpu"))
    assert gc.get_threshold() == (700, 10, 10)  # CPU engines leave it alone
    gc_heap.freeze_heap(torch.device("cuda"))
    assert gc.get_threshold() == (gc_heap.YOUNG_DEFAULT, 10, 10)
    monkeypatch.setenv(gc_heap.YOUNG_ENV, "700")
    gc_heap.freeze_heap(torch.device("cuda"))
    assert gc.get_threshold() == (700, 10, 10)


@pytest.mark.parametrize("raw", ["0", "-5", "lots", "3000000000"])
def test_a_bad_young_threshold_is_refused_before_anything_changes(
    monkeypatch: pytest.MonkeyPatch, raw: str
) -> None:
    monkeypatch.setenv(gc_heap.YOUNG_ENV, raw)
    before = gc.get_threshold()
    with pytest.raises(ValueError, match=r"KVRELAY_GC_YOUNG must be a whole number in 1\.\."):
        gc_heap.freeze_heap(torch.device("cuda"))
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
