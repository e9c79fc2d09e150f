"""Block ids -> NIXL descriptors; owns no state (pure functions over a region's geometry).

A region is one registered KV tensor: `num_blocks` blocks of `block_bytes` bytes each, laid
out back to back from `base_addr`. Pairs (local block, remote block) whose ids both advance by
one are coalesced into a single descriptor, so a run of adjacent blocks moves as one region.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral
from typing import NamedTuple


class Descriptor(NamedTuple):
    """One contiguous memory region as NIXL takes it: (address, length in bytes, device id)."""

    addr: int
    length: int
    device_id: int


class BlockRun(NamedTuple):
    """`num_blocks` adjacent blocks starting at `local_start` (and `remote_start` on the peer)."""

    local_start: int
    remote_start: int
    num_blocks: int


@dataclass(frozen=True)
class RegionLayout:
    """Geometry of one registered KV tensor: block i starts at base_addr + i * block_bytes."""

    base_addr: int
    num_blocks: int
    block_bytes: int
    device_id: int = 0

    def __post_init__(self) -> None:
        if self.num_blocks < 1 or self.block_bytes < 1:
            raise ValueError(
                f"region needs num_blocks >= 1 and block_bytes >= 1, "
                f"got {self.num_blocks} and {self.block_bytes}"
            )

    def check_block_ids(self, block_ids: Sequence[int], side: str) -> None:
        """Raise ValueError naming the first id outside [0, num_blocks)."""
        for block_id in block_ids:
            if not isinstance(block_id, Integral) or isinstance(block_id, bool):
                raise ValueError(f"{side} block id {block_id!r} is not an int")
            if not 0 <= block_id < self.num_blocks:
                raise ValueError(
                    f"{side} block id {block_id} is out of range [0, {self.num_blocks})"
                )

    def descriptor(self, start_block: int, num_blocks: int) -> Descriptor:
        return Descriptor(
            self.base_addr + start_block * self.block_bytes,
            num_blocks * self.block_bytes,
            self.device_id,
        )


def coalesce_runs(local_ids: Sequence[int], remote_ids: Sequence[int]) -> list[BlockRun]:
    """Group (local, remote) pairs into runs contiguous on BOTH sides.

    Pairs are sorted by local id first (each pair moves independently, so order is free);
    e.g. local [3, 4, 5, 9] / remote [10, 11, 12, 20] -> runs (3, 10, 3) and (9, 20, 1).
    """
    if len(local_ids) != len(remote_ids):
        raise ValueError(
            f"got {len(local_ids)} local and {len(remote_ids)} remote block ids; "
            "they must pair up one to one"
        )
    if len(set(local_ids)) != len(local_ids):
        raise ValueError(f"local block ids repeat: {sorted(local_ids)}")
    runs: list[BlockRun] = []
    for local_id, remote_id in sorted(zip(local_ids, remote_ids, strict=True)):
        if runs:
            last = runs[-1]
            if (
                local_id == last.local_start + last.num_blocks
                and remote_id == last.remote_start + last.num_blocks
            ):
                runs[-1] = last._replace(num_blocks=last.num_blocks + 1)
                continue
        runs.append(BlockRun(local_id, remote_id, 1))
    return runs


def block_descriptors(
    local: RegionLayout,
    local_ids: Sequence[int],
    remote: RegionLayout,
    remote_ids: Sequence[int],
) -> tuple[list[Descriptor], list[Descriptor]]:
    """Validated, coalesced (local descriptors, remote descriptors), paired by index."""
    if local.block_bytes != remote.block_bytes:
        raise ValueError(
            f"block sizes differ: local {local.block_bytes} B, remote {remote.block_bytes} B"
        )
    if not local_ids:
        raise ValueError("no blocks to transfer")
    local.check_block_ids(local_ids, "local")
    remote.check_block_ids(remote_ids, "remote")
    runs = coalesce_runs(local_ids, remote_ids)
    local_descs = [local.descriptor(r.local_start, r.num_blocks) for r in runs]
    remote_descs = [remote.descriptor(r.remote_start, r.num_blocks) for r in runs]
    return local_descs, remote_descs


DescriptorPairs = tuple[list[Descriptor], list[Descriptor]]


def split_descriptors(
    local: Sequence[Descriptor],
    remote: Sequence[Descriptor],
    parts: int,
    block_bytes: int,
    min_part_bytes: int = 0,
) -> list[DescriptorPairs]:
    """Cut paired descriptor lists into at most `parts` lists of nearly equal bytes.

    Cuts fall on block boundaries, so a descriptor may be split in two (on both sides at
    once: pairs keep equal lengths). Part sizes differ by at most one block; there are never
    more parts than blocks, nor parts under `min_part_bytes` (unless there is only one part).
    The parts, concatenated, cover the same bytes in the same order as the input.
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    if len(local) != len(remote):
        raise ValueError(f"got {len(local)} local and {len(remote)} remote descriptors")
    for loc, rem in zip(local, remote, strict=True):
        if loc.length != rem.length or loc.length < 1 or loc.length % block_bytes:
            raise ValueError(f"descriptors {loc} / {rem} are not the same whole blocks")
    num_blocks = sum(d.length for d in local) // block_bytes
    min_blocks = max(1, -(-min_part_bytes // block_bytes))
    parts = max(1, min(parts, num_blocks // min_blocks))
    if parts == 1:
        return [(list(local), list(remote))]
    small, num_big = divmod(num_blocks, parts)
    targets = [small + 1] * num_big + [small] * (parts - num_big)  # blocks per part
    result: list[DescriptorPairs] = [([], []) for _ in targets]
    part = 0
    room = targets[0]
    for loc, rem in zip(local, remote, strict=True):
        offset, left = 0, loc.length // block_bytes
        while left:
            if room == 0:
                part += 1
                room = targets[part]
            take = min(left, room)
            for descs, d in zip(result[part], (loc, rem), strict=True):
                descs.append(Descriptor(d.addr + offset, take * block_bytes, d.device_id))
            offset += take * block_bytes
            left -= take
            room -= take
    return result


def head_slice_descriptors(
    local: RegionLayout,
    local_heads: range,
    local_ids: Sequence[int],
    remote: RegionLayout,
    remote_heads: range,
    remote_ids: Sequence[int],
    heads: range,
    num_layers: int,
) -> DescriptorPairs:
    """(local, remote) descriptors of KV heads `heads` of each (block, layer, k|v) between two
    caches holding different head ranges of the model (tensor-parallel ranks). A block is
    [num_layers, 2, its heads, block_size, head_dim]: a head range of one (layer, k|v) is
    contiguous; slices contiguous on both sides (whole blocks when both hold `heads` only)
    are coalesced."""
    if not heads or heads.start < max(local_heads.start, remote_heads.start):
        raise ValueError(f"heads {heads} are not held by both sides")
    if heads.stop > min(local_heads.stop, remote_heads.stop):
        raise ValueError(f"heads {heads} are not held by both sides")
    head_bytes = local.block_bytes // (num_layers * 2 * len(local_heads))
    for region, held, side in ((local, local_heads, "local"), (remote, remote_heads, "remote")):
        if region.block_bytes != num_layers * 2 * len(held) * head_bytes:
            raise ValueError(
                f"{side} blocks of {region.block_bytes} B do not hold {num_layers} layers x "
                f"k|v x {len(held)} heads of {head_bytes} B"
            )
    if len(local_ids) != len(remote_ids):
        raise ValueError(f"got {len(local_ids)} local and {len(remote_ids)} remote block ids")
    if not local_ids:
        raise ValueError("no blocks to transfer")
    local.check_block_ids(local_ids, "local")
    remote.check_block_ids(remote_ids, "remote")
    length = len(heads) * head_bytes
    local_descs: list[Descriptor] = []
    remote_descs: list[Descriptor] = []
    for local_id, remote_id in sorted(zip(local_ids, remote_ids, strict=True)):
        for chunk in range(num_layers * 2):  # (layer, k|v), in memory order
            pair = (
                local.base_addr
                + local_id * local.block_bytes
                + (chunk * len(local_heads) + heads.start - local_heads.start) * head_bytes,
                remote.base_addr
                + remote_id * remote.block_bytes
                + (chunk * len(remote_heads) + heads.start - remote_heads.start) * head_bytes,
            )
            if (
                local_descs
                and local_descs[-1].addr + local_descs[-1].length == pair[0]
                and remote_descs[-1].addr + remote_descs[-1].length == pair[1]
            ):
                local_descs[-1] = local_descs[-1]._replace(length=local_descs[-1].length + length)
                remote_descs[-1] = remote_descs[-1]._replace(
                    length=remote_descs[-1].length + length
                )
                continue
            local_descs.append(Descriptor(pair[0], length, local.device_id))
            remote_descs.append(Descriptor(pair[1], length, remote.device_id))
    return local_descs, remote_descs
