"""SharedStore's bookkeeping over a dict of files (one shared directory): one writer a block,
eviction by priority then age down to the low-water mark, a refused write logged once, bad
files removed and never staged; reads behind the step (BlockReads) staged when collected;
publishes behind the step (BlockPublishes) counted when collected, the bound kept by the writer;
BlockPool / HostTier / SaltIndex removal for `kvrelay kv evict`."""

from __future__ import annotations

import argparse
import contextlib
import logging
import threading
from functools import partial

import pytest

from deploy.engine_flags import add_engine_flags, add_model_args, engine_from_args
from engine.config import CacheConfig
from engine.kv_cache import block_publishes
from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.block_publishes import BlockPublishes, Published, PublishJob
from engine.kv_cache.block_reads import BlockReads
from engine.kv_cache.host_tier import HostTier
from engine.kv_cache.salt_index import SaltIndex
from engine.kv_cache.shared_store import ASK_BEHIND_S, WRITERS, SharedStore


class SharedDict:
    """Every worker's view of one shared directory: hash -> (payload, priority, mtime, root)."""

    def __init__(self) -> None:
        self.files: dict[int, tuple[object, int, float, int]] = {}
        self.clock = 0.0
        self.full = False

    def exists(self, block_hash: int) -> bool:
        return block_hash in self.files

    def publish(self, block_hash: int, row: object, priority: int, salt_root: int) -> bool:
        if self.full:
            raise OSError(28, "No space left on device")
        if block_hash in self.files:
            return False
        self.clock += 1
        self.files[block_hash] = (row, priority, self.clock, salt_root)
        return True

    def read(self, block_hash: int) -> object:
        if block_hash not in self.files:
            raise ValueError(f"{block_hash}: missing")
        row, priority, _, root = self.files[block_hash]
        if row == "bad":
            raise ValueError(f"{block_hash}: payload checksum mismatch")
        self.clock += 1
        self.files[block_hash] = (row, priority, self.clock, root)
        return row

    def remove(self, block_hash: int) -> None:
        self.files.pop(block_hash, None)

    def entries(self) -> list[tuple[int, float, int, int]]:
        return [(p, t, h, r) for h, (_, p, t, r) in self.files.items()]


def test_one_writer_a_block_across_workers() -> None:
    shared = SharedDict()
    a, b = SharedStore(100, shared), SharedStore(100, shared)
    assert a.publish(1, "kv1", 35) and not b.publish(1, "other", 35)
    assert shared.files[1][0] == "kv1"
    assert (a.num_published, b.num_published, b.num_found_published) == (1, 0, 1)
    assert b.lookup(1) and b.stage(1) and b.take(1) == "kv1" and b.num_hit_blocks == 1


def test_the_bound_evicts_lowest_priority_then_oldest_down_to_low_water() -> None:
    shared = SharedDict()
    store = SharedStore(10, shared)
    for h in range(10):
        store.publish(h, f"kv{h}", 80 if h < 3 else 35)
    store.stage(3)  # a hit makes 3 the newest of its priority
    other = SharedStore(10, shared)  # another worker finds the store at its bound
    assert other.num_files == 10
    other.publish(99, "kv99", 35)
    # down to 9 of 10 (LOW_WATER), then the new one: the oldest at priority 35 went
    assert set(shared.files) == {0, 1, 2, 3, 5, 6, 7, 8, 9, 99}
    assert other.num_evicted == 1 and other.num_files == 10


def test_eight_workers_publishing_at_once_keep_the_bound() -> None:
    """Each scans again after 1 / WRITERS of the room its last scan saw: however their publishes
    interleave, the store never holds more files than its bound."""
    shared = SharedDict()
    workers = [SharedStore(80, shared) for _ in range(WRITERS)]
    for h in range(1000):
        workers[h % WRITERS].publish(h, f"kv{h}", 35)
        assert len(shared.files) <= 80, h
    assert sum(w.num_evicted for w in workers) >= 1000 - 80


def test_a_full_store_is_logged_once_and_loses_nothing(caplog) -> None:
    shared = SharedDict()
    store = SharedStore(10, shared)
    shared.full = True
    with caplog.at_level(logging.WARNING, logger="engine.kv_cache.shared_store"):
        assert not store.publish(1, "kv1", 35) and not store.publish(2, "kv2", 35)
    assert store.num_write_failures == 2 and not shared.files
    assert caplog.text.count("cannot publish a block file") == 1


