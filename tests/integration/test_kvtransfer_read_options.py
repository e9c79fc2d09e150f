"""NixlTransfer read options between two real processes (CPU): reads split into concurrent
NIXL READs, and a reader without a NIXL progress thread (its polling progresses UCX).

Reuses test_kvtransfer_nixl's peers; each child builds its NixlTransfer with the options of its
role. Split reads use max_parts_per_read=4 and a one-block min_part_bytes, so even small reads
go in parts; the holder always keeps its progress thread (tcp/sm need it on the read side).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

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

BLOCK_BYTES = 2 * 2 * 2 * 4 * 8 * 4  # PeerConfig's geometry, float32
SPLIT = {"max_parts_per_read": 4, "min_part_bytes": BLOCK_BYTES}
OPTIONS = {  # (holder's options, reader's options)
    "split-reads": (SPLIT, SPLIT),
    "reader-polls-only": ({}, {"progress_thread": False}),
}


def _serve_with(conn: Connection, name: str, config: PeerConfig, options: dict[str, Any]) -> None:
    """The child process: test_kvtransfer_nixl's server, its NixlTransfer built with options."""
    nixl_tests.NixlTransfer = functools.partial(NixlTransfer, **options)  # this child only
    nixl_tests._serve(conn, name, config)


class OptionsPeer(Peer):
    def __init__(self, name: str, config: PeerConfig, options: dict[str, Any]) -> None:
        self.name = name
        self.conn, child_conn = nixl_tests._CTX.Pipe()
        self.proc = nixl_tests._CTX.Process(
            target=_serve_with, args=(child_conn, name, config, options), daemon=True
        )
        self.proc.start()
        child_conn.close()


@pytest.fixture(scope="module", params=list(OPTIONS))
def peers(request: pytest.FixtureRequest) -> Iterator[dict[str, Peer]]:
    holder_options, reader_options = OPTIONS[request.param]
    peers: dict[str, Peer] = {
        "holder": OptionsPeer("holder", PeerConfig(seed=5), holder_options),
        "reader": OptionsPeer("reader", PeerConfig(), reader_options),
    }
    try:
        for peer in peers.values():
            peer.started()
        assert peers["reader"].call("add_peer", peers["holder"].call("metadata")) == "holder"
        yield peers
        assert peers["reader"].call("num_open_handles") == 0
    finally:
        stop_peers(list(peers.values()))


def test_read_moves_every_byte(peers: dict[str, Peer]) -> None:
    reader, holder = peers["reader"], peers["holder"]
    remote_ids = [*range(20, 30), 40, 50, 51]
    local_ids = [*range(10), 12, 14, 15]
    before = reader.call("block_bytes", [10, 11, 13])

    handle = reader.call("read_and_wait", "holder", remote_ids, local_ids)

    assert handle.num_blocks == 13
    assert handle.num_descs == 3  # coalesced descriptors (before any cutting into parts)
    assert_blocks_equal(reader, local_ids, holder, remote_ids)
    assert reader.call("block_bytes", [10, 11, 13]) == before  # untouched neighbours


def test_read_notifies_the_holder_once_after_completing(peers: dict[str, Peer]) -> None:
    reader, holder = peers["reader"], peers["holder"]
    reader.call("read_and_wait", "holder", list(range(8)), list(range(32, 40)), b"req-1 done")
    reader.call("read_and_wait", "holder", [60, 61, 62], [40, 41, 42], b"req-2 done")
    notifs = holder.call("wait_notifs", 2)

    # One message per read, in order: a duplicate of the first would arrive before the second.
    assert notifs == [Notification("reader", b"req-1 done"), Notification("reader", b"req-2 done")]
    assert_blocks_equal(reader, list(range(32, 40)), holder, list(range(8)))
