"""EarlyAborts (common/early_aborts.py): an abort that came first is taken once by its
call, and entries are bounded in time and count."""

from __future__ import annotations

from common.early_aborts import EarlyAborts


def test_an_entry_is_taken_once_by_its_own_call() -> None:
    aborts = EarlyAborts(keep_s=30.0)
    aborts.add("a", now=0.0)
    assert not aborts.take("b", now=1.0)
    assert aborts.take("a", now=1.0)
    assert not aborts.take("a", now=1.0)  # used up
    assert len(aborts) == 0


def test_entries_expire_after_keep_s_and_the_oldest_go_past_the_bound() -> None:
    aborts = EarlyAborts(keep_s=30.0, max_entries=3)
    aborts.add("old", now=0.0)
    aborts.add("a", now=10.0)
    assert not aborts.take("old", now=30.0)  # kept 30 s, no longer
    assert aborts.take("a", now=39.0)
    for i, req_id in enumerate(["b", "c", "d", "e"]):
        aborts.add(req_id, now=50.0 + i)
    assert len(aborts) == 3
    assert not aborts.take("b", now=60.0)  # the oldest, dropped for "e"
    assert all(aborts.take(req_id, now=60.0) for req_id in ["c", "d", "e"])
    aborts.add("f", now=70.0)
    aborts.add("g", now=71.0)
    aborts.add("f", now=72.0)  # aborted again: its time is renewed
    assert not aborts.take("g", now=101.0) and aborts.take("f", now=101.0)