def test_a_bad_file_is_removed_and_never_staged() -> None:
    shared = SharedDict()
    shared.files[7] = ("bad", 35, 0.0, 0)
    store = SharedStore(10, shared)
    assert not store.stage(7) and not store.is_staged(7) and 7 not in shared.files
    assert store.num_bad_files == 1 and not store.stage(8)  # gone meanwhile: a miss, recomputed


def test_evict_by_salt_removes_any_workers_files_of_that_salt() -> None:
    shared = SharedDict()
    a, b = SharedStore(10, shared), SharedStore(10, shared)
    a.publish(1, "kv1", 35, salt_root=11)
    b.publish(2, "kv2", 35, salt_root=11)
    b.publish(3, "kv3", 35, salt_root=22)
    assert a.evict_salt(11) == 2 and set(shared.files) == {3}
    assert a.evict_hashes([3, 4]) == 1 and not shared.files


def test_pool_host_and_salt_index_drop_for_an_operators_eviction() -> None:
    pool = BlockPool(4)
    used, kept = pool.allocate(2)
    pool.cache_block(used, 100, None)
    pool.cache_block(kept, 101, 100)
    pool.free([used])  # 100 unreferenced, 101 in use
    assert pool.drop_cached([100, 101, 102]) == 2
    assert pool.lookup(100) is None and pool.lookup(101) is None
    assert pool.num_free_blocks == 3
    pool.free([kept])  # freed uncached
    pool.check_integrity()
    assert pool.num_free_blocks == 4 and pool.num_holding_blocks == 0
    host = HostTier(2)
    host.store(5, 35)
    host.release(0)
    host.store(6, 35)  # slot still lent: its copy is owed
    assert host.drop([5, 6]) == 1 and not host.has(5) and host.has(6)
    host.release(1)
    host.check_integrity()
    salts = SaltIndex(2)
    for h in (1, 2, 3):
        salts.record(h, 11, held=lambda h: h != 1)
    assert salts.hashes_of(11) == [2, 3] and salts.root_of(1) == 0  # pruned: in no tier
    salts.forget([2])
    assert salts.hashes_of(11) == [3]


def test_a_store_holds_at_least_one_block() -> None:
    with pytest.raises(ValueError, match="num_blocks=0"):
        SharedStore(0, SharedDict())


def test_shared_flags_and_config_name_what_is_wrong(tmp_path) -> None:
    p = argparse.ArgumentParser()
    add_model_args(p)
    add_engine_flags(p)
    flags = ["--disk-kv-gib", "1", "--disk-kv-path", str(tmp_path / "d")]
    shared = str(tmp_path / "s")
    args = p.parse_args([*flags, "--shared-kv-gib", "0.5", "--shared-kv-path", shared])
    cache = engine_from_args(args).cache
    assert cache.shared_kv_cache_bytes == 1 << 29 and cache.shared_kv_path == shared
    with pytest.raises(ValueError, match="shared_kv_path"):
        CacheConfig(shared_kv_cache_bytes=1 << 20)
    with pytest.raises(ValueError, match=r"shared_kv_cache_bytes needs a disk tier"):
        CacheConfig(shared_kv_cache_bytes=1 << 20, shared_kv_path="x")
    same_or_nested = [("x", "x"), ("x", "x/"), (str(tmp_path), "."), ("x", "x/y"), ("x/y", "x")]
    for disk, shared in same_or_nested:
        refused = pytest.raises(ValueError, match="shared_kv_path must differ from disk_kv_path")
        with refused, contextlib.chdir(tmp_path):
            CacheConfig(
                disk_kv_cache_bytes=1,
                disk_kv_path=disk,
                shared_kv_cache_bytes=1,
                shared_kv_path=shared,
            )
    with pytest.raises(ValueError, match="shared_kv_cache_bytes must be >= 0"):
        CacheConfig(shared_kv_cache_bytes=-1)


