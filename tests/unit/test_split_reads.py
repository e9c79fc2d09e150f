"""Reads split into concurrent parts: layout.split_descriptors (pure) and NixlTransfer's
bookkeeping of parts over a scripted stand-in for the NIXL agent (no NIXL loaded)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvtransfer.base import KVTransferError, TransferState
from kvtransfer.layout import Descriptor, RegionLayout, block_descriptors, split_descriptors
from kvtransfer.nixl_transfer import NixlTransfer
from tests.unit.test_kvtransfer_handshake import make_meta

BLOCK_BYTES = 1024


def make_descs(
    local_ids: list[int], remote_ids: list[int]
) -> tuple[list[Descriptor], list[Descriptor]]:
    local, remote = (
        RegionLayout(0x10000, 64, BLOCK_BYTES),
        RegionLayout(0x900000, 64, BLOCK_BYTES, 1),
    )
    return block_descriptors(local, local_ids, remote, remote_ids)


def blocks(descs: list[Descriptor]) -> list[tuple[int, int]]:
    """Every (address, device) block the descriptors cover, in order."""
    return [
        (d.addr + i * BLOCK_BYTES, d.device_id)
        for d in descs
        for i in range(d.length // BLOCK_BYTES)
    ]


def check_split(
    local: list[Descriptor], remote: list[Descriptor], parts: int, min_part_bytes: int = 0
) -> list[tuple[list[Descriptor], list[Descriptor]]]:
    """Assert every invariant of split_descriptors; return its parts."""
    split = split_descriptors(local, remote, parts, BLOCK_BYTES, min_part_bytes)
    assert 1 <= len(split) <= parts
    for part_local, part_remote in split:
        assert part_local and [d.length for d in part_local] == [d.length for d in part_remote]
    assert blocks([d for p in split for d in p[0]]) == blocks(local)
    assert blocks([d for p in split for d in p[1]]) == blocks(remote)
    sizes = [sum(d.length for d in p[0]) for p in split]
    assert max(sizes) - min(sizes) <= BLOCK_BYTES  # balanced to within one block
    if len(split) > 1:
        assert min(sizes) >= min_part_bytes
    return split


def test_one_big_descriptor_is_cut_at_block_boundaries() -> None:
    local, remote = make_descs(list(range(10)), list(range(20, 30)))
    split = check_split(local, remote, 4)
    assert [len(p[0]) for p in split] == [1, 1, 1, 1]
    assert [p[0][0].length // BLOCK_BYTES for p in split] == [3, 3, 2, 2]
    assert split[1] == (
        [Descriptor(0x10000 + 3 * BLOCK_BYTES, 3 * BLOCK_BYTES, 0)],
        [Descriptor(0x900000 + 23 * BLOCK_BYTES, 3 * BLOCK_BYTES, 1)],
    )


def test_one_part_returns_the_lists_unchanged() -> None:
    local, remote = make_descs([3, 4, 9], [10, 11, 20])
    assert split_descriptors(local, remote, 1, BLOCK_BYTES) == [(local, remote)]


def test_parts_never_exceed_blocks_nor_go_under_the_minimum() -> None:
    local, remote = make_descs([0, 1, 2], [5, 6, 7])
    assert len(check_split(local, remote, 8)) == 3  # one block each
    local, remote = make_descs(list(range(10)), list(range(10)))
    assert len(check_split(local, remote, 8, min_part_bytes=3 * BLOCK_BYTES)) == 3
    assert len(check_split(local, remote, 8, min_part_bytes=2 * BLOCK_BYTES + 1)) == 3
    assert len(check_split(local, remote, 8, min_part_bytes=20 * BLOCK_BYTES)) == 1


@pytest.mark.parametrize("seed", range(30))
def test_random_splits_keep_every_invariant(seed: int) -> None:
    rng = random.Random(seed)
    num_blocks = rng.randint(1, 40)
    local_ids = rng.sample(range(64), num_blocks)
    remote_ids = sorted(rng.sample(range(64), num_blocks)) if rng.random() < 0.5 else local_ids
    local, remote = make_descs(local_ids, remote_ids)
    check_split(local, remote, rng.randint(1, 9), rng.choice([0, 1, 3, 7]) * BLOCK_BYTES)


@pytest.mark.parametrize(
    ("local", "remote", "parts", "match"),
    [
        ([Descriptor(0, BLOCK_BYTES, 0)], [Descriptor(0, BLOCK_BYTES, 0)], 0, "parts must be"),
        ([Descriptor(0, BLOCK_BYTES, 0)], [], 2, "1 local and 0 remote"),
        ([Descriptor(0, BLOCK_BYTES, 0)], [Descriptor(0, 2 * BLOCK_BYTES, 0)], 2, "same whole"),
        ([Descriptor(0, 100, 0)], [Descriptor(0, 100, 0)], 2, "same whole"),
    ],
)
def test_bad_descriptor_lists_are_refused(
    local: list[Descriptor], remote: list[Descriptor], parts: int, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        split_descriptors(local, remote, parts, BLOCK_BYTES)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_parts_per_read": 0}, "max_parts_per_read must be >= 1"),
        ({"min_part_bytes": -1}, "min_part_bytes must be >= 0"),
    ],
)
def test_bad_part_settings_are_refused(kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        NixlTransfer("tiny", **kwargs)


# -- NixlTransfer over a scripted agent ------------------------------------------------------


class FakeXfer:
    def __init__(self, agent: FakeAgent, notif_msg: bytes) -> None:
        self.agent, self.notif_msg = agent, notif_msg
        self.status = "PROC"
        self.released = False

    def release(self) -> None:
        if self in self.agent.fail_release:
            raise RuntimeError("release refused")
        self.released = True


class FakeAgent:
    """Records READs and notifications; a test sets each part's status by hand."""

    def __init__(self) -> None:
        self.xfers: list[FakeXfer] = []
        self.notifs: list[tuple[str, bytes]] = []
        self.fail_release: list[FakeXfer] = []

    def get_xfer_descs(self, descs: Any, mem_type: str) -> Any:
        return descs

    def initialize_xfer(self, op: str, local: Any, remote: Any, peer: str, notif: bytes, **_: Any):
        self.xfers.append(FakeXfer(self, notif))
        return self.xfers[-1]

    def transfer(self, xfer: FakeXfer) -> str:
        return xfer.status

    def check_xfer_state(self, xfer: FakeXfer) -> str:
        return xfer.status

    def send_notif(self, peer: str, msg: bytes, backend: str | None = None) -> None:
        self.notifs.append((peer, msg))


