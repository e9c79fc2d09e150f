"""DiskTier's bookkeeping (a dict stands in for its files: the tier is torch-free and sees only
opaque payloads), its reads behind the step (BlockReads), OwedCopies' spills into it, and the
block file format (DiskBlockFiles through NIXL's POSIX backend): checksums, layouts, truncation,
the restart scan."""

from __future__ import annotations

import argparse
import logging
import threading

import pytest
import torch

from deploy.cli import build_parser
from deploy.engine_flags import add_engine_flags, add_model_args, engine_from_args
from deploy.serve_flags import check_tier_paths, spec_from_args
from engine.config import CacheConfig, EngineConfig
from engine.execution.block_copies import BlockCopies
from engine.kv_cache.block_pool import BlockRemoved, BlockStored, KVBlock
from engine.kv_cache.block_publishes import BlockPublishes, Published, PublishJob
from engine.kv_cache.block_reads import BlockReads
from engine.kv_cache.disk_tier import DiskTier, Spill
from engine.kv_cache.host_tier import HostTier
from engine.kv_cache.owed_copies import OwedCopies
from kvtransfer.disk_blocks import (
    HEADER_BYTES,
    PRIORITY_TAG,
    BlockFileError,
    DiskBlockFiles,
    DiskLayout,
)


class DictFiles:
    """Block files in a dict; `full` refuses writes as a full disk does."""

    def __init__(self) -> None:
        self.files: dict[int, object] = {}
        self.priorities: dict[int, int] = {}  # what each file recorded
        self.full = False

    def write(self, block_hash: int, row: object, salt_root: int = 0, priority: int = 0) -> None:
        if self.full:
            raise OSError(28, "No space left on device")
        self.files[block_hash] = row
        self.priorities[block_hash] = priority

    def read(self, block_hash: int) -> object:
        if self.files.get(block_hash) == "bad":
            raise ValueError(f"{block_hash}: checksum mismatch")
        return self.files[block_hash]

    def remove(self, block_hash: int) -> None:
        self.files.pop(block_hash, None)

    def hint(self, block_hash: int) -> tuple[int, int] | None:
        return (self.priorities.get(block_hash, 0), 0) if block_hash in self.files else None

    def set_priority(self, block_hash: int, priority: int) -> None:
        if block_hash in self.files:
            self.priorities[block_hash] = priority


def put(tier: DiskTier, block_hash: int, priority: int = 35) -> bool:
    return tier.put(Spill(block_hash, 0, True, priority), f"kv{block_hash}")


def test_the_bound_evicts_by_priority_then_lru_and_removes_the_file() -> None:
    files = DictFiles()
    tier = DiskTier(3, files, record_events=True)
    assert put(tier, 1, priority=80) and put(tier, 2) and put(tier, 3)
    assert not put(tier, 2)  # here already
    assert tier.stage(2) and tier.take(2) == "kv2"  # 2 is now the newest of priority 35
    assert put(tier, 4)  # evicts 3: lowest priority, least recent
    assert set(files.files) == {1, 2, 4} and tier.num_evicted == 1
    assert put(tier, 5) and set(files.files) == {1, 4, 5}  # then 2; 80 outlives them
    events = tier.drain_events()
    assert BlockRemoved((3,), "disk") in events and BlockStored((5,), None, "disk") in events
    tier.check_integrity()


def test_a_bad_file_is_removed_and_logged_once(caplog) -> None:
    files = DictFiles()
    tier = DiskTier(8, files)
    for h in (1, 2, 3):
        put(tier, h)
    files.files[1] = files.files[2] = "bad"
    with caplog.at_level(logging.WARNING, logger="engine.kv_cache.disk_tier"):
        assert not tier.stage(1) and not tier.stage(2) and tier.stage(3)
    assert not tier.has(1) and not tier.has(2) and 1 not in files.files
    assert tier.num_bad_files == 2 and caplog.text.count("checksum mismatch") == 1
    assert tier.num_reads == 3 and tier.mean_load_s is not None
    tier.check_integrity()


