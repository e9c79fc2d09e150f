"""BlockCopy: one block copy the KV cache manager owes the engine (a value; owns no state)."""

from __future__ import annotations

from typing import NamedTuple


class BlockCopy(NamedTuple):
    """A block whose KV (every layer) must be copied: src -> dst. kind "device": both are device
    blocks; "to_host": a device block into a host slot; "from_host": a host slot into a device
    block."""

    src_block_id: int
    dst_block_id: int
    kind: str = "device"
