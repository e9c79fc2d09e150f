"""NixlTransfer reads split into concurrent NIXL READs, between two real processes (CPU).

Reuses test_kvtransfer_nixl's peers; here each child builds its NixlTransfer with
max_parts_per_read=4 and a one-block min_part_bytes, so even small reads go in parts.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from multiprocessing.connection import Connection

import pytest

from kvtransfer.base import Notification
from kvtransfer.nixl_transfer import NixlTransfer
from tests.integration import test_kvtransfer_nixl as nixl_tests
from tests.integration.test_kvtransfer_nixl import (
    Peer,
    PeerConfig,
    assert_blocks_equal,
    stop_peers,
)

MAX_PARTS = 4
BLOCK_BYTES = 2 * 2 * 2 * 4 * 8 * 4  # PeerConfig's geometry, float32


def _serve_split(conn: Connection, name: str, config: PeerConfig) -> None:
    """The child process: test_kvtransfer_nixl's server, its NixlTransfer splitting reads."""
    nixl_tests.NixlTransfer = functools.partial(  # this child's copy of the module only
        NixlTransfer, max_parts_per_read=MAX_PARTS, min_part_bytes=BLOCK_BYTES
    )
    nixl_tests._serve(conn, name, config)


class SplitPeer(Peer):
    def __init__(self, name: str, config: PeerConfig) -> None:
        self.name = name
        self.conn, child_conn = nixl_tests._CTX.Pipe()
        self.proc = nixl_tests._CTX.Process(
            target=_serve_split, args=(child_conn, name, config), daemon=True
        )
        self.proc.start()
        child_conn.close()


@pytest.fixture(scope="module")
def peers() -> Iterator[dict[str, Peer]]:
    peers: dict[str, Peer] = {
        "holder": SplitPeer("holder", PeerConfig(seed=5)),
        "reader": SplitPeer("reader", PeerConfig()),
    }
    try:
        for peer in peers.values():
            peer.started()
        assert peers["reader"].call("add_peer", peers["holder"].call("metadata")) == "holder"
        yield peers
        assert peers["reader"].call("num_open_handles") == 0
    finally:
        stop_peers(list(peers.values()))


def test_split_read_moves_every_byte(peers: dict[str, Peer]) -> None:
    reader, holder = peers["reader"], peers["holder"]
    remote_ids = [*range(20, 30), 40, 50, 51]
    local_ids = [*range(10), 12, 14, 15]
    before = reader.call("block_bytes", [10, 11, 13])

    handle = reader.call("read_and_wait", "holder", remote_ids, local_ids)

    assert handle.num_blocks == 13
    assert handle.num_descs == 3  # coalesced descriptors, before cutting into parts
    assert_blocks_equal(reader, local_ids, holder, remote_ids)
    assert reader.call("block_bytes", [10, 11, 13]) == before  # untouched neighbours


def test_split_read_notifies_the_holder_once_after_completing(peers: dict[str, Peer]) -> None:
    reader, holder = peers["reader"], peers["holder"]
    reader.call("read_and_wait", "holder", list(range(8)), list(range(32, 40)), b"req-1 done")
    reader.call("read_and_wait", "holder", [60, 61, 62], [40, 41, 42], b"req-2 done")
    notifs = holder.call("wait_notifs", 2)

    # One message per read, in order: a duplicate of the first would arrive before the second.
    assert notifs == [Notification("reader", b"req-1 done"), Notification("reader", b"req-2 done")]
    assert_blocks_equal(reader, list(range(32, 40)), holder, list(range(8)))