def test_reads_behind_the_step_land_between_steps_held_blocks_never_trimmed() -> None:
    """A reader held at a gate: fetch is pending until the read lands and collect stages it; a
    bad file lands as an error and is removed; a held block survives trim_staged."""
    shared = SharedDict()
    store = SharedStore(100, shared, block_bytes=1, max_staged_bytes=1)
    for block_hash, row in ((1, "kv1"), (2, "bad"), (3, "kv3")):
        store.publish(block_hash, row, 35)
    gate = threading.Event()

    def held_read(block_hash: int) -> object:
        gate.wait()
        return shared.read(block_hash)

    store.reads = BlockReads(held_read, "test-shared-read")
    assert [store.fetch(h) for h in (1, 2, 3)] == [None, None, None]
    store.collect()
    assert store.reads.num_in_flight == 3 and not store.is_staged(1)  # nothing landed
    assert store.fetch(1) is None and store.reads.num_issued == 3  # not issued twice
    gate.set()
    while store.reads.num_in_flight:
        store.reads.wait_any(1.0)
        store.collect()
    assert store.is_staged(1) and store.is_staged(3) and not store.is_staged(2)
    assert store.num_bad_files == 1 and not store.lookup(2) and store.num_reads == 3
    assert store.fetch(1) is True
    store.trim_staged(held={1})  # the bound is one block: the unheld one goes
    assert store.is_staged(1) and not store.is_staged(3)
    assert store.take(1) == "kv1"
    store.reads.close()


def test_a_slow_store_is_asked_behind_the_step_a_hit_runs_next_blocks_along() -> None:
    """A store that answered slower than ASK_BEHIND_S is asked on the reader thread: lookup
    returns None at once (the step is not held), the answers land at collect and are kept; a
    fast store is asked on the caller's thread, as before."""
    shared = SharedDict()
    store = SharedStore(100, shared)
    for block_hash in (1, 2, 3):
        store.publish(block_hash, f"kv{block_hash}", 35)
    assert store.lookup(1) is True and store.lookup(9) is False  # fast: asked here
    assert store.answer_s is not None and store.answer_s < ASK_BEHIND_S
    gate, asked_on = threading.Event(), []

    def slow_exists(block_hash: int) -> bool:
        asked_on.append(threading.current_thread().name)
        if not gate.wait(5.0):
            raise AssertionError("asked on the engine thread: the step would wait")
        return shared.exists(block_hash)

    store.reads = BlockReads(shared.read, "test-shared-read", exists=slow_exists)
    store.answer_s = 10 * ASK_BEHIND_S  # as measured of an object store's HEADs
    assert store.lookup(2, ahead=(3, 4)) is None  # asked behind, with the next two
    assert store.lookup(2) is None and store.reads.num_in_flight == 3  # not asked twice
    assert store.reads.in_flight(2)  # a waiting request holds it until the answer lands
    gate.set()
    while store.reads.num_in_flight:
        store.reads.wait_any(1.0)
        store.collect()
    assert asked_on == ["test-shared-read_0"] * 3
    assert [store.lookup(h) for h in (2, 3, 4)] == [True, True, False]  # kept: not asked again
    assert len(asked_on) == 3
    assert store.fetch(2) is None and store.lookup(2) is True  # being read: there
    store.reads.close()


def behind(
    store: SharedStore, shared: SharedDict, gate: threading.Event, max_queued: int = 4
) -> list[str]:
    """Give store a writer whose publishes wait at gate (on the writer's thread); returns the
    threads they ran on (one entry a publish written)."""
    threads: list[str] = []

    class GatedDict:  # the writer's own files: the same directory, its publishes held
        def __getattr__(self, name: str) -> object:
            return getattr(shared, name)

        def publish(self, block_hash: int, row: object, priority: int, salt_root: int) -> bool:
            gate.wait()
            threads.append(threading.current_thread().name)
            return shared.publish(block_hash, row, priority, salt_root)

    store.writes = BlockPublishes(
        partial(store.bound.publish, GatedDict()), lambda row: list(row), max_queued, "test-publish"
    )
    return threads