def test_blocks_staged_for_a_match_not_admitted_are_kept_up_to_the_bound() -> None:
    files = DictFiles()
    tier = DiskTier(8, files, block_bytes=10, max_staged_bytes=20)
    for h in (1, 2, 3):
        put(tier, h)
        assert tier.stage(h)
    tier.trim_staged()  # room for two: the oldest is read again when matched again
    files.files[1] = files.files[3] = "bad"
    assert tier.stage(3) and not tier.stage(1)  # 3 was kept (checked already); 1 is re-read
    assert tier.num_reads == 4 and tier.take(2) == "kv2"
    tier.check_integrity()


def test_reads_behind_the_step_stage_when_collected_held_ones_survive_the_trim() -> None:
    """A reader held at a gate (a slow disk): fetch stays pending until collect stages the
    landed read; a bad file lands as an error and is removed; a block evicted while its read
    was in flight is neither staged nor counted bad; held blocks survive trim_staged."""
    files = DictFiles()
    tier = DiskTier(4, files, block_bytes=10, max_staged_bytes=10)
    for h in (1, 2, 3, 4):
        put(tier, h)
    files.files[2] = "bad"
    gate = threading.Event()

    def held_read(block_hash: int) -> object:
        gate.wait()
        return files.read(block_hash)

    tier.reads = BlockReads(held_read, "test-disk-read")
    assert [tier.fetch(h) for h in (1, 2, 3, 4)] == [None] * 4
    tier.hold((1, 3))
    tier.collect()
    assert tier.num_in_flight == 4 and tier.in_flight(1) and not tier.is_staged(1)
    put(tier, 5)  # at the bound: evicts 1, the oldest, while its read is in flight
    assert not tier.has(1)
    gate.set()
    while tier.num_in_flight:
        tier.wait_any(1.0)
        tier.collect()
    assert not tier.is_staged(1) and tier.is_staged(3) and tier.is_staged(4)
    assert tier.num_bad_files == 1 and not tier.has(2) and tier.num_reads == 4
    assert tier.fetch(3) is True and tier.reads.num_issued == 4
    tier.trim_staged()  # the bound is one block: 4 goes, 3 is held
    assert tier.is_staged(3) and not tier.is_staged(4)
    tier.release((1, 3))
    assert tier.num_held == 0 and tier.take(3) == "kv3"
    tier.check_integrity()
    tier.reads.close()


def test_a_full_disk_stores_nothing_and_says_so_once(caplog) -> None:
    files = DictFiles()
    tier = DiskTier(8, files)
    files.full = True
    with caplog.at_level(logging.WARNING, logger="engine.kv_cache.disk_tier"):
        assert not put(tier, 1) and not put(tier, 2)
    assert tier.num_cached == 0 and tier.num_write_failures == 2
    assert caplog.text.count("cannot write a block file") == 1
    files.full = False
    assert put(tier, 3) and tier.has(3)


def test_adopt_keeps_the_newest_files_up_to_the_bound() -> None:
    files = DictFiles()
    files.files = {h: f"kv{h}" for h in (10, 11, 12, 13)}
    tier = DiskTier(3, files)
    assert tier.adopt([10, 11, 12, 13], lambda _: 35) == 3
    assert set(files.files) == {11, 12, 13} and not tier.has(10)
    with pytest.raises(ValueError, match="num_blocks"):
        DiskTier(0, files)


