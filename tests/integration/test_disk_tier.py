"""The disk KV tier end to end on CPU (tiny random checkpoints, NIXL's POSIX backend): a working
set ten times the device and host pools hits from disk token for token; a restarted engine finds
its blocks again; bad files are recomputed, never loaded; a full disk or a small bound loses no
request; salts and models never share a block."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from common.index_upkeep import make_publisher, worker_load
from engine.config import StartRefused
from engine.engine import Engine
from engine.kv_cache.block_reads import BlockReads
from engine.kv_cache.disk_tier import DiskTier
from engine.kv_cache.hashing import hash_blocks
from engine.sampling.sampling_params import SamplingParams
from kvtransfer.disk_blocks import SUFFIX, DiskBlockFiles
from router.prefix_index import PrefixIndex
from tests.conftest import build_engine
from tests.factories import make_tiny_checkpoint

BLOCK = 16
DEVICE_BLOCKS, HOST_BLOCKS = 10, 2
# float32, 2 layers x K and V x 2 KV heads x 16 positions x head_dim 16
BLOCK_BYTES = 2 * 2 * 2 * BLOCK * 16 * 4
GREEDY = SamplingParams(max_tokens=2, temperature=0.0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("disk") / "tiny-llama")


def prompts(n: int, num_blocks: int = 8, seed: int = 0) -> list[list[int]]:
    """n prompts of num_blocks full blocks and one token more (distinct from the first)."""
    rng = random.Random(seed)
    return [[rng.randrange(1, 512) for _ in range(num_blocks * BLOCK + 1)] for _ in range(n)]


def engine(
    model: Path,
    disk: Path | None,
    disk_blocks: int = 400,
    host: bool = True,
    max_num_seqs: int = 1,
    **more,
) -> Engine:
    tiers = {}
    if disk is not None:
        tiers = {"disk_kv_cache_bytes": disk_blocks * (4096 + BLOCK_BYTES), "disk_kv_path": disk}
    return build_engine(
        model_path=str(model),
        num_blocks=DEVICE_BLOCKS,
        host_kv_cache_bytes=HOST_BLOCKS * BLOCK_BYTES if host else 0,
        max_num_seqs=max_num_seqs,
        **tiers,
        **more,
    )


def serve(
    eng: Engine,
    batch: list[list[int]],
    salt: str | None = None,
    params: SamplingParams = GREEDY,
) -> list[tuple[list, int]]:
    """Each prompt alone, in order: (its tokens, its cached prompt tokens)."""
    got = []
    for i, prompt in enumerate(batch):
        eng.add_request(f"r{i}", prompt, params, cache_salt=salt)
        tokens, cached = [], None
        while eng.has_unfinished_requests:
            for out in eng.step():
                tokens.extend(out.new_token_ids)
                if out.finished:
                    cached = out.num_cached_tokens
        got.append((tokens, cached))
    if eng.kv.disk_tier is not None:
        eng.kv.disk_tier.settle()  # the writes behind the step landed (their files are there)
        if eng.kv.disk_tier.shared is not None:
            eng.kv.disk_tier.shared.settle()  # the publishes behind the step landed and counted
    eng.check_integrity()
    eng.assert_no_leaks()
    return got


def disk_of(eng: Engine) -> DiskTier:
    assert eng.kv.disk_tier is not None
    return eng.kv.disk_tier


def test_a_working_set_ten_times_the_pools_hits_from_disk_token_exact(tiny, tmp_path):
    batch = prompts(15)  # 120 full blocks: 10x the device and host pools (12)
    want = [tokens for tokens, _ in serve(engine(tiny, None), batch)]
    eng = engine(tiny, tmp_path / "disk")
    first = serve(eng, batch)
    assert [tokens for tokens, _ in first] == want
    disk = disk_of(eng)
    assert disk.num_cached >= 100, disk.num_cached
    again = serve(eng, batch)
    assert [tokens for tokens, _ in again] == want
    assert all(cached == 8 * BLOCK for _, cached in again[:12]), [c for _, c in again]
    assert disk.num_hit_blocks >= 80 and eng.kv.num_disk_hit_blocks == disk.num_hit_blocks
    assert disk.num_bad_files == 0
    snap = eng.snapshot()
    assert snap.num_disk_hit_blocks == disk.num_hit_blocks
    assert snap.num_disk_hit_bytes == disk.num_hit_blocks * BLOCK_BYTES
    assert snap.num_disk_stored_blocks == disk.num_stored >= 100
    assert snap.num_disk_cached_blocks == disk.num_cached and snap.disk_load_s > 0
    (disk_row,) = [tier for tier in snap.tiers if tier.tier == "disk"]
    assert disk_row.recent_load_s == disk.recent_load_s and disk_row.recent_load_s > 0


def test_measured_reads_keep_every_output_token_exact(tiny, tmp_path):
    """serve's default (file_tier_reads "measured"): each hit is read back or computed again
    as the gate finds the costs (a tiny model on CPU computes a block faster than a file is
    read, so most are computed); either way every output is token for token and nothing
    leaks; the gate was asked once for each of the 12 prompts whose blocks were on disk."""
    batch = prompts(15)
    want = [tokens for tokens, _ in serve(engine(tiny, None), batch)]
    eng = engine(tiny, tmp_path / "disk", file_tier_reads="measured")
    assert [tokens for tokens, _ in serve(eng, batch)] == want
    gate = eng.kv.prefix.gate
    assert gate is not None and engine(tiny, None).kv.prefix.gate is None  # "always": none
    again = serve(eng, batch)
    assert [tokens for tokens, _ in again] == want
    assert gate.num_asked >= 12 and disk_of(eng).num_passed_over <= gate.num_asked


def test_a_disk_hit_loads_behind_the_steps_of_other_requests(tiny, tmp_path):
    """Its reads are held back (a gate before the real reader): the other request decodes
    meanwhile; once they land the hit loads token for token, a corrupt block recomputed, and a
    request aborted while it waits holds nothing."""
    batch = prompts(6, seed=7)
    other = prompts(1, seed=8)[0]
    want_hit = serve(engine(tiny, None), batch[:1])[0][0]
    long = SamplingParams(max_tokens=6, temperature=0.0)
    want_other = serve(engine(tiny, None), [other], params=long)[0][0]
    eng = engine(tiny, tmp_path / "disk", max_num_seqs=2)
    serve(eng, batch)  # the first prompts' blocks have left the device and host for the disk
    disk = disk_of(eng)
    hashes = hash_blocks(batch[0], BLOCK, eng.model_id)
    assert all(disk.has(h) for h in hashes[:8])
    gate = threading.Event()
    files = disk.files
    assert isinstance(files, DiskBlockFiles)
    reader = DiskBlockFiles(files.root, files.layout, torch.float32)

    def held_read(block_hash: int) -> object:
        gate.wait()
        return reader.read(block_hash)

    disk.reads = BlockReads(held_read, "test-held-read")
    path = files.path(hashes[5])  # the hit's sixth block: a flipped payload byte
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x10
    path.write_bytes(bytes(raw))
    eng.add_request("hit", batch[0], GREEDY)
    eng.add_request("gone", batch[1], GREEDY)  # aborted while its reads are pending
    eng.add_request("other", other, long)
    tokens: dict[str, list[int]] = {"hit": [], "other": []}
    cached = {}

    def step() -> None:
        for out in eng.step():
            tokens[out.req_id].extend(out.new_token_ids)
            if out.finished:
                cached[out.req_id] = out.num_cached_tokens

    num_steps = 0
    while len(tokens["other"]) < 2 and num_steps < 10:
        step()
        num_steps += 1
    hit, gone = eng.scheduler.requests["hit"], eng.scheduler.requests["gone"]
    assert hit.pending_load and gone.pending_load and not tokens["hit"]
    assert len(tokens["other"]) >= 2  # decoded while the hit's reads were pending
    assert disk.num_held == 16
    assert eng.abort("gone") and disk.num_held == 8
    gate.set()
    while eng.has_unfinished_requests:
        step()
    assert tokens == {"hit": want_hit, "other": want_other}
    assert cached["hit"] == 5 * BLOCK  # the five blocks before the corrupt one
    assert disk.num_bad_files == 1 and not disk.has(hashes[5])
    eng.check_integrity()
    eng.assert_no_leaks()
    disk.reads.close()


def test_a_restarted_engine_hits_the_blocks_its_directory_holds(tiny, tmp_path, caplog):
    batch = prompts(5, seed=1)
    crashed = engine(tiny, tmp_path / "disk")
    want = [tokens for tokens, _ in serve(crashed, batch)]
    with caplog.at_level(logging.INFO, logger="engine.execution.disk_setup"):
        eng = engine(tiny, tmp_path / "disk")  # a crash: what had left the host tier is there
    assert "found 32 blocks" in caplog.text and disk_of(eng).num_cached == 32
    got = serve(eng, batch)
    assert [tokens for tokens, _ in got] == want
    assert [cached for _, cached in got] == [128, 128, 128, 128, 0]  # the last: on the device
    eng.shutdown()  # a clean stop writes what the device and host tiers held
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="engine.execution.disk_setup"):
        restarted = engine(tiny, tmp_path / "disk")
    assert "found 40 blocks" in caplog.text
    got = serve(restarted, batch)
    assert [tokens for tokens, _ in got] == want
    assert [cached for _, cached in got] == [128] * 5
    assert disk_of(restarted).num_hit_blocks == 40


def test_corrupt_and_truncated_files_are_recomputed_never_loaded(tiny, tmp_path, caplog):
    batch = prompts(5, seed=2)
    want = [tokens for tokens, _ in serve(engine(tiny, tmp_path / "disk"), batch)]
    files = sorted((tmp_path / "disk").rglob(f"*{SUFFIX}"))
    assert len(files) == 32  # the last prompt's 8 blocks never left the device
    for path in files[::2]:  # every other file: a flipped payload byte
        raw = bytearray(path.read_bytes())
        raw[-7] ^= 0x40
        path.write_bytes(bytes(raw))
    for path in files[1::4]:  # and some truncated after the restart's scan
        path.write_bytes(path.read_bytes()[: 4096 + 100])
    with caplog.at_level(logging.WARNING, logger="engine.kv_cache.disk_tier"):
        eng = engine(tiny, tmp_path / "disk")
        got = serve(eng, batch)
    assert [tokens for tokens, _ in got] == want
    disk = disk_of(eng)
    assert disk.num_bad_files > 0 and "checksum mismatch" in caplog.text
    assert caplog.text.count("disk KV tier:") == 1  # logged once


@contextlib.contextmanager
def small_tmpfs(path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs mounted at path, to fill (skips the test where none can be mounted)."""
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(path)], capture_output=True
    )
    if mounted.returncode:
        pytest.skip(f"no small tmpfs to fill here: {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def test_a_disk_bound_of_a_few_blocks_and_a_full_disk_lose_no_request(tiny, tmp_path, caplog):
    batch = prompts(4, seed=3)
    want = [tokens for tokens, _ in serve(engine(tiny, None), batch)]
    small = engine(tiny, tmp_path / "small", disk_blocks=3)
    assert [tokens for tokens, _ in serve(small, batch)] == want
    assert disk_of(small).num_cached == 3 and disk_of(small).num_evicted > 0
    assert len(list((tmp_path / "small").rglob(f"*{SUFFIX}"))) == 3
    with small_tmpfs(tmp_path / "full") as full:  # five block files of 12 KiB, far fewer
        eng = engine(tiny, full)  # than the blocks spilled
        with caplog.at_level(logging.WARNING, logger="engine.kv_cache.disk_tier"):
            assert [tokens for tokens, _ in serve(eng, batch)] == want
            assert [tokens for tokens, _ in serve(eng, batch)] == want
        disk_of(eng).close()  # gives its folder back (its lock file kept the mount busy)
    disk = disk_of(eng)
    assert disk.num_write_failures > 0 and 0 < disk.num_cached <= 5
    assert caplog.text.count("cannot write a block file") == 1, caplog.text
    assert "No space left on device" in caplog.text


def test_two_salts_never_share_a_disk_block(tiny, tmp_path):
    batch = prompts(3, seed=4)
    eng = engine(tiny, tmp_path / "disk")
    serve(eng, batch, salt="alice")
    disk = disk_of(eng)
    hits = disk.num_hit_blocks
    got = serve(eng, batch, salt="bob")
    assert all(cached == 0 for _, cached in got) and disk.num_hit_blocks == hits
    got = serve(eng, batch, salt="alice")
    assert all(cached > 0 for _, cached in got) and disk.num_hit_blocks > hits


def test_another_model_or_layout_ignores_the_old_files(tiny, tmp_path, caplog):
    batch = prompts(3, seed=5)
    serve(engine(tiny, tmp_path / "disk"), batch)
    num_old = len(list((tmp_path / "disk").rglob(f"*{SUFFIX}")))
    other = make_tiny_checkpoint(tmp_path / "tiny-llama", num_kv_heads=4)  # same name
    with caplog.at_level(logging.INFO, logger="engine.execution.disk_setup"):
        eng = engine(other, tmp_path / "disk")
    assert disk_of(eng).num_cached == 0 and num_old > 0
    assert f"ignored {num_old} of other models or layouts" in caplog.text
    got = serve(eng, batch)
    assert all(cached == 0 for _, cached in got) and disk_of(eng).num_hit_blocks == 0


def test_a_restarted_worker_publishes_its_disk_blocks_to_the_index(tiny, tmp_path, redis_url):
    batch = prompts(3, seed=6)
    first = engine(tiny, tmp_path / "disk", record_kv_events=True)
    serve(first, batch)
    first.shutdown()  # a clean stop: every block is on disk
    eng = engine(tiny, tmp_path / "disk", record_kv_events=True)  # the restart
    publisher = make_publisher(redis_url, "w", eng, "actor", "prefill", "")
    assert publisher is not None
    assert publisher.publish(eng.drain_kv_events(), worker_load(eng.snapshot()))
    hashes = hash_blocks(batch[0], BLOCK, eng.model_id)

    async def overlap():
        async with PrefixIndex(redis_url, eng.model_id, retry_interval_s=0.0) as index:
            return await index.prefix_overlap(hashes, ["w"])

    got = asyncio.run(overlap())
    assert got == {"w": 8} and got.disk == {"w": 8}  # credited as disk-tier blocks
    publisher.close()


def test_a_disk_tier_too_small_for_one_block_refuses_the_start(tiny, tmp_path):
    """Only the worker knows a block file's size (its model's layout): a tier too small for one
    is StartRefused, which the controller does not retry (every start would fail the same),
    and the claimed folder is given back for the next start."""
    with pytest.raises(StartRefused, match="disk_kv_cache_bytes: 100 bytes hold no block file"):
        build_engine(model_path=str(tiny), disk_kv_cache_bytes=100, disk_kv_path=tmp_path / "disk")
    eng = engine(tiny, tmp_path / "disk")  # the folder was given back: it can be claimed
    assert disk_of(eng).num_cached == 0
    eng.shutdown()
