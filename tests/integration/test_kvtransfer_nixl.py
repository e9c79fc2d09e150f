"""NixlTransfer between two real processes: block reads, handshake refusal, bad block ids.

Every NIXL agent lives in its own spawned process (`Peer`), driven over a pipe; this pytest
process never loads NIXL. Each peer holds a small KV tensor of 64 blocks (CPU unless its
PeerConfig says otherwise; tests/gpu reuses these helpers with CUDA tensors).
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import os
import pickle
import signal
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch

from kvtransfer.base import AgentMetadata, KVTransferError, Notification, TransferHandle
from kvtransfer.handshake import IncompatiblePeerError
from kvtransfer.nixl_transfer import NixlTransfer  # imports NIXL only when a tensor registers

NUM_BLOCKS = 64
CALL_TIMEOUT_S = 60.0
_CTX = mp.get_context("spawn")


@dataclass(frozen=True)
class PeerConfig:
    model_id: str = "tiny-llama"
    block_size: int = 4
    num_layers: int = 2
    num_kv_heads: int = 2
    head_dim: int = 8
    seed: int | None = None  # None: zeros, else random content from this seed
    timeout_s: float = 10.0
    ucx_tls: str | None = None  # None: kvtransfer picks
    device: str = "cpu"
    host_blocks: int = 0  # a host tier registered beside the KV tensor (random content)


# -- child side: one NixlTransfer per process ------------------------------------------------


class _PeerState:
    """The child's NixlTransfer and the KV tensor it registered."""

    def __init__(self, name: str, config: PeerConfig) -> None:
        self.name = name
        self.reset(config)

    def reset(self, config: PeerConfig) -> None:
        if getattr(self, "transfer", None) is not None:
            self.transfer.close()
        shape = (
            NUM_BLOCKS,
            config.num_layers,
            2,
            config.num_kv_heads,
            config.block_size,
            config.head_dim,
        )
        if config.seed is None:
            self.kv = torch.zeros(shape, device=config.device)
        else:
            gen = torch.Generator().manual_seed(config.seed)
            self.kv = torch.randn(shape, generator=gen).to(config.device)
        self.host = None
        if config.host_blocks:
            gen = torch.Generator().manual_seed((config.seed or 0) + 100)
            self.host = torch.randn((config.host_blocks, *shape[1:]), generator=gen)
            if config.device != "cpu":  # pinned, as a CUDA worker's host tier is
                self.host = self.host.pin_memory()
        self.transfer = NixlTransfer(config.model_id, self.name, timeout_s=config.timeout_s)
        self.transfer.register(self.kv, self.host)

    def metadata(self) -> AgentMetadata:
        return self.transfer.metadata()

    def add_peer(self, meta: AgentMetadata) -> str:
        return self.transfer.add_peer(meta)

    def read_and_wait(
        self,
        peer: str,
        remote_ids: Sequence[int],
        local_ids: Sequence[int],
        notif: bytes = b"",
        num_remote_host: int = 0,
    ) -> TransferHandle:
        handle = self.transfer.read(peer, remote_ids, local_ids, notif, num_remote_host)
        try:
            self.transfer.wait(handle)
        finally:
            self.transfer.release(handle)
        return handle

    def notify(self, peer: str, msg: bytes) -> None:
        self.transfer.notify(peer, msg)

    def block_bytes(self, block_ids: Sequence[int]) -> list[bytes]:
        return [self.kv[i].cpu().numpy().tobytes() for i in block_ids]

    def host_bytes(self, slots: Sequence[int]) -> list[bytes]:
        assert self.host is not None
        return [self.host[i].numpy().tobytes() for i in slots]

    def wait_notifs(self, count: int, timeout_s: float = 10.0) -> list[Notification]:
        notifs: list[Notification] = []
        deadline = time.monotonic() + timeout_s
        while len(notifs) < count and time.monotonic() < deadline:
            notifs += self.transfer.get_notifs()
        return notifs

    def num_open_handles(self) -> int:
        return self.transfer.num_open_handles

    def close(self) -> None:
        self.transfer.close()


def _serve(conn: Connection, name: str, config: PeerConfig) -> None:
    torch.set_num_threads(1)
    if config.ucx_tls is not None:
        os.environ["UCX_TLS"] = config.ucx_tls
    try:
        state = _PeerState(name, config)
    except Exception as e:
        conn.send(("err", _picklable(e)))
        return
    conn.send(("ok", None))
    while True:
        method, args = conn.recv()
        try:
            conn.send(("ok", getattr(state, method)(*args)))
        except Exception as e:
            conn.send(("err", _picklable(e)))
        if method == "close":
            return


def _picklable(e: Exception) -> Exception:
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(repr(e))


# -- parent side -----------------------------------------------------------------------------


