"""kvtransfer.layout: block ids -> coalesced NIXL descriptors (pure Python, no NIXL)."""

from __future__ import annotations

import pytest

from kvtransfer.layout import BlockRun, Descriptor, RegionLayout, block_descriptors, coalesce_runs

BLOCK_BYTES = 1024


def make_region(base_addr: int = 0x10000, num_blocks: int = 64, device_id: int = 0) -> RegionLayout:
    return RegionLayout(base_addr, num_blocks, BLOCK_BYTES, device_id)


def test_runs_must_be_contiguous_on_both_sides() -> None:
    runs = coalesce_runs([3, 4, 5, 9], [10, 11, 12, 20])
    assert runs == [BlockRun(3, 10, 3), BlockRun(9, 20, 1)]


def test_adjacent_local_but_not_remote_is_split() -> None:
    assert coalesce_runs([0, 1, 2], [5, 7, 8]) == [BlockRun(0, 5, 1), BlockRun(1, 7, 2)]
    assert coalesce_runs([0, 2], [5, 6]) == [BlockRun(0, 5, 1), BlockRun(2, 6, 1)]


def test_pairs_are_sorted_by_local_id_before_coalescing() -> None:
    assert coalesce_runs([5, 3, 4], [12, 10, 11]) == [BlockRun(3, 10, 3)]


def test_single_block_and_whole_pool() -> None:
    assert coalesce_runs([7], [0]) == [BlockRun(7, 0, 1)]
    assert coalesce_runs(list(range(64)), list(range(64))) == [BlockRun(0, 0, 64)]


def test_descriptors_address_whole_blocks() -> None:
    local, remote = make_region(0x10000), make_region(0x900000, device_id=1)
    local_descs, remote_descs = block_descriptors(local, [3, 4, 5, 9], remote, [10, 11, 12, 20])
    assert local_descs == [
        Descriptor(0x10000 + 3 * BLOCK_BYTES, 3 * BLOCK_BYTES, 0),
        Descriptor(0x10000 + 9 * BLOCK_BYTES, BLOCK_BYTES, 0),
    ]
    assert remote_descs == [
        Descriptor(0x900000 + 10 * BLOCK_BYTES, 3 * BLOCK_BYTES, 1),
        Descriptor(0x900000 + 20 * BLOCK_BYTES, BLOCK_BYTES, 1),
    ]


@pytest.mark.parametrize(
    ("local_ids", "remote_ids", "match"),
    [
        ([0, 64], [0, 1], "local block id 64 is out of range"),
        ([0, 1], [0, -1], "remote block id -1 is out of range"),
        ([0, 1], [0], "pair up"),
        ([1, 1], [2, 3], "local block ids repeat"),
        ([], [], "no blocks"),
        ([0.0], [1], "not an int"),
    ],
)
def test_bad_block_ids_are_refused(local_ids: list, remote_ids: list, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        block_descriptors(make_region(), local_ids, make_region(), remote_ids)


def test_block_bytes_must_match() -> None:
    other = RegionLayout(0, 64, 2 * BLOCK_BYTES)
    with pytest.raises(ValueError, match="block sizes differ"):
        block_descriptors(make_region(), [0], other, [0])


def test_region_rejects_empty_geometry() -> None:
    with pytest.raises(ValueError):
        RegionLayout(0, 0, BLOCK_BYTES)