def make_transfer(max_parts_per_read: int) -> tuple[NixlTransfer, FakeAgent]:
    transfer = NixlTransfer(
        "tiny", "reader", max_parts_per_read=max_parts_per_read, min_part_bytes=1
    )
    transfer._agent = agent = FakeAgent()
    transfer._meta = make_meta("reader")
    transfer._peers["holder"] = make_meta("holder")
    return transfer, agent


def test_split_read_is_done_when_every_part_is_then_notifies_once() -> None:
    transfer, agent = make_transfer(4)
    handle = transfer.read("holder", list(range(8)), list(range(8)), b"req-1 done")

    assert len(agent.xfers) == 4 and handle.num_descs == 1
    assert all(x.notif_msg == b"" for x in agent.xfers)  # not attached to any part
    for xfer in agent.xfers[:3]:
        xfer.status = "DONE"
        assert transfer.poll(handle) is TransferState.PENDING
    assert agent.notifs == []
    agent.xfers[3].status = "DONE"
    assert transfer.poll(handle) is TransferState.DONE
    assert transfer.poll(handle) is TransferState.DONE
    assert agent.notifs == [("holder", b"req-1 done")]
    transfer.release(handle)
    assert all(x.released for x in agent.xfers) and transfer.num_open_handles == 0


def test_one_part_keeps_the_notification_on_the_read() -> None:
    transfer, agent = make_transfer(1)
    handle = transfer.read("holder", list(range(8)), list(range(8)), b"req-2 done")
    assert [x.notif_msg for x in agent.xfers] == [b"req-2 done"]
    agent.xfers[0].status = "DONE"
    assert transfer.poll(handle) is TransferState.DONE
    assert agent.notifs == []
    transfer.release(handle)


def test_one_failed_part_fails_the_read_without_notifying() -> None:
    transfer, agent = make_transfer(3)
    handle = transfer.read("holder", list(range(6)), list(range(6)), b"req-3 done")
    agent.xfers[0].status = "DONE"
    agent.xfers[1].status = "ERR"
    assert transfer.poll(handle) is TransferState.FAILED
    agent.xfers[2].status = "DONE"
    assert transfer.poll(handle) is TransferState.FAILED
    assert agent.notifs == []
    transfer.release(handle)
    assert all(x.released for x in agent.xfers)


def test_a_part_that_cannot_be_released_does_not_leak_the_others() -> None:
    transfer, agent = make_transfer(3)
    handle = transfer.read("holder", list(range(6)), list(range(6)))
    agent.fail_release.append(agent.xfers[1])

    with pytest.raises(KVTransferError, match=r"1 part\(s\).*release refused"):
        transfer.release(handle)
    assert [x.released for x in agent.xfers] == [True, False, True]
    assert transfer.poll(handle) is TransferState.FAILED  # partly cancelled: never completes
    assert transfer.num_open_handles == 1

    agent.fail_release.clear()
    transfer.release(handle)  # release again later
    assert all(x.released for x in agent.xfers) and transfer.num_open_handles == 0
