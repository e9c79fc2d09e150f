"""The handoff between tensor-parallel layouts, without NIXL: which remote rank each local KV
head is read from (or a refusal naming both layouts), and the head-slice descriptors that read
them, checked by applying them to real tensors (bytes moved as NIXL would move them)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtransfer.base import AgentMetadata
from kvtransfer.handshake import (
    PROTOCOL_VERSION,
    IncompatiblePeerError,
    check_compatible,
    compat_hash,
    head_sources,
)
from kvtransfer.layout import Descriptor, RegionLayout, head_slice_descriptors

LAYERS, BLOCK, DIM, HEADS = 2, 4, 8, 4  # the model: 4 KV heads


def meta(name: str, heads: range, tp: int, ranks: tuple[AgentMetadata, ...] = ()) -> AgentMetadata:
    shape = (LAYERS, 2, len(heads), BLOCK, DIM)
    full = (LAYERS, 2, HEADS, BLOCK, DIM)
    return AgentMetadata(
        agent_name=name,
        protocol_version=PROTOCOL_VERSION,
        compat_hash=compat_hash("tiny", "float32", BLOCK, full),
        model_id="tiny",
        dtype="float32",
        block_size=BLOCK,
        block_shape=shape,
        nixl_metadata=b"",
        base_addr=0,
        num_blocks=16,
        block_bytes=LAYERS * 2 * len(heads) * BLOCK * DIM * 4,
        device_kind="cpu",
        device_id=0,
        tp_size=tp,
        kv_head_start=heads.start,
        num_model_kv_heads=HEADS if tp > 1 else 0,
        rank_agents=ranks,
    )


def tp_holder(tp: int) -> AgentMetadata:
    step = HEADS // tp
    ranks = tuple(meta(f"p-r{r}", range(r * step, (r + 1) * step), tp) for r in range(1, tp))
    return meta("p", range(0, step), tp, ranks)


def test_each_head_is_read_from_the_rank_holding_it() -> None:
    reader = meta("d", range(HEADS), 1)
    sources = head_sources(reader, tp_holder(2))
    assert [(m.agent_name, h) for m, h in sources] == [("p", range(0, 2)), ("p-r1", range(2, 4))]
    check_compatible(reader, tp_holder(4))  # TP 4 -> 1: compatible
    assert len(head_sources(reader, tp_holder(4))) == 4


def test_unmappable_pairings_are_refused_naming_both_layouts() -> None:
    rank1 = meta("d-r1", range(2, 4), 2)  # a reader's rank: its own heads only
    assert [(m.agent_name, h) for m, h in head_sources(rank1, tp_holder(4))] == [
        ("p-r2", range(2, 3)),
        ("p-r3", range(3, 4)),
    ]
    gap = dataclasses.replace(tp_holder(2), rank_agents=(meta("p-r1", range(0, 2), 2),))
    with pytest.raises(IncompatiblePeerError, match="no rank holds KV head 2") as info:
        check_compatible(meta("d", range(HEADS), 1), gap)
    assert "TP 1, KV heads [0, 4)" in str(info.value) and "TP 2, KV heads [0, 2)" in str(info.value)
    missing = dataclasses.replace(tp_holder(2), rank_agents=())
    with pytest.raises(IncompatiblePeerError, match="names 1 rank agents for TP 2"):
        check_compatible(meta("d", range(HEADS), 1), missing)
    other_model = dataclasses.replace(tp_holder(2), num_model_kv_heads=8)
    with pytest.raises(IncompatiblePeerError, match="layout") as info:
        check_compatible(meta("d", range(HEADS), 1), other_model)
    assert "block_shape" in info.value.differences


def test_head_slice_descriptors_move_each_rank_heads_into_place() -> None:
    """Two holder ranks (2 heads each) read into one reader (4 heads): the reader's blocks
    equal the full model's blocks, head for head."""
    full = torch.randn(6, LAYERS, 2, HEADS, BLOCK, DIM)
    ranks = [full[:, :, :, 0:2].contiguous(), full[:, :, :, 2:4].contiguous()]
    reader = torch.zeros_like(full)
    local_ids, remote_ids = [1, 2, 3], [4, 5, 0]
    flat = reader.view(-1).view(torch.uint8)
    for r, held in enumerate(ranks):
        local = RegionLayout(reader.data_ptr(), 6, reader[0].numel() * 4)
        remote = RegionLayout(held.data_ptr(), 6, held[0].numel() * 4)
        heads = range(2 * r, 2 * r + 2)
        local_descs, remote_descs = head_slice_descriptors(
            local, range(HEADS), local_ids, remote, heads, remote_ids, heads, LAYERS
        )
        # per block: the (layer, k|v) chunks are 4 slices of 2 heads, none adjacent locally
        assert len(local_descs) == 3 * LAYERS * 2
        source = held.view(-1).view(torch.uint8)
        for loc, rem in zip(local_descs, remote_descs, strict=True):
            assert loc.length == rem.length
            at, src = loc.addr - reader.data_ptr(), rem.addr - held.data_ptr()
            flat[at : at + loc.length] = source[src : src + rem.length]
    for local_id, remote_id in zip(local_ids, remote_ids, strict=True):
        assert torch.equal(reader[local_id], full[remote_id])
    assert reader[0].abs().sum() == 0  # nothing else written