class Peer:
    """A NixlTransfer in a spawned process; `call` runs one of _PeerState's methods there."""

    def __init__(self, name: str, config: PeerConfig) -> None:
        self.name = name
        self.conn, child_conn = _CTX.Pipe()
        self.proc = _CTX.Process(target=_serve, args=(child_conn, name, config), daemon=True)
        self.proc.start()
        child_conn.close()

    def started(self) -> Peer:
        self._recv()
        return self

    def call(self, method: str, *args: Any) -> Any:
        self.conn.send((method, args))
        return self._recv()

    def _recv(self) -> Any:
        if not self.conn.poll(CALL_TIMEOUT_S):
            raise TimeoutError(f"peer {self.name} did not answer in {CALL_TIMEOUT_S} s")
        status, value = self.conn.recv()
        if status == "err":
            raise value
        return value

    def stop(self) -> None:
        stop_peers([self])


def stop_peers(peers: Sequence[Peer]) -> None:
    """Close every peer's transfer (all at once), then make sure each process has exited."""
    for peer in peers:
        if peer.proc.is_alive() and not peer.conn.closed:
            with contextlib.suppress(OSError):
                peer.conn.send(("close", ()))
    for peer in peers:
        peer.proc.join(10)
        if peer.proc.is_alive():
            peer.proc.kill()
            peer.proc.join(10)
        peer.conn.close()
    assert not any(peer.proc.is_alive() for peer in peers)


def start_peers(configs: dict[str, PeerConfig]) -> dict[str, Peer]:
    """Spawn all peers at once (imports overlap), then wait until each has registered."""
    peers = {name: Peer(name, config) for name, config in configs.items()}
    try:
        for peer in peers.values():
            peer.started()
    except BaseException:
        stop_peers(list(peers.values()))
        raise
    return peers


@pytest.fixture(scope="module")
def peers() -> Iterator[dict[str, Peer]]:
    """holder (prefill side, random blocks), reader (decode side, zeros), stranger (varies)."""
    peers = start_peers(
        {
            "holder": PeerConfig(seed=1, host_blocks=16),
            "reader": PeerConfig(),
            "stranger": PeerConfig(seed=2),
        }
    )
    yield peers
    stop_peers(list(peers.values()))


@pytest.fixture
def holder(peers: dict[str, Peer]) -> Peer:
    return peers["holder"]


@pytest.fixture
def reader(peers: dict[str, Peer]) -> Iterator[Peer]:
    """The decode side, already shaken hands with holder; asserts no handle leaks after."""
    reader = peers["reader"]
    assert reader.call("add_peer", peers["holder"].call("metadata")) == "holder"
    yield reader
    assert reader.call("num_open_handles") == 0


def assert_blocks_equal(
    reader: Peer, local_ids: Sequence[int], holder: Peer, remote_ids: Sequence[int]
) -> None:
    assert reader.call("block_bytes", local_ids) == holder.call("block_bytes", remote_ids)


def test_read_pulls_non_adjacent_blocks(reader: Peer, holder: Peer) -> None:
    remote_ids = [1, 2, 3, 10, 40, 41, 63]
    local_ids = [5, 6, 7, 20, 0, 1, 30]
    before = reader.call("block_bytes", [8, 21])

    handle = reader.call("read_and_wait", "holder", remote_ids, local_ids)

    assert handle.num_blocks == 7
    assert handle.num_descs == 4  # 1-3->5-7, 10->20, 40-41->0-1, 63->30
    assert_blocks_equal(reader, local_ids, holder, remote_ids)
    assert reader.call("block_bytes", [8, 21]) == before  # untouched neighbours


def test_one_read_pulls_host_tier_slots_then_device_blocks(reader: Peer, holder: Peer) -> None:
    """A host lease: the first remote ids are slots of the holder's host tier (DRAM), the rest
    device blocks; one read, one notification once both parts are done."""
    handle = reader.call(
        "read_and_wait", "holder", [3, 4, 9, 50, 51], [40, 41, 42, 43, 44], b"host done", 3
    )
    assert handle.num_blocks == 5 and handle.num_descs == 3  # 3-4, 9 (host); 50-51 (device)
    host = holder.call("host_bytes", [3, 4, 9])
    assert reader.call("block_bytes", [40, 41, 42]) == host
    assert reader.call("block_bytes", [40, 41, 42]) != holder.call("block_bytes", [3, 4, 9])
    assert_blocks_equal(reader, [43, 44], holder, [50, 51])
    assert Notification("reader", b"host done") in holder.call("wait_notifs", 1)


def test_a_host_read_from_a_peer_without_a_host_tier_is_refused(peers: dict[str, Peer]) -> None:
    holder, stranger = peers["holder"], peers["stranger"]
    assert holder.call("add_peer", stranger.call("metadata")) == "stranger"
    with pytest.raises(ValueError, match="no host tier"):
        holder.call("read_and_wait", "stranger", [1], [1], b"", 1)
    with pytest.raises(ValueError, match="out of range"):
        holder.call("read_and_wait", "stranger", [1], [1], b"", 2)