def test_a_block_file_records_its_priority_and_a_restart_adopts_it_at_that() -> None:
    """A warm restart keeps the retention the blocks were spilled with: the block written at
    priority 80 outlives the default ones when the restarted tier must evict."""
    files = DictFiles()
    before = DiskTier(4, files)
    assert put(before, 1, priority=80) and put(before, 2) and put(before, 3)
    assert files.priorities == {1: 80, 2: 35, 3: 35}
    after = DiskTier(3, files)  # the restart: a new tier over the same files
    assert after.adopt([1, 2, 3], lambda h: files.priorities[h]) == 3
    assert put(after, 4)  # the bound: the lowest priority, oldest goes
    assert after.has(1) and not after.has(2) and after.has(3) and after.has(4)
    # a priority raised after the write is recorded too (the block left the host tier again)
    assert not put(after, 3, priority=90) and files.priorities[3] == 90
    # a restart onto a smaller bound drops the lowest priority, oldest files, not just the oldest
    smaller = DiskTier(2, files)
    assert smaller.adopt([1, 3, 4], lambda h: files.priorities[h]) == 2
    assert smaller.has(1) and smaller.has(3) and not smaller.has(4) and 4 not in files.files


def test_host_evictions_are_spilled_once_and_known_blocks_are_not_rewritten() -> None:
    host = HostTier(1)
    disk = DiskTier(4, DictFiles())
    owed = OwedCopies(host, write_behind=True, disk_tier=disk)
    assert host.store(100, 35) == 0
    host.release(0)
    assert host.store(200, 60) == 0  # evicts 100 from slot 0: owed to the disk tier
    assert owed.drain_spills() == [Spill(100, 0, True, 35)]
    put(disk, 200, priority=60)
    host.release(0)
    assert host.store(300, 35) == 0  # evicts 200, already on disk: no second write
    assert owed.drain_spills() == []


def test_device_evictions_spill_when_no_host_slot_can_take_them() -> None:
    host = HostTier(1)
    disk = DiskTier(4, DictFiles())
    owed = OwedCopies(host, write_behind=True, disk_tier=disk)
    assert host.store(100, 35) == 0  # its one slot lent (a copy into it still owed)
    owed.evicted(KVBlock(7, block_hash=200, priority=90))
    assert owed.drain_spills() == [Spill(200, 7, False, 90)]  # the device block, its priority
    alone = OwedCopies(None, disk_tier=disk)  # no host tier at all
    alone.evicted(KVBlock(3, block_hash=300))
    assert alone.drain_spills() == [Spill(300, 3, False, 35)]
    put(disk, 300)
    alone.evicted(KVBlock(3, block_hash=300, priority=60))  # on disk already: re-ranked only
    assert alone.drain_spills() == []
    disk.check_integrity()


def test_block_files_round_trip_and_refuse_bad_ones(tmp_path) -> None:
    kv = torch.randn(4, 2, 2, 2, 16, 8, dtype=torch.bfloat16)
    files = DiskBlockFiles(tmp_path, DiskLayout.of("m", kv), kv.dtype)
    files.write(7, kv[1], salt_root=5, priority=80)
    assert torch.equal(files.read(7), kv[1])
    assert files.hint(7) == (80, 5) and files.scan().priorities == {7: 80}  # evicting, restarts
    files.set_priority(7, 95)  # raised later: outside the checksums, the block still loads
    assert files.scan().priorities == {7: 95} and files.hint(7) == (95, 5)
    assert torch.equal(files.read(7), kv[1])
    raw = bytearray(files.path(7).read_bytes())
    tag_at = HEADER_BYTES - 16 - len(PRIORITY_TAG)
    raw[tag_at : tag_at + len(PRIORITY_TAG)] = bytes(len(PRIORITY_TAG))  # as written before the tag
    files.path(7).write_bytes(bytes(raw))
    found = files.scan()
    assert found.hashes == [7] and found.priorities == {}  # kept, at no recorded priority
    path = files.path(7)
    raw = bytearray(path.read_bytes())
    raw[HEADER_BYTES + 3] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(BlockFileError, match="payload checksum"):
        files.read(7)
    path.write_bytes(bytes(raw[:-1]))
    with pytest.raises(BlockFileError, match="bytes"):
        files.read(7)
    path.rename(files.path(8))  # a file under another block's name
    raw[HEADER_BYTES + 3] ^= 1
    files.path(8).write_bytes(bytes(raw))
    with pytest.raises(BlockFileError, match="holds block"):
        files.read(8)
    with pytest.raises(BlockFileError, match="missing"):
        files.read(9)


