"""NixlTransfer with CUDA KV tensors (VRAM): GPU <- GPU and GPU <- CPU reads between processes,
and a host lease's read: a GPU holder's pinned host tier (DRAM) and VRAM blocks in one read."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.integration.test_kvtransfer_nixl import (
    Peer,
    PeerConfig,
    assert_blocks_equal,
    start_peers,
    stop_peers,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]


@pytest.fixture(scope="module")
def peers() -> Iterator[dict[str, Peer]]:
    peers = start_peers(
        {
            "gpu_holder": PeerConfig(seed=1, device="cuda:0", host_blocks=8),
            "cpu_holder": PeerConfig(seed=2),
            "gpu_reader": PeerConfig(device=f"cuda:{torch.cuda.device_count() - 1}"),
        }
    )
    yield peers
    stop_peers(list(peers.values()))


@pytest.mark.parametrize("holder_name", ["gpu_holder", "cpu_holder"])
def test_gpu_reader_pulls_blocks(peers: dict[str, Peer], holder_name: str) -> None:
    reader, holder = peers["gpu_reader"], peers[holder_name]
    meta = holder.call("metadata")
    assert reader.call("add_peer", meta) == holder_name
    remote_ids, local_ids = [0, 1, 2, 17, 50, 51], [10, 11, 12, 3, 60, 61]
    handle = reader.call("read_and_wait", holder_name, remote_ids, local_ids)
    assert handle.num_descs == 3
    assert_blocks_equal(reader, local_ids, holder, remote_ids)
    assert reader.call("num_open_handles") == 0


def test_gpu_reader_pulls_a_gpu_holders_host_tier_and_device_blocks(
    peers: dict[str, Peer],
) -> None:
    reader, holder = peers["gpu_reader"], peers["gpu_holder"]
    assert reader.call("add_peer", holder.call("metadata")) == "gpu_holder"
    handle = reader.call("read_and_wait", "gpu_holder", [2, 3, 40], [20, 21, 22], b"", 2)
    assert handle.num_blocks == 3 and handle.num_descs == 2
    assert reader.call("block_bytes", [20, 21]) == holder.call("host_bytes", [2, 3])
    assert_blocks_equal(reader, [22], holder, [40])
    assert reader.call("num_open_handles") == 0
