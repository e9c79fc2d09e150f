"""bench.lib.gc_pauses: collections are timed by generation, only while counting."""

from __future__ import annotations

import gc

from bench.lib.gc_pauses import GcPauses


def test_counts_collections_by_generation_while_installed() -> None:
    with GcPauses() as pauses:
        gc.collect(0)
        gc.collect(2)
    installed = pauses.summary()
    gc.collect(2)  # uninstalled: not seen
    assert pauses.summary() == installed
    assert installed[0]["count"] >= 1 and installed[2]["count"] >= 1
    assert installed[2]["max_ms"] > 0.0
    assert gc.callbacks.count(pauses) == 0


def test_counts_only_inside_counting_when_asked() -> None:
    with GcPauses(counting=False) as pauses:
        gc.collect(2)
        with pauses.counting():
            gc.collect(1)
        gc.collect(2)
    summary = pauses.summary()
    assert summary[2]["count"] == 0
    assert summary[1]["count"] >= 1