def test_slices_of_whole_blocks_coalesce_and_bad_geometry_is_refused() -> None:
    region = RegionLayout(0, 8, LAYERS * 2 * 2 * 16)
    local, remote = head_slice_descriptors(
        region, range(2, 4), [0, 1], region, range(2, 4), [3, 4], range(2, 4), LAYERS
    )
    assert local == [Descriptor(0, 2 * region.block_bytes, 0)]  # two whole blocks: one
    assert remote == [Descriptor(3 * region.block_bytes, 2 * region.block_bytes, 0)]
    with pytest.raises(ValueError, match="not held by both sides"):
        head_slice_descriptors(region, range(2), [0], region, range(2, 4), [0], range(2, 3), 2)
    odd = RegionLayout(0, 8, 100)
    with pytest.raises(ValueError, match="remote blocks of 100 B"):
        head_slice_descriptors(region, range(2), [0], odd, range(2), [0], range(2), LAYERS)


def test_fp8_kv_scales_must_match() -> None:
    reader = dataclasses.replace(meta("d", range(HEADS), 1), kv_scales=((0.5, 0.25),) * LAYERS)
    holder = dataclasses.replace(tp_holder(2), kv_scales=((0.5, 0.25),) * LAYERS)
    check_compatible(reader, holder)
    other = dataclasses.replace(holder, kv_scales=((0.5, 0.5),) * LAYERS)
    with pytest.raises(IncompatiblePeerError, match="KV scales") as info:
        check_compatible(reader, other)
    assert info.value.differences == ("kv_scales",)


def test_a_host_lease_reads_each_rank_heads_from_its_own_host_tier() -> None:
    """A TP 2 holder's host lease: the first remote ids are slots of each rank's own host
    memory (DRAM), the rest device blocks; the parts a reader of every head posts (one per
    rank and memory) fill its blocks with the full model's KV, head for head."""
    from kvtransfer.nixl_transfer import NixlTransfer

    device = torch.randn(6, LAYERS, 2, HEADS, BLOCK, DIM)
    host = torch.randn(5, LAYERS, 2, HEADS, BLOCK, DIM)
    halves = [range(0, 2), range(2, 4)]
    held = [(device[:, :, :, h].contiguous(), host[:, :, :, h].contiguous()) for h in halves]

    def rank_meta(r: int, ranks: tuple[AgentMetadata, ...] = ()) -> AgentMetadata:
        cache, slots = held[r]
        return dataclasses.replace(
            meta(f"p-r{r}" if r else "p", halves[r], 2, ranks),
            base_addr=cache.data_ptr(),
            num_blocks=cache.shape[0],
            host_base_addr=slots.data_ptr(),
            host_num_blocks=slots.shape[0],
        )

    holder = rank_meta(0, (rank_meta(1),))
    reader = torch.zeros(8, LAYERS, 2, HEADS, BLOCK, DIM)
    local = dataclasses.replace(
        meta("d", range(HEADS), 1), base_addr=reader.data_ptr(), num_blocks=reader.shape[0]
    )
    remote_ids, local_ids = [4, 1, 0, 5], [2, 3, 4, 7]  # slots 4, 1 then device blocks 0, 5
    parts = NixlTransfer("tiny")._head_slice_parts(local, local_ids, holder, remote_ids, 2)
    # per rank: its host slots' part, then its device blocks' (both DRAM on a CPU holder)
    assert [(mem, agent) for _, mem, agent in parts] == [
        ("DRAM", "p"),
        ("DRAM", "p"),
        ("DRAM", "p-r1"),
        ("DRAM", "p-r1"),
    ]
    sources = [t for pair in held for t in pair]
    flat = reader.view(-1).view(torch.uint8)
    for (local_descs, remote_descs), _, _ in parts:
        for loc, rem in zip(local_descs, remote_descs, strict=True):
            source = next(t for t in sources if t.data_ptr() <= rem.addr < t.data_ptr() + t.nbytes)
            raw = source.view(-1).view(torch.uint8)
            at, src = loc.addr - reader.data_ptr(), rem.addr - source.data_ptr()
            flat[at : at + loc.length] = raw[src : src + rem.length]
    assert torch.equal(reader[2], host[4]) and torch.equal(reader[3], host[1])
    assert torch.equal(reader[4], device[0]) and torch.equal(reader[7], device[5])
    assert reader[[0, 1, 5, 6]].abs().sum() == 0  # nothing else written