def test_publishes_behind_the_step_land_between_steps_and_keep_the_bound(caplog) -> None:
    """A publish returns at once (queued, with a copy of its row); it is counted, and its event
    recorded, when collected after it lands; past the queue's bound a block is not published
    (logged once); the size bound holds as without a writer; settle waits for every one."""
    shared = SharedDict()
    store = SharedStore(10, shared)
    store.record_events = True
    gate = threading.Event()
    threads = behind(store, shared, gate)
    row = ["kv", 1]
    assert store.publish(1, row, 35) is None
    row[1] = 2  # the spill's row is overwritten after the step: the queued copy is not
    assert store.publish(1, row, 35) is False  # queued already
    with caplog.at_level(logging.WARNING, logger="engine.kv_cache.block_publishes"):
        assert [store.publish(h, ["kv", h], 35) for h in (2, 3, 4, 5, 6)] == [None] * 3 + [
            False
        ] * 2
    assert caplog.text.count("publishes queued") == 1 and store.num_publish_dropped == 2
    store.collect()
    assert store.num_published == 0 and store.drain_events() == []  # nothing landed yet
    gate.set()
    store.settle()
    assert store.num_published == 4 and set(shared.files) == {1, 2, 3, 4}
    assert shared.files[1][0] == ["kv", 1]
    assert set(threads) == {"test-publish_0"}  # the writer's thread, never the caller's
    assert [e.block_hashes for e in store.drain_events()] == [(1,), (2,), (3,), (4,)]
    for h in range(100, 130):  # the bound, kept by the writer
        store.publish(h, ["kv", h], 35)
        store.settle()
    assert len(shared.files) <= 10 and store.num_evicted > 0
    assert store.num_files == len(shared.files)
    store.writes.close()


def test_an_operators_eviction_withdraws_the_publishes_queued(monkeypatch) -> None:
    """A block queued before `kvrelay kv evict` never lands after it: a publish not started is
    cancelled (no wait), the one running is waited for, others go on; an error other than
    OSError on the writer is a bug, raised on the engine thread."""
    shared = SharedDict()
    store = SharedStore(100, shared)
    gate = threading.Event()
    behind(store, shared, gate)
    assert [store.publish(h, ["kv", h], 35, salt_root=h) for h in (7, 8, 9)] == [None] * 3
    assert store.evict_hashes([8]) == 0  # queued behind 7 (held at the gate): cancelled
    assert store.evict_salt(9) == 0
    real_wait = block_publishes.wait

    def opening_wait(*args: object, **kwargs: object) -> object:
        gate.set()  # the eviction waits for the publish running: it may go on now
        return real_wait(*args, **kwargs)

    monkeypatch.setattr(block_publishes, "wait", opening_wait)
    assert store.evict_hashes([7]) == 1  # running: waited for, then removed
    store.settle()
    assert shared.files == {} and store.num_published == 1 and store.num_files == 0
    assert store.writes is not None
    store.writes.close()

    def broken(job: PublishJob) -> Published:
        raise RuntimeError("a bug in the writer")

    store.writes = BlockPublishes(broken, list, 4, "test-broken")
    assert store.publish(10, ["kv", 10], 35) is None
    with pytest.raises(RuntimeError, match="a bug in the writer"):
        store.settle()
    store.writes.close()


def test_done_publishes_hold_no_room_and_a_flush_drops_none() -> None:
    """The queue's bound counts publishes not done (those done wait for collect, holding no
    room); a clean stop's flush (flushing) waits for room instead of dropping a block."""
    shared = SharedDict()
    store = SharedStore(100, shared)
    gate = threading.Event()
    threads = behind(store, shared, gate, max_queued=2)
    gate.set()
    assert store.publish(1, ["kv", 1], 35) is None
    for _ in range(1000):  # until the writer has written it (not collected)
        if threads:
            break
        threading.Event().wait(0.01)
    assert [store.publish(h, ["kv", h], 35) for h in (2, 3)] == [None, None]
    assert store.num_publish_dropped == 0
    store.settle()
    gate.clear()
    threading.Timer(0.05, gate.set).start()  # only unblocks the writer: nothing depends on when
    with store.flushing():
        assert [store.publish(h, ["kv", h], 35) for h in range(4, 12)] == [None] * 8
    assert store.num_publish_dropped == 0 and store.num_published == 11
    assert set(shared.files) == set(range(1, 12))
    assert store.writes is not None
    store.writes.close()


def test_closing_the_store_counts_the_queued_publishes_then_runs_them_inline() -> None:
    """An engine's shutdown: the writer's queue lands and is counted, its thread stops, and a
    later publish (a second shutdown's flush) is written on the caller's thread."""
    shared = SharedDict()
    store = SharedStore(100, shared)
    gate = threading.Event()
    threads = behind(store, shared, gate)
    store.reads = BlockReads(shared.read, "test-shared-read")
    assert store.publish(1, ["kv", 1], 35) is None
    gate.set()
    store.close()
    assert store.num_published == 1 and store.writes is None and store.reads is None
    assert store.publish(2, ["kv", 2], 35) is True and threads == ["test-publish_0"]
    assert store.fetch(2) is True  # read at once, no reader thread