def test_the_scan_keeps_its_layout_and_counts_the_rest(tmp_path) -> None:
    kv = torch.randn(4, 2, 2, 2, 16, 8)
    files = DiskBlockFiles(tmp_path, DiskLayout.of("m", kv), kv.dtype)
    for h in (1, 2, 3):
        files.write(h, kv[h])
    files.path(3).write_bytes(files.path(3).read_bytes()[:100])  # truncated
    (files.dir / ".0000000000000004.1.tmp").write_bytes(b"cut short")
    other = DiskBlockFiles(tmp_path, DiskLayout.of("other-model", kv), kv.dtype)
    other.write(1, kv[1])
    assert other.dir != files.dir
    found = files.scan()
    assert sorted(found.hashes) == [1, 2]
    assert (found.num_invalid, found.num_other_layouts) == (2, 1)
    assert other.scan().hashes == [1]
    with pytest.raises(ValueError, match="kv_cache must be"):
        DiskLayout.of("m", kv[0])


def test_flags_and_config_name_what_is_wrong(tmp_path) -> None:
    p = argparse.ArgumentParser()
    add_model_args(p)
    add_engine_flags(p)
    args = p.parse_args(["--disk-kv-gib", "0.5", "--disk-kv-path", str(tmp_path)])
    cache = engine_from_args(args).cache
    assert cache.disk_kv_cache_bytes == 1 << 29 and cache.disk_kv_path == str(tmp_path)
    assert cache.file_tier_reads == "measured"  # serve's default
    always = p.parse_args(
        ["--kv-tier-reads", "always", "--disk-kv-gib", "0.5", "--disk-kv-path", str(tmp_path)]
    )
    assert engine_from_args(always).cache.file_tier_reads == "always"
    with pytest.raises(ValueError, match="--kv-tier-reads always needs --disk-kv-gib"):
        engine_from_args(p.parse_args(["--kv-tier-reads", "always"]))
    with pytest.raises(ValueError, match="file_tier_reads"):
        CacheConfig(file_tier_reads="sometimes")
    with pytest.raises(ValueError, match="disk_kv_path"):
        CacheConfig(disk_kv_cache_bytes=1 << 20)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        CacheConfig(disk_kv_cache_bytes=1, disk_kv_path="x", enable_prefix_caching=False)
    disk = CacheConfig(disk_kv_cache_bytes=1 << 20, disk_kv_path=str(tmp_path))
    assert EngineConfig(cache=disk, tensor_parallel_size=2).cache.disk_kv_cache_bytes  # each rank
    shared = CacheConfig(
        disk_kv_cache_bytes=1 << 20,
        disk_kv_path=str(tmp_path / "disk"),
        shared_kv_cache_bytes=1 << 20,
        shared_kv_path=str(tmp_path / "shared"),
    )
    with pytest.raises(ValueError, match="shared_kv_cache_bytes"):  # rank 0's heads only
        EngineConfig(cache=shared, tensor_parallel_size=2)


def test_a_tier_flag_without_the_flag_it_needs_is_refused_naming_both(tmp_path) -> None:
    p = argparse.ArgumentParser()
    add_model_args(p)
    add_engine_flags(p)
    refused = {  # each once served without its tier, silently
        ("--disk-kv-path", str(tmp_path)): "^--disk-kv-path needs --disk-kv-gib",
        ("--shared-kv-path", str(tmp_path)): "^--shared-kv-path needs --shared-kv-gib",
        ("--host-leases",): r"^--host-leases needs a host tier \(--host-kv-gib > 0\)",
        ("--disk-kv-gib", "1"): "^--disk-kv-gib needs --disk-kv-path",
    }
    for argv, message in refused.items():
        with pytest.raises(ValueError, match=message):
            engine_from_args(p.parse_args(list(argv)))


def test_a_host_tier_smaller_than_a_block_is_refused_not_dropped() -> None:
    kv_cache = torch.zeros(4, 2, 16, 32)  # 4 KiB a block
    assert BlockCopies(kv_cache, 4096).host is not None
    with pytest.raises(ValueError, match=r"host_kv_cache_bytes: 4095 bytes hold no block"):
        BlockCopies(kv_cache, 4095)