def test_read_whole_pool_is_one_descriptor(reader: Peer, holder: Peer) -> None:
    ids = list(range(NUM_BLOCKS))
    handle = reader.call("read_and_wait", "holder", ids, ids)
    assert handle.num_descs == 1
    assert_blocks_equal(reader, ids, holder, ids)


def test_read_notifies_the_holder(reader: Peer, holder: Peer) -> None:
    reader.call("read_and_wait", "holder", [12], [12], b"req-7 done")
    notifs = holder.call("wait_notifs", 1)
    assert Notification("reader", b"req-7 done") in notifs


def test_a_notice_sent_before_a_read_reaches_the_holder_before_the_reads_own(
    reader: Peer, holder: Peer
) -> None:
    """The handoff's BEGIN notice (notify) then the READ's DONE notice, in that order."""
    for i in range(5):
        reader.call("notify", "holder", f"req-8.{i} begin".encode())
        reader.call("read_and_wait", "holder", [13 + i], [13 + i], f"req-8.{i} done".encode())
    notifs = [n for n in holder.call("wait_notifs", 10) if n.msg.startswith(b"req-8.")]
    expected = [f"req-8.{i} {kind}".encode() for i in range(5) for kind in ("begin", "done")]
    assert [n.msg for n in notifs] == expected and {n.peer for n in notifs} == {"reader"}
    with pytest.raises(ValueError, match="unknown peer 'nobody'"):
        reader.call("notify", "nobody", b"begin")


@pytest.mark.parametrize(
    ("remote_ids", "local_ids", "match"),
    [
        ([NUM_BLOCKS], [0], "remote block id 64 is out of range"),
        ([0], [NUM_BLOCKS + 5], "local block id 69 is out of range"),
        ([-1], [0], "remote block id -1 is out of range"),
        ([0, 1], [0], "pair up"),
    ],
)
def test_bad_block_ids_are_refused(
    reader: Peer, remote_ids: list[int], local_ids: list[int], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        reader.call("read_and_wait", "holder", remote_ids, local_ids)


def test_unknown_peer_is_refused(reader: Peer) -> None:
    with pytest.raises(ValueError, match="unknown peer 'nobody'"):
        reader.call("read_and_wait", "nobody", [0], [0])


@pytest.mark.parametrize(
    ("config", "field", "label"),
    [
        (PeerConfig(seed=2, block_size=8), "block_size", "block size: local 4 != remote 8"),
        (PeerConfig(seed=2, model_id="other-model"), "model_id", "model: local 'tiny-llama'"),
    ],
)
def test_handshake_mismatch_is_refused(
    peers: dict[str, Peer], reader: Peer, config: PeerConfig, field: str, label: str
) -> None:
    stranger = peers["stranger"]
    stranger.call("reset", config)
    with pytest.raises(IncompatiblePeerError, match=label) as info:
        reader.call("add_peer", stranger.call("metadata"))
    assert field in info.value.differences
    with pytest.raises(ValueError, match="unknown peer 'stranger'"):
        reader.call("read_and_wait", "stranger", [0], [0])


def stop_all_threads(pid: int) -> None:
    """SIGSTOP pid and return once every thread of it shows as stopped: the signal is only
    delivered at each thread's next scheduling point, and on a busy machine a UCX progress
    thread could still answer a READ posted right after the kill."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            path = f"/proc/{pid}/task/{task}/stat"
            with contextlib.suppress(FileNotFoundError), open(path) as stat:  # may have exited
                states.append(stat.read().rsplit(")", 1)[1].split()[0])
        if states and all(state in "tT" for state in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop within 10 s")


def test_stalled_then_dead_peer_fail_clearly() -> None:
    """Over tcp the holder must progress UCX for a READ to finish, so SIGSTOP stalls it."""
    tls = "tcp,self,cuda_copy" if torch.cuda.is_available() else "tcp,self"  # NIXL wants cuda_copy
    fragile = PeerConfig(seed=3, timeout_s=1.0, ucx_tls=tls)
    peers = start_peers({"doomed": fragile, "survivor": dataclasses.replace(fragile, seed=None)})
    doomed, survivor = peers["doomed"], peers["survivor"]
    try:
        survivor.call("add_peer", doomed.call("metadata"))
        survivor.call("read_and_wait", "doomed", [0], [0])
        stop_all_threads(doomed.proc.pid)
        try:
            with pytest.raises(KVTransferError, match=r"timed out after 1\.0 s"):
                survivor.call("read_and_wait", "doomed", [1, 2], [1, 2])
        finally:
            os.kill(doomed.proc.pid, signal.SIGCONT)
        survivor.call("read_and_wait", "doomed", [3], [3])  # a resumed peer serves again
        assert_blocks_equal(survivor, [0, 3], doomed, [0, 3])

        doomed.stop()
        with pytest.raises(KVTransferError, match="read from 'doomed' failed"):
            survivor.call("read_and_wait", "doomed", [4, 5], [4, 5])
        assert survivor.call("num_open_handles") == 0
    finally:
        stop_peers(list(peers.values()))