def test_serve_refuses_a_tier_folder_it_cannot_make_naming_the_flag(tmp_path) -> None:
    (tmp_path / "afile").write_text("")
    argv = ["serve", "--device", "cpu", "--disk-kv-gib", "1"]
    fine = spec_from_args(build_parser().parse_args([*argv, "--disk-kv-path", str(tmp_path / "d")]))
    check_tier_paths(fine)
    assert (tmp_path / "d").is_dir()
    bad = spec_from_args(
        build_parser().parse_args([*argv, "--disk-kv-path", str(tmp_path / "afile" / "d")])
    )
    with pytest.raises(ValueError, match=r"^--disk-kv-path .*afile/d: Not a directory"):
        check_tier_paths(bad)


class HeldFiles(DictFiles):
    """DictFiles whose writes wait until `go` is set (a slow disk), counting those written."""

    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()
        self.started = threading.Event()

    def write(self, block_hash: int, row: object, salt_root: int = 0, priority: int = 0) -> None:
        self.started.set()
        assert self.go.wait(30), "the test never let the write go"
        super().write(block_hash, row, salt_root, priority)


def writing_tier(files: DictFiles, max_queued: int = 8) -> DiskTier:
    """A tier whose files are written behind the step, on a writer of files (as disk_setup's)."""
    tier = DiskTier(4, files, record_events=True)

    def run(job: PublishJob) -> Published:
        try:
            files.write(job.block_hash, job.row, job.salt_root, job.priority)
        except OSError as e:
            return Published(job.block_hash, False, e, ())
        return Published(job.block_hash, True, None, ())

    tier.writes = BlockPublishes(run, lambda row: f"copy of {row}", max_queued, "test-disk-write")
    return tier


def test_a_write_behind_the_step_serves_its_block_from_its_copy_until_the_file_lands() -> None:
    """put returns at once while the disk is slow: the block is in the tier (indexed), a hit on
    it takes the copy being written (no file read), and the file lands once the disk lets it."""
    files = HeldFiles()
    tier = writing_tier(files)
    assert put(tier, 1) and tier.has(1) and tier.num_stored == 0  # counted once written
    assert tier.drain_events() == [BlockStored((1,), None, "disk")]
    assert files.started.wait(30) and 1 not in files.files  # its write is under way
    assert tier.in_hand(1) and tier.fetch(1) is True and tier.take(1) == "copy of kv1"
    assert tier.num_reads == 0 and tier.num_bad_files == 0
    files.go.set()
    tier.settle()
    assert files.files == {1: "copy of kv1"} and tier.writes is not None and tier.num_stored == 1
    assert tier.writes.num_queued == 0 and not tier.in_hand(1)
    assert tier.fetch(1) is True and tier.take(1) == "copy of kv1"  # now read from its file
    tier.close()


def test_a_priority_raised_while_the_write_is_queued_is_recorded_once_it_lands() -> None:
    """The block left the host tier again at 90 while its file was still being written at 35:
    the file is there to record it only once it lands (a warm restart adopts what it says)."""
    files = HeldFiles()
    tier = writing_tier(files)
    assert put(tier, 1, priority=35) and files.started.wait(30)
    tier.refresh(1, 90)  # no file yet: owed
    assert 1 not in files.priorities
    files.go.set()
    tier.settle()
    assert files.priorities[1] == 90 and files.files == {1: "copy of kv1"}
    tier.check_integrity()
    tier.close()


def test_an_evicted_blocks_write_behind_the_step_never_lands_later() -> None:
    """An operator's eviction (or the bound's) of a block whose write is queued cancels the write
    or waits for it before the file is removed: no file of an evicted block is left behind."""
    files = HeldFiles()
    tier = writing_tier(files)
    assert put(tier, 1) and put(tier, 2)
    assert files.started.wait(30)  # block 1's write runs, block 2's waits behind it
    threading.Timer(0.05, files.go.set).start()  # lets the running write end during evict
    assert tier.evict_hashes([1, 2]) == 2
    tier.settle()
    assert files.files == {} and not tier.has(1) and not tier.has(2)
    tier.close()


def test_a_write_the_disk_refuses_behind_the_step_takes_its_block_out_again(caplog) -> None:
    files = DictFiles()
    files.full = True
    tier = writing_tier(files)
    with caplog.at_level(logging.WARNING, logger="engine.kv_cache.disk_tier"):
        assert put(tier, 1) and put(tier, 2) and tier.num_cached == 2
        tier.settle()
    assert tier.num_cached == 0 and tier.num_stored == 0 and tier.num_write_failures == 2
    assert caplog.text.count("No space left on device") == 1  # said once
    assert BlockRemoved((1,), "disk") in tier.drain_events()
    tier.close()


def test_a_writer_past_its_queue_stores_nothing_more_and_close_drops_what_never_started() -> None:
    files = HeldFiles()
    tier = writing_tier(files, max_queued=2)
    assert put(tier, 1) and put(tier, 2)
    assert not put(tier, 3) and not tier.has(3)  # the writer is behind: best effort
    assert tier.writes is not None and tier.writes.num_dropped == 1
    assert files.started.wait(30)
    threading.Timer(0.05, files.go.set).start()
    tier.close()  # block 1's write (running) lands; block 2's never started: not in the tier
    assert files.files == {1: "copy of kv1"} and tier.has(1) and not tier.has(2)


def test_a_writer_past_its_queue_evicts_nothing_for_the_block_it_drops() -> None:
    files = HeldFiles()
    tier = writing_tier(files, max_queued=1)  # a 4-block tier
    files.go.set()
    for h in (1, 2, 3, 4):
        assert put(tier, h)
        tier.settle()
    files.go.clear()
    files.started.clear()
    assert put(tier, 5) and not tier.has(1)  # the bound: 1 goes for 5, whose write is held
    assert files.started.wait(30)
    assert not put(tier, 6) and tier.num_write_dropped == 1
    assert tier.num_cached == 4 and tier.has(2) and 2 in files.files  # none evicted for 6
    files.go.set()
    tier.close()
    assert sorted(files.files) == [2, 3, 4, 5]


def test_an_evicted_block_put_again_at_once_is_queued_and_an_old_read_of_it_is_not_bad() -> None:
    """A block dropped while a read of its old file runs and put again before that read lands:
    the new write is queued (the cancelled one is forgotten) and the stale read, which finds no
    file, is neither counted bad nor takes the block out; the copy being written serves it."""
    files = HeldFiles()
    files.go.set()
    tier = writing_tier(files)
    assert put(tier, 1)
    tier.settle()
    gate = threading.Event()

    def held_read(block_hash: int) -> object:
        assert gate.wait(30)
        return files.read(block_hash)

    tier.reads = BlockReads(held_read, "test-disk-read")
    assert tier.fetch(1) is None  # its read runs behind the step
    files.go.clear()
    files.started.clear()
    assert put(tier, 9) and files.started.wait(30)  # the writer is busy with 9's write...
    assert put(tier, 2)  # ...so 2's waits behind it, not started
    assert tier.evict_hashes([2]) == 1 and not tier.has(2)  # cancelled before it ran...
    assert put(tier, 2) and tier.has(2)  # ...so put at once again
    assert tier.evict_hashes([1]) == 1 and 1 not in files.files
    assert put(tier, 1)  # queued behind 9 and 2: no file yet
    gate.set()  # the old read lands: its file is gone
    while tier.num_in_flight:
        tier.wait_any(1.0)
        tier.collect()
    assert tier.num_bad_files == 0 and tier.has(1)
    assert tier.fetch(1) is True and tier.take(1) == "copy of kv1"
    files.go.set()
    tier.settle()
    assert sorted(files.files) == [1, 2, 9] and tier.num_stored == 4
    tier.close()
